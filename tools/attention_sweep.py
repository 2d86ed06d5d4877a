"""Time one layer's attention (12 heads of 128, bf16, non-causal) per kernel on packed layouts, the way a CUDA graph
replays it, and check every output against a float32 reference.

Layouts are segment lengths packed into a budget's rows (rows = 4 · tokens, the rows of the smallest budget that
holds them; segment slots = min(64, tokens), unused slots empty, as ``EncoderGraphRunner.batch_shape`` sizes them).
Paths, each timed alone:

- ``triton``: glmvit's kernel through ``attend_qkv`` (the model's entry: rotary inside, reads the qkv projection);
- ``cudnn``: the ``cudnn`` backend through ``attend_qkv`` (Triton rotation launch, then cuDNN's ragged SDPA),
  when the cuDNN frontend is installed;
- ``fa4``: the ``fa4`` backend through ``attend_qkv`` (the same rotation launch, then FlashAttention-4's varlen
  kernel with the shape's static max_seqlen), when ``flash-attn-4`` imports;
- ``rotary``: ``apply_rotary`` on q and k: what every other path needs first (add it to compare with ``triton``);
- ``varlen@budget`` / ``varlen@true``: ``torch.nn.attention.varlen.varlen_attn`` with max_seqlen = the budget's
  rows (what the graphs pass today) and = the longest real segment;
- ``cudnn_ragged@budget`` / ``cudnn_ragged@true``: ``aten._cudnn_attention_forward`` on the packed rows with
  cu_seqlens (the op varlen_attn calls when its cuDNN switch is on);
- ``sdpa_cudnn_dense`` / ``sdpa_flash_dense``: SDPA on (segments, heads, L, d) views of the packed rows, when every
  segment has the same length, under ``sdpa_kernel(CUDNN_ATTENTION)`` / ``sdpa_kernel(FLASH_ATTENTION)``;
- ``flash_attn@budget`` / ``flash_attn@true``: ``flash_attn_varlen_func`` when the package imports;
- ``fa4_varlen@budget`` / ``fa4_varlen@true`` / ``fa4_dense``: FlashAttention-4's CuTe DSL kernels
  (``flash_attn.cute``) on the same rows, when ``flash-attn-4`` imports;
- ``rotation_launch``: the ``cudnn`` backend's rotation launch alone (its share of ``cudnn``);
- ``triton_tma@<config>``: the same rotation launch, then ``glmvit.kernels.triton_attention_tma``'s Hopper-shaped
  attention over the rotated scratch (``SWEEP_CONFIGS``, named as ``TmaConfig.name``: e.g. ``128x128w8s2h``, host
  descriptors; ``…p``, plain pointer loads). Not used by the model: no launch table names one.

Why ``cudnn`` is slower than ``sdpa_cudnn_dense`` on the same rows is not its grid: a prototype that cut every
segment's queries into batch entries of at most C rows (no empty slots), run by this sweep on the H200 at commit
847d36e, took 147.5 µs at C = 1024 against the ``cudnn`` backend's 145.1 at eight 1024-row segments (dense: 95.5),
and more at C = 128 and 256; rotating q and k in one pass over all heads (cos/sin read once per row) took 33.3 µs
against the launch's 30.6. Neither was adopted: cuDNN's ragged (padding-mask) kernel is itself the slower one.

Timing: ``glmvit.profiling.graph_time_us`` (20 calls captured in one graph, median of 50 replays). A path that cannot
run here is one line in the table and in the JSON, never a traceback. CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/attention_sweep.py --json data/sweeps/attention_sweep_h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from glmvit.kernels.cudnn_attention import ragged_offsets
from glmvit.metadata import BatchShape

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared helpers
from ab_common import one_line  # noqa: E402

HEADS, HEAD_DIM = 12, 128
MAX_SEGMENTS = 64  # the graphs' segment slots (BudgetConfig.max_segments)
MERGE_AREA = 4  # patch rows per output token
LAYOUTS: dict[str, tuple[int, ...]] = {
    "8x1024": (1024,) * 8,  # eight 448² images
    "1x5329": (5329,),  # one long segment (73², not a real grid: the table only needs its length)
    "4x256": (256,) * 4,  # four 224² images
    "1x256": (256,),  # one 224² image
    "2x1024": (1024,) * 2,  # two 448² images
    "16x256": (256,) * 16,  # sixteen 224² images: many short segments in 4096 rows
    "mixed": (1024, 256, 576, 2304, 256, 64, 1600),  # images of several sizes in one batch
}
REPLAYS = 50


@dataclass(frozen=True)
class Layout:
    """Segments packed at the start of a budget's rows; the rest is padding in no segment (``glmvit.metadata``)."""

    lengths: tuple[int, ...]
    rows: int  # the budget's rows: what the graphs pass as max_seqlen today
    cu_seqlens: np.ndarray  # int32, BatchShape.cu_slots long; unused slots repeat the real rows (empty segments)
    segment_ids: np.ndarray  # int32 per row: the real segment's index, padding row i of n segments: n + i
    h_idx: np.ndarray  # rotary positions: each segment row-major in a grid ⌈√L⌉ wide; padding at 0
    w_idx: np.ndarray

    @property
    def real_rows(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        """The longest real segment: the least max_seqlen a varlen kernel may be given."""
        return max(self.lengths)

    @property
    def equal(self) -> bool:
        return len(set(self.lengths)) == 1


def build_layout(lengths: tuple[int, ...], max_segments: int = MAX_SEGMENTS) -> Layout:
    """The packed layout of ``lengths`` in the smallest budget that holds them (see the module docstring)."""
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"segment lengths must be positive, got {lengths}")
    real = sum(lengths)
    tokens = -(-real // MERGE_AREA)
    shape = BatchShape(rows=tokens * MERGE_AREA, segments=min(max_segments, tokens), max_seqlen=tokens * MERGE_AREA)
    if len(lengths) > shape.segments:
        raise ValueError(f"{len(lengths)} segments exceed the {shape.segments} slots of a {tokens}-token budget")
    cu = np.full(shape.cu_slots, real, dtype=np.int32)
    cu[0] = 0
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    pad = shape.rows - real
    segment_ids = np.concatenate([np.repeat(np.arange(len(lengths)), lengths), len(lengths) + np.arange(pad)])
    pos = [np.arange(n) for n in lengths] + [np.zeros(pad, np.int64)]
    width = [math.isqrt(n - 1) + 1 for n in lengths] + [1]
    h_idx = np.concatenate([p // w for p, w in zip(pos, width, strict=True)])
    w_idx = np.concatenate([p % w for p, w in zip(pos, width, strict=True)])
    return Layout(tuple(lengths), shape.rows, cu, segment_ids.astype(np.int32), h_idx, w_idx)


# bf16 keeps 8 significant bits: unit roundoff u = 2⁻⁸. Every path rounds q̃ and k̃ to bf16 (a score s = q̃·k̃/√d
# moves by ≤ 2u·Σ|q̃ᵢk̃ᵢ|/√d, about 2u·|s|·(a few) for unit-normal inputs, so each softmax weight moves by a few u
# relative), the weights P before P·V (u relative) and the output (u relative); the accumulation is float32. The
# output is a convex combination of the segment's v rows, so a weight error of ε relative moves it by ≤ ε·max|v|:
# MAX_ERR_U = 16 leaves that sum room (the scores' factor is ≤ 4 at |s| ≤ 4). The RMS error of a correct kernel is
# the same few roundings at random signs, ≈ u of the output's scale: RMS_ERR_U = 4 over rms(ref). A kernel that
# skips the rotary or mixes segments misses by the output's own scale, ≫ both.
BF16_U = 2.0**-8
MAX_ERR_U = 16
RMS_ERR_U = 4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> torch.Tensor:
    """float32 attention within each segment of rotated float32 q, k and v (rows, heads, d), real rows only."""
    out = torch.empty(layout.real_rows, q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
    start = 0
    for n in layout.lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        weights = (qs @ ks.transpose(1, 2) / math.sqrt(q.shape[2])).softmax(-1)
        out[start : start + n] = (weights @ vs).transpose(0, 1)
        start += n
    return out


def check(out: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    err = (out.float() - ref).abs()
    max_err, rms_rel = err.max().item(), (err.square().mean().sqrt() / ref.square().mean().sqrt()).item()
    ok = max_err <= MAX_ERR_U * BF16_U * v.abs().max().item() and rms_rel <= RMS_ERR_U * BF16_U
    return {"max_abs_err": max_err, "rms_rel_err": rms_rel, "ok": ok}


def _dense(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(segments, heads, L, d) view of the real rows of packed (rows, heads, d): no copy."""
    n = len(layout.lengths)
    return x[: layout.real_rows].view(n, layout.lengths[0], x.shape[1], x.shape[2]).transpose(1, 2)


def paths(layout: Layout, qkv, cos, sin, q, k, v, meta) -> dict[str, Callable[[], torch.Tensor] | str]:
    """Each path as a call returning (rows ≥ real rows, heads, d), or a one-line reason it cannot run here."""
    from glmvit.attention import attend_qkv
    from glmvit.rotary import apply_rotary

    q_raw, k_raw = qkv.view(qkv.shape[0], 3, HEADS, HEAD_DIM).unbind(1)[:2]
    out: dict[str, Callable[[], torch.Tensor] | str] = {
        "triton": lambda: attend_qkv(qkv, cos, sin, meta, "triton", HEADS).view(-1, HEADS, HEAD_DIM),
        "cudnn": lambda: attend_qkv(qkv, cos, sin, meta, "cudnn", HEADS).view(-1, HEADS, HEAD_DIM),
        "fa4": lambda: attend_qkv(qkv, cos, sin, meta, "fa4", HEADS).view(-1, HEADS, HEAD_DIM),
        "rotary": lambda: torch.stack([apply_rotary(q_raw, cos, sin), apply_rotary(k_raw, cos, sin)]),
    }
    cu = meta.cu_seqlens
    bounds = {"budget": layout.rows, "true": layout.max_seqlen}
    try:
        from torch.nn.attention.varlen import varlen_attn

        def varlen(m: int) -> torch.Tensor:
            o = varlen_attn(q, k, v, cu, cu, m, m)
            assert isinstance(o, torch.Tensor)  # a tuple only when asked for the log-sum-exp
            return o

        for tag, m in bounds.items():
            out[f"varlen@{tag}"] = partial(varlen, m)
    except ImportError as err:
        out["varlen"] = f"torch.nn.attention.varlen not importable: {err}"

    def cudnn_ragged(m: int) -> torch.Tensor:  # (q, k, v, bias, cu_q, cu_k, max_q, max_k, lse, dropout, causal, mask)
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, False, 0.0, False, False)[0]

    for tag, m in bounds.items():
        out[f"cudnn_ragged@{tag}"] = partial(cudnn_ragged, m)
    out.update(rotation_path(qkv, cos, sin, cu))
    if layout.equal:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dq, dk, dv = (_dense(x, layout) for x in (q, k, v))
        for name, backend in (("sdpa_cudnn_dense", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_flash_dense", SDPBackend.FLASH_ATTENTION)):
            def dense(backend=backend) -> torch.Tensor:
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(dq, dk, dv)
                return o.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)
            out[name] = dense
    else:
        out["sdpa_*_dense"] = "segments of different lengths: no dense (B, H, L, D) view"
    try:
        from flash_attn import flash_attn_varlen_func

        for tag, m in bounds.items():
            out[f"flash_attn@{tag}"] = partial(flash_attn_varlen_func, q, k, v, cu, cu, m, m, causal=False)
    except ImportError as err:
        out["flash_attn"] = f"flash_attn not importable: {err}"
    out.update(fa4_paths(layout, q, k, v, cu, bounds))
    out.update(tma_paths(qkv, cos, sin, cu))  # last: should the new kernel fault, the rest are timed
    return out


def fa4_paths(layout: Layout, q, k, v, cu, bounds: dict[str, int]) -> dict[str, Callable[[], torch.Tensor] | str]:
    """``fa4_varlen@budget`` / ``fa4_varlen@true``: FlashAttention-4's CuTe DSL kernel (``flash_attn.cute``, the
    ``flash-attn-4`` package; its SM90 forward on Hopper) on the packed rows with cu_seqlens; ``fa4_dense``: its
    batched entry on the (segments, L, heads, d) view when every segment has the same length. One line when the
    package does not import (``fa4_*``: ``fa4`` is the backend's own path, which says why it failed)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as err:  # noqa: BLE001 - one line in the table, whatever is missing
        return {"fa4_*": f"flash_attn.cute not importable: {one_line(err)}"}

    def first(o: Any) -> torch.Tensor:
        return o[0] if isinstance(o, tuple) else o  # (out, lse) in some versions

    def varlen(m: int) -> torch.Tensor:
        return first(flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                            max_seqlen_k=m, causal=False))

    out: dict[str, Callable[[], torch.Tensor] | str] = {f"fa4_varlen@{tag}": partial(varlen, m)
                                                         for tag, m in bounds.items()}
    if layout.equal:
        n, length = len(layout.lengths), layout.lengths[0]

        def dense() -> torch.Tensor:
            view = [x[: n * length].view(n, length, HEADS, HEAD_DIM) for x in (q, k, v)]
            return first(flash_attn_func(*view, causal=False)).reshape(-1, HEADS, HEAD_DIM)

        out["fa4_dense"] = dense
    return out


def rotation_path(qkv, cos, sin, cu) -> dict[str, Callable[[], torch.Tensor] | str]:
    """``rotation_launch``: the ``cudnn`` backend's Triton rotation of q and k alone."""
    from glmvit.kernels.triton_attention import rotate_qk_triton

    return {"rotation_launch": lambda: rotate_qk_triton(qkv, cos, sin, cu, HEADS)}


def tma_paths(qkv, cos, sin, cu) -> dict[str, Callable[[], torch.Tensor] | str]:
    """``triton_tma@<config>``: rotation launch + the Hopper-shaped attention, per configuration; one line if the
    module does not import (a Triton without what it needs)."""
    from glmvit.kernels.triton_attention import rotate_qk_triton

    try:
        from glmvit.kernels.triton_attention_tma import SWEEP_CONFIGS, attend_prerotated_tma
    except Exception as err:  # noqa: BLE001 - one line in the table, whatever this Triton lacks
        return {"triton_tma": f"not importable: {one_line(err)}"}

    def run(config) -> torch.Tensor:
        scratch = rotate_qk_triton(qkv, cos, sin, cu, HEADS)
        return attend_prerotated_tma(qkv, scratch, cu, HEADS, config).view(-1, HEADS, HEAD_DIM)

    return {f"triton_tma@{config.name}": partial(run, config) for config in SWEEP_CONFIGS}


def layout_inputs(lengths: tuple[int, ...]) -> SimpleNamespace:
    """One layer's attention inputs on CUDA for ``lengths`` packed as :func:`build_layout` packs them (seeded):
    ``layout``, the qkv projection ``qkv`` (bf16), rotary ``cos``/``sin``, ``cu`` (cu_seqlens), ``meta`` (what the
    backends read, the cuDNN offsets computed once as the model does per forward: not timed), the raw ``q_raw``,
    ``k_raw`` and ``v`` views, ``q``/``k`` rotated as the model hands a library kernel, and ``ref``, the float32
    :func:`reference`."""
    from glmvit.rotary import apply_rotary, inv_freq, rotary_cos_sin

    layout = build_layout(lengths)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(layout.rows, 3 * HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    cos, sin = rotary_cos_sin(torch.from_numpy(layout.h_idx).to(dev), torch.from_numpy(layout.w_idx).to(dev),
                              inv_freq(HEAD_DIM).to(dev))
    cu = torch.from_numpy(layout.cu_seqlens).to(dev)
    meta = SimpleNamespace(cu_seqlens=cu, max_seqlen=layout.rows, shape=SimpleNamespace(rows=layout.rows,
                                                                                      uniform=False),
                           segment_ids=torch.from_numpy(layout.segment_ids).to(dev),
                           ragged=ragged_offsets(cu, HEADS, HEAD_DIM))
    q_raw, k_raw, v = qkv.view(layout.rows, 3, HEADS, HEAD_DIM).unbind(1)
    q, k = apply_rotary(q_raw, cos, sin), apply_rotary(k_raw, cos, sin)
    ref = reference(apply_rotary(q_raw.float(), cos, sin), apply_rotary(k_raw.float(), cos, sin), v.float(), layout)
    return SimpleNamespace(layout=layout, qkv=qkv, cos=cos, sin=sin, cu=cu, meta=meta, q_raw=q_raw, k_raw=k_raw, v=v,
                           q=q, k=k, ref=ref)


def layout_paths(inputs: SimpleNamespace) -> dict[str, Callable[[], torch.Tensor] | str]:
    """:func:`paths` over :func:`layout_inputs`."""
    i = inputs
    return paths(i.layout, i.qkv, i.cos, i.sin, i.q, i.k, i.v, i.meta)


def measure(name: str, lengths: tuple[int, ...]) -> dict[str, Any]:
    from glmvit.profiling import graph_time_us

    inputs = layout_inputs(lengths)
    layout, v, ref = inputs.layout, inputs.v, inputs.ref
    result: dict[str, Any] = {"lengths": list(lengths), "rows": layout.rows,
                              "segment_slots": len(layout.cu_seqlens) - 1, "max_seqlen_budget": layout.rows,
                              "max_seqlen_true": layout.max_seqlen, "paths": {}}
    for path, fn in layout_paths(inputs).items():
        if isinstance(fn, str):
            result["paths"][path] = {"unavailable": fn}
            continue
        try:
            row: dict[str, Any] = {}
            if not path.startswith("rot"):  # the rotations alone return q̃, k̃: timed, not checked here
                row.update(check(fn()[: layout.real_rows], ref, v[: layout.real_rows]))
            row["us"] = graph_time_us(fn, repeats=20, runs=REPLAYS)
        except Exception as err:  # noqa: BLE001 - a path this GPU, build or layout refuses is one line, not a crash
            row = {"unavailable": one_line(err)}
        result["paths"][path] = row
    del inputs, ref
    torch.cuda.empty_cache()
    return result


def print_table(layouts: dict[str, Any]) -> None:
    print(f"{'layout':>8} {'path':<30} {'µs':>8} {'max err':>9} {'rms rel':>8}  ok")
    for name, layout in layouts.items():
        for path, row in layout["paths"].items():
            if "unavailable" in row:
                print(f"{name:>8} {path:<30} unavailable: {row['unavailable']}")
            elif "max_abs_err" in row:
                print(f"{name:>8} {path:<30} {row['us']:8.1f} {row['max_abs_err']:9.2e} {row['rms_rel_err']:8.1e}  "
                      f"{'yes' if row['ok'] else 'NO'}")
            else:
                print(f"{name:>8} {path:<30} {row['us']:8.1f}")


LIBRARIES = ("nvidia-cudnn-frontend", "flash-attn-4", "nvidia-cutlass-dsl", "flash-attn")


def library_versions() -> dict[str, str | None]:
    """The installed version of each attention library the paths use (``LIBRARIES``; None: not installed), so a
    record says which FlashAttention-4 or cuDNN frontend its rows timed."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def layout_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma list of layout names ``text``; an unknown one is the parser's one-line error."""
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose among {list(LAYOUTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every number, with provenance, here")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    args = parser.parse_args(argv)
    names = layout_names(parser, args.layouts)
    if not torch.cuda.is_available():
        print("attention_sweep times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    from glmvit.provenance import collect

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    layouts = {n: measure(n, LAYOUTS[n]) for n in names}
    print_table(layouts)
    if args.json:
        command = " ".join([sys.executable, *sys.argv])
        record = {"provenance": collect("cuda", command), "cudnn": torch.backends.cudnn.version(),
                  "libraries": library_versions(), "heads": HEADS, "head_dim": HEAD_DIM, "replays": REPLAYS,
                  "layouts": layouts}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
