"""tools/cudnn_chunked.py's chunk table (the chunked cuDNN attention prototype of the attention sweep) against a
plain-Python reading of the same cu_seqlens: every real row in exactly one chunk of at most ``chunk`` queries, each
chunk's keys its whole segment, offsets in elements of the scratch, qkv and output rows. Device ops only, so it runs
on the CPU; the attention itself (cuDNN) runs in the sweep on a GPU."""
import numpy as np
import pytest
import torch

from tools.cudnn_chunked import TABLE_ROWS, chunk_table, max_chunks

HEADS, HEAD_DIM = 2, 8
WIDTH = HEADS * HEAD_DIM


def expected(lengths, slots, rows, chunk):
    entries = []
    start = 0
    for n in lengths:
        for q in range(start, start + n, chunk):
            q_len = min(chunk, start + n - q)
            entries.append((q_len, n, q * 2 * WIDTH, start * 2 * WIDTH, start * 3 * WIDTH, q * WIDTH))
        start += n
    total = max_chunks(rows, slots, chunk)
    end = sum(lengths)
    entries += [(0, 0, 0, 0, 0, 0)] * (total - len(entries)) + [(0, 0, end * 2 * WIDTH, end * 2 * WIDTH,
                                                                 end * 3 * WIDTH, end * WIDTH)]
    return np.array(entries, dtype=np.int64).T


@pytest.mark.parametrize("lengths, rows, slots, chunk", [
    ((1024,) * 8, 8192, 66, 128),          # eight 448² images: whole chunks
    ((5329,), 5332, 66, 256),              # one long segment, a partial last chunk
    ((1024, 256, 576, 2304, 256, 64, 1600), 6080, 66, 128),  # mixed sizes, one segment shorter than a chunk
    ((3, 1, 7), 16, 6, 4),                 # tiny, unused slots
])
def test_chunk_table_matches_a_plain_reading(lengths, rows, slots, chunk):
    cu = np.full(slots + 1, sum(lengths), dtype=np.int32)
    cu[0] = 0
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    table = chunk_table(torch.from_numpy(cu), chunk, rows, HEADS, HEAD_DIM)
    assert table.dtype == torch.int32 and table.shape == (len(TABLE_ROWS), max_chunks(rows, slots, chunk) + 1)
    np.testing.assert_array_equal(table.numpy(), expected(lengths, slots, rows, chunk))
    assert table[0].sum().item() == sum(lengths)  # every real row is the query of exactly one chunk


def _interpreter_child() -> None:
    """Runs with TRITON_INTERPRET=1: the one-pass rotation against the library's launch, real rows only."""
    import json

    from glmvit.kernels.triton_attention import rotate_qk_triton
    from glmvit.metadata import BatchShape, build_metadata
    from glmvit.rotary import inv_freq, rotary_cos_sin
    from tools.cudnn_chunked import rotate_qk_rows

    torch.set_num_threads(2)
    meta = build_metadata([(1, 4, 6), (2, 2, 4), (1, 10, 8), (1, 2, 2)], 2, BatchShape(140, 8, 140)).to("cpu")
    qkv = torch.randn(meta.shape.rows, 3 * HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(HEAD_DIM))
    n = meta.host.num_rows
    ours = rotate_qk_rows(qkv, cos, sin, meta.cu_seqlens, HEADS)[:n]
    library = rotate_qk_triton(qkv, cos, sin, meta.cu_seqlens, HEADS)[:n]
    print(json.dumps({"rows": n, "equal": bool(torch.equal(ours, library)),
                      "max_diff": (ours - library).abs().max().item()}))


def test_one_pass_rotation_is_the_library_launch_bitwise():
    from conftest import run_interpreted

    result = run_interpreted("test_cudnn_chunked")
    assert result["rows"] == 124 and result["equal"], result
