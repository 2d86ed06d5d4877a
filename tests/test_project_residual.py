"""glmvit.model.project_residual: which path a block's two residual adds take. In a captured half-precision CUDA
forward with nvmath-python they ride in the matmul (``glmvit.kernels.lt_gemm``); everywhere else, and in every
eager forward, they stay the matmul then ``residual_add``, so the CPU float32 path is transformers' unchanged.
The GPU test checks a captured runner against one built with the adds apart."""
import numpy as np
import pytest
import torch
from torch import nn

import glmvit.model as model_module
from glmvit.graphs import EncoderGraphRunner
from glmvit.kernels import lt_gemm
from glmvit.metadata import build_metadata
from glmvit.model import project_residual, residual_add
from glmvit.packing import BudgetConfig
from glmvit.workloads import random_batch


@pytest.fixture
def calls(monkeypatch):
    """Every linear_residual call project_residual makes (the op itself still runs: the two ops off CUDA)."""
    seen = []
    real = model_module.linear_residual

    def spy(h, weight, x):
        seen.append((h, weight, x))
        return real(h, weight, x)

    monkeypatch.setattr(model_module, "linear_residual", spy)
    return seen


def operands(seed=0):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(6, 8, generator=gen))
    return linear, torch.randn(5, 8, generator=gen), torch.randn(5, 6, generator=gen)


@pytest.mark.parametrize("captured, installed, half_cuda", [(False, True, True), (True, False, True),
                                                            (True, True, False)])
def test_anything_short_of_all_three_keeps_the_matmul_then_the_add(calls, monkeypatch, captured, installed,
                                                                     half_cuda):
    monkeypatch.setattr(model_module, "RESIDUAL_IN_MATMUL", installed)
    monkeypatch.setattr(model_module, "_half_on_cuda", lambda h: half_cuda)
    linear, h, x = operands()
    with torch.no_grad():
        assert torch.equal(project_residual(linear, h, x, captured), residual_add(x, linear(h)))
    assert calls == []


def test_captured_half_on_cuda_with_nvmath_takes_the_epilogue(calls, monkeypatch):
    monkeypatch.setattr(model_module, "RESIDUAL_IN_MATMUL", True)
    monkeypatch.setattr(model_module, "_half_on_cuda", lambda h: True)
    linear, h, x = operands(1)
    with torch.no_grad():
        out = project_residual(linear, h, x, captured=True)
    assert len(calls) == 1 and calls[0][0] is h and calls[0][1] is linear.weight and calls[0][2] is x
    assert torch.equal(out, torch.nn.functional.linear(h, linear.weight) + x)  # the op's fallback off CUDA


def test_a_captured_forward_routes_both_adds_of_every_block_through_it(tiny_model, tiny_config, calls,
                                                                      monkeypatch):
    monkeypatch.setattr(model_module, "RESIDUAL_IN_MATMUL", True)
    monkeypatch.setattr(model_module, "_half_on_cuda", lambda h: True)
    pixels, grid = random_batch([[1, 4, 4], [2, 4, 6]], tiny_config, seed=4)
    meta = build_metadata(np.asarray(grid), tiny_config.spatial_merge_size).to(tiny_model.device)
    with torch.no_grad():
        expected = tiny_model(pixels, grid)  # eager: never captured
        assert calls == []
        got = tiny_model.forward_static(pixels, meta, captured=True)
    block = tiny_model.blocks[0]
    assert len(calls) == 2 * tiny_config.depth
    assert calls[0][1] is block.attn.proj.weight and calls[1][1] is block.mlp.down_proj.weight
    assert torch.equal(got, expected)  # off CUDA the op is the same two ops, in float32 the same sum


def test_the_runner_captures_with_it_only_where_graphs_are_real(tiny_model):
    runner = EncoderGraphRunner(tiny_model, BudgetConfig((16,), 2, 2), mode="emulate", progress=False)
    assert runner.forward_static.keywords["captured"] is False  # type: ignore[attr-defined]


@pytest.mark.gpu
@pytest.mark.skipif(not lt_gemm.nvmath_installed(), reason="needs nvmath-python")
def test_a_captured_runner_plans_the_epilogue_and_agrees_with_the_adds_apart(monkeypatch):
    """Two graph runners over one bf16 GLM-4.1V tower, one with the adds apart: the same batch within 2⁻⁴·max|out|
    (the residual sums rounded once instead of twice, carried through 24 blocks; a dropped residual misses by the
    scale), and the captured one planned cuBLASLt's proj and down matmuls for every budget's rows."""
    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder

    model = random_encoder(VisionConfig.glm41v(), "cuda", torch.bfloat16)
    budgets = BudgetConfig((64, 256), 4, 8)
    pixels, grid = random_batch([[1, 16, 16], [1, 8, 12]], model.config, seed=5)
    pixels = pixels.to("cuda", torch.bfloat16)
    fused = EncoderGraphRunner(model, budgets, mode="cuda", progress=False).capture()
    assert fused.forward_static.keywords["captured"] is True  # type: ignore[attr-defined]
    planned = {(k.rows, k.inputs, k.outputs) for k, mm in lt_gemm._local.plans.items() if mm is not None}
    hidden, width = model.config.hidden_size, model.config.out_hidden_size
    for rows in (4 * b for b in budgets.token_budgets):
        assert {(rows, hidden, hidden), (rows, width, hidden)} <= planned, rows  # proj and down, per row count
    out = torch.cat(fused.run(pixels, grid)).float()
    monkeypatch.setattr(model_module, "RESIDUAL_IN_MATMUL", False)
    apart = torch.cat(EncoderGraphRunner(model, budgets, mode="cuda", progress=False).capture().run(pixels, grid))
    scale = apart.float().abs().max().item()
    assert (out - apart.float()).abs().max().item() <= 2**-4 * scale
