"""The ``fa4`` attention backend (FlashAttention-4's varlen kernel): its refusals and its detection on any machine; on
a Hopper GPU with ``flash-attn-4`` installed, its output against a float32 reference, a NaN kept in its item, and
under a CUDA graph replayed on another batch. (The encoder-level GPU tests in ``test_gpu.py`` run it too: every
backend ``available_backends`` offers.)

Tolerance (GPU): ``test_cudnn_attention``'s, for the same reason: q̃, k̃, the softmax weights and the output are each
rounded to bf16 (≤ 2⁻⁹ relative) and the sums accumulate in float32, so the output is within about 2⁻⁸·max|v| of a
float32 reference on the same rotated inputs; 2⁻⁶·max|v| leaves room for the sums, and a kernel that mixed segments
or skipped the rotation misses by the output's own scale.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from glmvit.attention import BACKENDS, GRAPH_SAFE, available_backends, check_backend
from glmvit.kernels import fa4_attention
from glmvit.kernels.fa4_attention import head_dim_ok, installed, unavailable_reason
from tests.packed_attention_cases import (
    GPU_LAYOUTS,
    assert_capture_on_one_batch_replays_another,
    assert_within_bf16_band,
    case,
)


def test_a_graph_safe_backend_by_name():
    assert "fa4" in BACKENDS and "fa4" in GRAPH_SAFE


@pytest.mark.parametrize("dtype, head_dim, reason", [(torch.float32, 128, "fp16/bf16"),
                                                      (torch.bfloat16, 12, "head_dim")])
def test_unsupported_dtypes_and_head_dims_are_named(dtype, head_dim, reason):
    assert reason in unavailable_reason(0, dtype, head_dim)


def test_the_head_sizes_it_takes():
    assert [d for d in range(0, 300, 4) if head_dim_ok(d)] == list(range(8, 257, 8))


def test_not_offered_off_cuda_and_refused_in_one_line():
    for dtype in (torch.float32, torch.bfloat16):
        assert "fa4" not in available_backends("cpu", dtype)
    with pytest.raises(ValueError, match="'fa4' is not available on cpu") as err:
        check_backend("fa4", "cpu", torch.float32)
    assert "\n" not in str(err.value)


def _flash_attn_here(monkeypatch, root, files):
    """A ``flash_attn`` package made of ``files`` (paths under it, each with its text) first on the path."""
    for name, text in files.items():
        path = root / "flash_attn" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "flash_attn").mkdir(exist_ok=True)
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()


@pytest.mark.parametrize("files, fa4, fa2", [
    ({}, False, False),  # a namespace with neither package's module in it
    ({"cute/__init__.py": ""}, True, False),  # FlashAttention-4 alone
    ({"__init__.py": "", "flash_attn_interface.py": ""}, False, True),  # FlashAttention-2 alone
    # FlashAttention-2 built for another torch: its __init__ loads its CUDA extension and raises; never run here
    ({"__init__.py": "raise ImportError('undefined symbol')", "flash_attn_interface.py": "", "cute/__init__.py": ""},
     True, True),
])
def test_each_flash_attn_backend_looks_for_its_own_module_without_importing_the_package(
        monkeypatch, tmp_path, files, fa4, fa2):
    """FlashAttention-4 installs ``flash_attn.cute`` into a ``flash_attn`` namespace that FlashAttention-2's package
    also owns: each backend looks for its own module, never for the namespace alone, and never by importing
    ``flash_attn`` (a broken FlashAttention-2 would make every CUDA model's backend list raise)."""
    from glmvit import attention

    _flash_attn_here(monkeypatch, tmp_path, files)
    assert (installed(), attention._has_flash_attn2()) == (fa4, fa2)
    assert "flash_attn" not in sys.modules


def test_not_installed_is_said_with_the_extra_to_install(monkeypatch):
    import glmvit.kernels.fa4_attention as fa4

    monkeypatch.setattr(fa4, "installed", lambda: False)
    fa4.unavailable_reason.cache_clear()
    try:
        assert "pip install 'glmvit[fa4]'" in fa4.unavailable_reason(0, torch.bfloat16, 128)
    finally:
        fa4.unavailable_reason.cache_clear()


# ---------------------------------------------------------------------------------------------- real GPU

def _fa4_here() -> bool:
    return torch.cuda.is_available() and unavailable_reason(torch.cuda.current_device(), torch.bfloat16, 128) is None


needs_fa4 = pytest.mark.skipif(not _fa4_here(), reason="needs a Hopper GPU and flash-attn-4 (the 'fa4' extra)")

@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_bf16_within_rounding_of_float32_reference(layout):
    from glmvit.attention import attend_qkv

    qkv, cos, sin, meta, rows = case(GPU_LAYOUTS[layout])
    assert_within_bf16_band(attend_qkv(qkv, cos, sin, meta, "fa4", 12), qkv, cos, sin, meta, rows)


@pytest.mark.gpu
@needs_fa4
def test_gpu_a_nan_in_one_item_stays_in_it():
    """A NaN in one segment's values reaches that segment's rows only: no query of another item reads its keys."""
    from glmvit.attention import attend_qkv

    qkv, cos, sin, meta, rows = case(GPU_LAYOUTS["4x224+video"])
    cu = meta.cu_seqlens.tolist()
    qkv[cu[1] + 3, 2 * 12 * 128 :] = float("nan")  # a value row of the second segment
    got = attend_qkv(qkv, cos, sin, meta, "fa4", 12)[:rows].float()
    inside = torch.zeros(rows, dtype=torch.bool, device="cuda")
    inside[cu[1] : cu[2]] = True
    assert torch.isnan(got[inside]).all() and torch.isfinite(got[~inside]).all()


@pytest.mark.gpu
@needs_fa4
def test_gpu_a_graph_captured_on_one_batch_replays_another():
    """Segments are read from the device at replay and ``max_seqlen`` is the shape's: a graph captured on one batch
    gives, replayed on another of the same shape, that batch's eager answer."""
    from glmvit.attention import attend_qkv

    assert_capture_on_one_batch_replays_another(lambda qkv, cos, sin, meta: attend_qkv(qkv, cos, sin, meta, "fa4", 12))


def test_strided_inputs_are_refused_in_one_line():
    """The rotation launch and the kernel read qkv, cos and sin as dense rows: a column slice is refused by name
    before anything is imported or launched."""
    from glmvit.kernels.fa4_attention import fa4_varlen_attention

    qkv = torch.zeros(8, 2 * 3 * 2 * 16)[:, ::2]  # a column slice: rows are not dense
    cos = sin = torch.zeros(8, 16)
    cu = torch.tensor([0, 8, 8, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous") as err:
        fa4_varlen_attention(qkv, cos, sin, cu, 2, 8)
    assert "\n" not in str(err.value)


def test_where_fa4_runs_its_table_decides_and_elsewhere_cudnn_s_rule_holds(monkeypatch):
    from glmvit.kernels import fa4_table
    from glmvit.kernels.attention_table import CUDNN_MIN_ROWS, attention_for

    rows = CUDNN_MIN_ROWS
    assert attention_for(rows - 1, False) == "triton" and attention_for(rows, False) == "cudnn"
    monkeypatch.setattr(fa4_table, "FA4_MIN_ROWS", None)  # no fa4 rule: cuDNN's, where FlashAttention-4 runs too
    assert attention_for(rows - 1, True) == "triton" and attention_for(rows, True) == "cudnn"
    monkeypatch.setattr(fa4_table, "FA4_MIN_ROWS", 2048)
    assert attention_for(2047, True) == "triton" and attention_for(2048, True) == attention_for(rows, True) == "fa4"
    assert attention_for(rows) == attention_for(rows, fa4_attention.loads())  # None: ask this machine


def test_torch_compile_takes_auto_s_fa4_answer_as_a_constant(monkeypatch):
    """``loads`` carries the mark ``torch.compiler.assume_constant_result`` sets, so a compiled forward asks it once
    instead of tracing the package import behind it; a forward that branches on it compiles whole."""
    from glmvit.kernels import attention_table

    def marked():
        pass

    torch.compiler.assume_constant_result(marked)
    assert vars(marked) and all(getattr(fa4_attention.loads, k, None) == v for k, v in vars(marked).items())
    from glmvit.kernels import fa4_table

    def probe():  # as where FlashAttention-4 runs; traced, its graph break fails the fullgraph compile below
        torch._dynamo.graph_break()
        return True

    monkeypatch.setattr(fa4_attention, "_loads", probe)
    monkeypatch.setattr(fa4_table, "FA4_MIN_ROWS", attention_table.CUDNN_MIN_ROWS)

    def forward(x):
        return x + 1 if attention_table.attention_for(x.shape[0]) == "fa4" else x - 1

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    rows = attention_table.CUDNN_MIN_ROWS
    assert torch.equal(compiled(torch.zeros(rows, 2)), torch.ones(rows, 2))
    assert torch.equal(compiled(torch.zeros(16, 2)), -torch.ones(16, 2))
