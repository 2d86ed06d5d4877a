"""The padded metadata layout: padding lies outside every attention segment, so it costs no attention work."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glmvit.metadata import BatchShape, attention_work, build_metadata, item_row_starts, items_of_rows

MERGE, AREA = 2, 4

grid_rows = st.tuples(st.integers(1, 3), st.integers(1, 8).map(lambda n: 2 * n), st.integers(1, 8).map(lambda n: 2 * n))


@st.composite
def padded_layouts(draw):
    """Random grids (images and clips) and a static shape with room to spare in rows, segment slots and length."""
    grids = np.array(draw(st.lists(grid_rows, max_size=6)), dtype=np.int64).reshape(-1, 3)
    frames = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    rows = int(frames.sum()) + AREA * draw(st.integers(0, 80))
    segments = len(frames) + draw(st.integers(0, 4))
    longest = int(frames.max()) if len(frames) else 0
    return grids, BatchShape(rows, segments, longest + AREA * draw(st.integers(0, 8)))


def views(meta):
    """(cu_seqlens, segment_ids, token_valid) of a host metadata, as numpy arrays."""
    c, r = meta.shape.cu_slots, meta.shape.rows
    base = c + 4 * r
    return meta.packed[:c], meta.packed[base : base + r], meta.packed[base + r :]


@settings(max_examples=200, deadline=None)
@given(st.lists(grid_rows, max_size=6))
def test_item_row_starts_count_every_frame(rows):
    """Each item holds t·h·w pixel rows (a clip's frames one after another); every row maps back to its own item."""
    grids = np.array(rows, dtype=np.int64).reshape(-1, 3)
    sizes = [t * h * w for t, h, w in rows]
    assert item_row_starts(grids).tolist() == [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    owner = [i for i, size in enumerate(sizes) for _ in range(size)]
    for row, item in enumerate(owner):
        assert items_of_rows(grids, np.array([row])) == [item]


@settings(max_examples=300, deadline=None)
@given(padded_layouts())
def test_padding_costs_no_attention_work(layout):
    grids, shape = layout
    padded, exact = build_metadata(grids, MERGE, shape), build_metadata(grids, MERGE)
    real = int(sum(t * (h * w) ** 2 for t, h, w in grids))
    assert attention_work(exact) == real
    assert attention_work(padded) == real, "padded rows were put into an attention segment"


@settings(max_examples=300, deadline=None)
@given(padded_layouts())
def test_padded_layout_invariants(layout):
    grids, shape = layout
    meta = build_metadata(grids, MERGE, shape)
    cu, seg, valid = views(meta)
    n, num_rows = int(grids[:, 0].sum()) if len(grids) else 0, meta.num_rows
    frames = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    assert cu[0] == 0 and np.all(np.diff(cu) >= 0)
    assert cu[1 : n + 1].tolist() == np.cumsum(frames).tolist()  # one segment per temporal patch, in order
    assert np.all(cu[n + 1 :] == num_rows)  # every other slot is empty: padded rows lie in no segment
    assert np.all(cu % AREA == 0)  # no 2×2 merge block straddles two segments or a segment and the padding
    assert np.all(np.diff(cu) <= shape.max_seqlen)
    for i in range(n):
        assert np.all(seg[cu[i] : cu[i + 1]] == i)
    pad_ids = seg[num_rows:]
    assert len(set(pad_ids.tolist())) == len(pad_ids) and np.all(pad_ids >= n) and np.all(pad_ids < shape.rows)
    assert valid.tolist() == [1] * (num_rows // AREA) + [0] * ((shape.rows - num_rows) // AREA)


@settings(max_examples=100, deadline=None)
@given(padded_layouts())
def test_masked_backend_work_is_linear_in_the_padding(layout):
    """sdpa_masked attends within equal segment ids: each padded row's block is itself alone (1 score per row)."""
    grids, shape = layout
    meta = build_metadata(grids, MERGE, shape)
    _, seg, _ = views(meta)
    _, counts = np.unique(seg, return_counts=True)
    assert int((counts.astype(np.int64) ** 2).sum()) == attention_work(meta) + (shape.rows - meta.num_rows)


def test_attention_work_by_hand():
    meta = build_metadata([[1, 4, 6], [2, 2, 2]], MERGE, BatchShape(rows=64, segments=5, max_seqlen=64))
    assert meta.cu_seqlens.tolist() == [0, 24, 28, 32, 32, 32, 32, 32]
    assert attention_work(meta) == 24**2 + 4**2 + 4**2


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 5, 6, 7, 8, 31])
def test_every_section_starts_16_byte_aligned(segments):
    """torch.compile copies a misaligned input on every call: each view of the packed buffer must be aligned."""
    meta = build_metadata([[1, 2, 2]], 2, BatchShape(64, segments, 64)).to("cpu")
    for view in (meta.cu_seqlens, meta.h_idx, meta.w_idx, meta.target_h, meta.target_w, meta.segment_ids,
                 meta.token_valid):
        assert (view.data_ptr() - meta.packed.data_ptr()) % 16 == 0


SEGFAULT_SCRIPT = """
import torch
from glmvit import GlmVisionEncoder, VisionConfig
model = GlmVisionEncoder(VisionConfig.tiny()).eval()
for rows, grid in ((4, [[2**62, 2, 2]] * 4 + [[1, 2, 2]]), (0, [[1, 2**32, 2**32]]), (4, [[2**70, 2, 2]]),
                   (4, [[1e30, 2.0, 2.0]]), (0, [[1, 2**15, 2**15]] * 2)):
    try:
        model(torch.zeros(rows, 1176), grid)
    except ValueError as err:
        print(str(err).split(":")[0])
"""


def test_the_grids_of_issue_29_are_one_line_errors_in_bounded_memory():
    """t·h·w wrapped in int64: the first grid segfaulted in build_metadata, the second allocated 16 GB. Run in a
    child with a 3 GB address-space limit, so a regression fails the test instead of the machine."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    run = subprocess.run([sys.executable, "-c", SEGFAULT_SCRIPT], capture_output=True, text=True, timeout=300,
                         preexec_fn=limit)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:5] == ["item 0"] * 4 + ["grid_thw"], run.stdout


def test_max_rows_is_inclusive_and_the_sum_is_bounded():
    from glmvit.metadata import MAX_ROWS, as_grid_array, rows_of

    assert rows_of(as_grid_array([[1, 2**15, 2**15]])) == MAX_ROWS
    with pytest.raises(ValueError, match=r"item 0: .* is t·h·w = 1,073,741,828 patch rows, more than 1,073,741,824"):
        as_grid_array([[1, 4, 2**28 + 1]])
    with pytest.raises(ValueError, match=r"grid_thw: Σ t·h·w = 1,073,741,828 patch rows"):
        as_grid_array([[1, 2**15, 2**15], [1, 2, 2]])


def test_build_metadata_refuses_a_batch_larger_than_its_shape():
    from glmvit.metadata import BatchShape, build_metadata

    with pytest.raises(ValueError, match="batch has 32 patch rows, more than the shape's 16"):
        build_metadata([[2, 4, 4]], 2, BatchShape(16, 4, 16))
    with pytest.raises(ValueError, match="batch has 3 temporal patches, more than the shape's 2"):
        build_metadata([[3, 2, 2]], 2, BatchShape(16, 2, 16))
    with pytest.raises(ValueError, match="a segment of 16 rows exceeds max_seqlen 8"):
        build_metadata([[1, 4, 4]], 2, BatchShape(16, 2, 8))
    with pytest.raises(ValueError, match="out must be int32"):
        build_metadata([[1, 2, 2]], 2, BatchShape(16, 2, 16), out=np.zeros(3, np.int32))


def test_metadata_built_into_a_used_buffer_equals_a_fresh_one():
    """The runner builds straight into its pinned staging buffer, which holds the previous batch: every section is
    rewritten, so nothing of that batch remains."""
    from glmvit.metadata import BatchShape, build_metadata

    shape = BatchShape(64, 6, 64)
    buffer = build_metadata([[2, 4, 4], [1, 2, 8]], 2, shape).packed.copy()  # the previous batch's metadata
    fresh = build_metadata([[1, 2, 2]], 2, shape)
    reused = build_metadata([[1, 2, 2]], 2, shape, out=buffer)
    assert reused.packed is buffer and np.array_equal(buffer, fresh.packed)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8).map(lambda n: 4 * n), st.integers(0, 5), st.integers(0, 4), st.integers(0, 3))
def test_a_uniform_shape_packs_the_same_metadata_and_each_segment_in_its_own_block(length, n, spare, extra_slots):
    """Segments of exactly L rows, from row 0: segment i is rows [i·L, (i+1)·L), the padding whole blocks after."""
    h = 2
    grids = np.array([[1, h, length // h]] * n, dtype=np.int64).reshape(-1, 3)
    rows, slots = length * (n + spare), n + extra_slots
    uniform = build_metadata(grids, MERGE, BatchShape(rows, slots, length, uniform=True))
    plain = build_metadata(grids, MERGE, BatchShape(rows, slots, length))
    assert np.array_equal(uniform.packed, plain.packed)  # the promise changes nothing in the packed layout
    cu, seg, _ = views(uniform)
    assert np.array_equal(cu[: n + 1], length * np.arange(n + 1))
    assert np.array_equal(seg[: n * length], np.arange(n * length) // length)  # real row r: block r // L


def test_a_uniform_shape_is_validated_where_it_is_made():
    assert BatchShape(64, 4, 16, uniform=True).uniform and not BatchShape(64, 4, 16).uniform
    assert BatchShape(64, 4, 16) == BatchShape(64, 4, 16, uniform=False)  # existing shapes are what they were
    for rows, length in ((60, 16), (64, 0)):
        with pytest.raises(ValueError, match=rf"^a uniform batch shape needs rows \({rows}\) a multiple of max_seqlen "
                                             rf"\({length}\) ≥ 1$"):
            BatchShape(rows, 4, length, uniform=True)
    BatchShape(60, 4, 16)  # not uniform: no such promise to check
    assert repr(BatchShape(64, 4, 16)) == "BatchShape(rows=64, segments=4, max_seqlen=16)"  # printed as it was
    assert repr(BatchShape(64, 4, 16, uniform=True)) == "BatchShape(rows=64, segments=4, max_seqlen=16, uniform=True)"


def test_a_uniform_shape_refuses_a_shorter_segment():
    shape = BatchShape(64, 4, 16, uniform=True)
    with pytest.raises(ValueError, match=r"^a segment of 8 rows in a uniform shape of 16-row segments$"):
        build_metadata([[1, 4, 4], [1, 2, 4]], MERGE, shape)
    with pytest.raises(ValueError, match=r"^a segment of 32 rows exceeds max_seqlen 16$"):
        build_metadata([[1, 4, 8]], MERGE, shape)
    assert build_metadata([[2, 4, 4]], MERGE, shape).num_rows == 32  # a clip's frames are segments of 16 rows
