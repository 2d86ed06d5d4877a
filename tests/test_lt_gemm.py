"""glmvit.kernels.lt_gemm: x·Wᵀ + r with the residual in cuBLASLt's epilogue. Off CUDA (and without nvmath-python)
the op is F.linear then the add, exactly; on CUDA with nvmath-python it is checked against float32, under a CUDA
graph and under torch.compile.

Tolerance on CUDA: 2⁻⁷·max|ref|. The reference is float32 arithmetic on the same bf16 operands, so what differs is
the one rounding of the output to bf16 (8 significant bits: at most half an ulp, 2⁻⁸ of the value, so 2⁻⁸·max|ref|)
and the order of K = 1536–4096 float32 products (about K·2⁻²⁴ of the scale, far less); 2⁻⁷ is twice the rounding.
A wrong operand or a dropped C misses by the output's scale.
"""
import pytest
import torch
import torch.nn.functional as F

from glmvit.kernels import lt_gemm
from glmvit.kernels.lt_gemm import linear_residual, runs

SHAPES = {"proj": (1536, 1536), "down": (4096, 1536)}


def operands(rows, k, n, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    r = torch.randn(rows, n, generator=gen)
    return tuple(t.to(device, dtype) for t in (x, w, r))


def test_off_cuda_it_is_the_matmul_then_the_add_exactly():
    x, w, r = operands(12, 8, 6)
    assert not runs(x, w, r)
    assert torch.equal(linear_residual(x, w, r), F.linear(x, w) + r)


def test_mismatched_operands_are_a_one_line_error():
    x, w, r = operands(12, 8, 6)
    with pytest.raises(ValueError, match=r"^linear_residual: x \(12, 8\), weight \(6, 8\) and residual \(12, 5\)"):
        linear_residual(x, w, r[:, :5].contiguous())


def test_a_plan_missing_inside_a_capture_is_a_one_line_error_and_nothing_is_cached(monkeypatch):
    """Planning inside a capture would invalidate it (nvmath-python records events): a key miss while the current
    stream captures raises, naming the key, before any CUDA call, and leaves no plan (not even a fallback) behind."""
    monkeypatch.setattr(lt_gemm._local, "plans", {}, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x, w, r = operands(12, 8, 6)
    with pytest.raises(RuntimeError, match=r"^linear_residual: no plan for _Key\(.*rows=12, inputs=8, outputs=6\) "
                                           r"was made before this capture"):
        lt_gemm._plan(x, w, r)
    assert lt_gemm._local.plans == {}


def test_without_nvmath_python_cuda_operands_take_the_two_ops(monkeypatch):
    monkeypatch.setattr(lt_gemm, "nvmath_installed", lambda: False)
    x, w, r = operands(4, 8, 6)
    assert not runs(x, w, r)


def test_an_installed_nvmath_that_does_not_import_counts_as_missing(monkeypatch, caplog):
    import importlib.util
    import sys

    lt_gemm.nvmath_installed.cache_clear()
    try:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # "installed"
        monkeypatch.setitem(sys.modules, "nvmath.linalg.advanced", None)  # but its import fails
        assert lt_gemm.nvmath_installed() is False
        assert "does not import" in caplog.text
    finally:
        monkeypatch.undo()
        lt_gemm.nvmath_installed.cache_clear()


def test_the_fake_gives_the_output_shape_torch_compile_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, r = torch.empty(12, 8), torch.empty(6, 8), torch.empty(12, 6)
        assert linear_residual(x, w, r).shape == (12, 6)


needs_lt = pytest.mark.skipif(not lt_gemm.nvmath_installed(), reason="needs nvmath-python")


def check(out, x, w, r):
    ref = x.float() @ w.float().T + r.float()
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert (out.float() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()


@pytest.mark.gpu
@needs_lt
@pytest.mark.parametrize("rows", [256, 1028, 8192])
@pytest.mark.parametrize("name", SHAPES)
def test_cublaslt_with_the_residual_as_c_matches_float32(name, rows):
    x, w, r = operands(rows, *SHAPES[name], device="cuda", dtype=torch.bfloat16, seed=rows)
    assert runs(x, w, r)
    check(linear_residual(x, w, r), x, w, r)
    x2, w2, r2 = operands(rows, *SHAPES[name], device="cuda", dtype=torch.bfloat16, seed=rows + 1)
    check(linear_residual(x2, w2, r2), x2, w2, r2)  # the same plan, rebound to other operands


@pytest.mark.gpu
@needs_lt
def test_a_cuda_graph_replays_it_on_what_its_buffers_hold():
    x, w, r = operands(1024, 1536, 1536, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear_residual(x, w, r)  # plans outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_residual(x, w, r)
    x2, w2, r2 = operands(1024, 1536, 1536, device="cuda", dtype=torch.bfloat16, seed=7)
    for buffer, new in ((x, x2), (w, w2), (r, r2)):
        buffer.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    check(out, x2, w2, r2)


@pytest.mark.gpu
@needs_lt
def test_torch_compile_keeps_it_one_opaque_op():
    x, w, r = operands(256, 4096, 1536, device="cuda", dtype=torch.bfloat16)

    def block_end(x, w, r):
        return linear_residual(torch.nn.functional.gelu(x), w, r)

    compiled = torch.compile(block_end, fullgraph=True)
    check(compiled(x, w, r), torch.nn.functional.gelu(x), w, r)


@pytest.mark.gpu
@needs_lt
def test_a_shape_without_a_plan_takes_the_two_ops_and_says_so_once(monkeypatch, caplog):
    import nvmath.linalg.advanced

    def no_plan(*args, **kwargs):
        raise RuntimeError("no algorithm")

    monkeypatch.setattr(nvmath.linalg.advanced, "Matmul", no_plan)
    x, w, r = operands(72, 1536, 1536, device="cuda", dtype=torch.bfloat16, seed=11)  # a row count no test plans
    for _ in range(2):
        assert torch.equal(linear_residual(x, w, r), F.linear(x, w) + r)
    assert caplog.text.count("no cuBLASLt plan") == 1
