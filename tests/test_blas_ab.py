"""tools/blas_ab.py's arithmetic and refusals; the A/B itself needs a CUDA GPU (it runs in the H200 calls)."""
import pytest
import torch

from tools.blas_ab import per_forward_us, with_library


def test_a_forward_s_matmul_time_counts_each_shape_as_often_as_the_forward_runs_it():
    gemms = [("qkv", 256, 1536, 4608, 24), ("patch_embed", 256, 1176, 1536, 1)]
    assert per_forward_us({"qkv": 10.0, "patch_embed": 4.0}, gemms) == 24 * 10.0 + 4.0
    with pytest.raises(KeyError):
        per_forward_us({"qkv": 10.0}, gemms)  # a shape not timed is not summed as zero


def test_the_library_is_set_for_the_call_and_restored_after(monkeypatch):
    """torch's switch (a CPU build refuses cuBLASLt, so a stand-in keeps its state): set for the call, restored
    after, also when the call raises."""
    state = ["cublas"]

    def preferred(backend=None):
        if backend is not None:
            state[0] = backend
        return state[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    assert with_library("cublaslt", lambda: state[0])() == "cublaslt" and state == ["cublas"]

    def fails():
        raise RuntimeError("a launch failed")

    with pytest.raises(RuntimeError, match="a launch failed"):
        with_library("cublaslt", fails)()
    assert state == ["cublas"]
