"""The GLM-4V vision encoder in one readable file.

``GlmVisionEncoder`` has the same state-dict keys, shapes and values as transformers' ``Glm4vVisionModel``, so each
loads the other's ``state_dict`` with ``strict=True``. An MLP's gate and up are one parameter here, two keys there,
and the blocks' MLP stores that parameter packed in tiles of 128 rows (the layout the fused SwiGLU GEMM reads):
``glmvit.gate_up``, whose state-dict hooks unpack on save and pack on load. It has two entry points sharing every
module and kernel:

- ``forward(pixel_values, grid_thw)``: any batch; builds exact metadata on the host, then calls ``forward_static``.
- ``forward_static(pixels, meta)``: fixed shapes from ``meta``, no host syncs, no data-dependent allocation —
  what a CUDA graph captures.

Order of one forward: patch embed (a Conv3d whose kernel covers the patch, i.e. a matmul) → RMSNorm → + bicubic
position embedding → blocks (pre-norm; attention with 2D rotary inside each segment; SwiGLU MLP of width
out_hidden_size) → RMSNorm → 2×2 downsample conv → merger (Linear → LayerNorm → exact GELU → SwiGLU).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend_qkv, check_backend, default_backend, prepare_attention
from .config import VisionConfig
from .gate_up import fuse_gate_up, gate_up_tile, is_packed, swiglu
from .kernels import interpolate_pos_embed
from .kernels.fused_gemm_table import qkv_rope_fused, swiglu_fused  # no Triton import: thresholds only
from .kernels.lt_gemm import linear_residual, nvmath_installed  # nvmath itself: once, by RESIDUAL_IN_MATMUL
from .metadata import EncoderMetadata, build_metadata, nonfinite_items
from .request import EncoderRequest
from .rotary import inv_freq, rotary_cos_sin


class RMSNorm(nn.Module):
    """transformers' Glm4vRMSNorm: statistics in float32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)), no biases; gate and up are one matmul whose weight is packed in tiles of
    ``gate_up_tile(hidden)`` rows (``glmvit.gate_up``: 128 for the real tower's 4096, the whole width when 128 does not
    divide it). On sm_90+ CUDA in fp16/bf16, for the row counts ``glmvit.kernels.fused_gemm_table`` names, that matmul
    and the SwiGLU are one Triton GEMM (:func:`swiglu_linear`: one rounding instead of two or three), which reads the
    packed weight as stored."""

    gate_up_proj: nn.Linear
    gate_up_tile: int

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        fuse_gate_up(self, dim, hidden, gate_up_tile(hidden))
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x))·up(x): the MLP before ``down_proj``."""
        if _half_on_cuda(x) and swiglu_fused(x.shape[0], x.device):
            return swiglu_linear(x, self.gate_up_proj.weight, self.gate_up_tile)
        return swiglu(self.gate_up_proj(x), self.gate_up_tile)


def half_on_cuda(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` on ``device`` is fp16/bf16 on CUDA: where the fused GEMMs of
    ``glmvit.kernels.fused_gemm_table`` may run (and which kernels an eager forward launches: ``glmvit.warmup``)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def _half_on_cuda(x: torch.Tensor) -> bool:
    """Whether ``x`` is (rows, features) and :func:`half_on_cuda`."""
    return x.dim() == 2 and half_on_cuda(x.device, x.dtype)


@torch.library.custom_op("glmvit::swiglu_linear", mutates_args=())
def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """silu(x·Wgᵀ)·(x·Wuᵀ) of a fused [2·hidden, dim] weight packed in tiles of ``tile`` rows (``glmvit.gate_up``;
    ``tile == hidden``: plain [gate; up]) in one Triton GEMM, as one opaque op: torch.compile traces around it, a CUDA
    graph captures it. ``glmvit.kernels.fused_gemm_table`` picks where and how: a packed configuration for a packed
    weight, a two-dot one for a plain weight (``glmvit.gate_up.is_packed``)."""
    from .kernels.fused_gemm_table import swiglu_config  # the kernel modules import Triton: on CUDA only
    from .kernels.triton_swiglu_gemm import swiglu_linear_triton

    packed = is_packed(tile, weight.shape[0] // 2)
    return swiglu_linear_triton(x, weight, swiglu_config(x.shape[0], packed))


@swiglu_linear.register_fake
def _(x, weight, tile):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: EncoderMetadata, backend: str) -> torch.Tensor:
        return self.proj(self.heads(x, cos, sin, meta, backend))

    def heads(self, x, cos, sin, meta: EncoderMetadata, backend: str) -> torch.Tensor:
        """Every head's attention output, concatenated (rows, hidden): the attention before ``proj``."""
        # fused: q and k leave the matmul rotated, not rotated again in attention
        if _half_on_cuda(x) and qkv_rope_fused(x.shape[0], x.device):
            qkv = qkv_rope_linear(x, self.qkv.weight, cos, sin, self.num_heads)
            return attend_qkv(qkv, cos, sin, meta, backend, self.num_heads, rotated=True)
        return attend_qkv(self.qkv(x), cos, sin, meta, backend, self.num_heads)


@torch.library.custom_op("glmvit::qkv_rope_linear", mutates_args=())
def qkv_rope_linear(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_heads: int) -> torch.Tensor:
    """x·Wᵀ with q and k of every head rotated by cos, sin, in one Triton GEMM (``glmvit.kernels.fused_gemm_table``
    picks where and how), as one opaque op: torch.compile traces around it, a CUDA graph captures it."""
    from .kernels.fused_gemm_table import qkv_rope_config
    from .kernels.triton_qkv_rope_gemm import qkv_rope_linear_triton

    return qkv_rope_linear_triton(x, weight, cos, sin, num_heads, qkv_rope_config(x.shape[0]))


@qkv_rope_linear.register_fake
def _(x, weight, cos, sin, num_heads):
    return x.new_empty((x.shape[0], weight.shape[0]))


def residual_add(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x + h``, written so that ``torch.compile`` keeps it a pointwise kernel.

    Inductor rewrites ``mm(a, w) + x`` into ``addmm(x, a, w)`` unless every use of the sum is pointwise (a region's
    output is not), and CUDA's addmm first copies its 2-D input into the output: two device-to-device copies per
    block inside the regional compile (``is_valid_addmm_fusion`` in torch/_inductor/fx_passes/post_grad.py). In half
    precision, adding in float32 and rounding once hides the pattern (its dtypes must match the matmul's) and gives
    eager's bits, since eager also adds half-precision tensors in float32 and rounds once. In float32 the casts are
    no-ops and the rewrite still applies: copies, not a different result.
    """
    if torch.compiler.is_compiling():
        return (x.float() + h.float()).to(x.dtype)
    return x + h


# Where captured half-precision forwards add residuals (project_residual). Asked once, at this import: where
# nvmath-python is installed that imports its matmul module (a broken install counts as none); a constant, so
# torch.compile reads it rather than tracing the question.
RESIDUAL_IN_MATMUL = nvmath_installed()


def project_residual(linear: nn.Linear, h: torch.Tensor, x: torch.Tensor, captured: bool) -> torch.Tensor:
    """``x + linear(h)`` for a bias-free ``linear``: each half of a block ends this way.

    In a forward recorded into a CUDA graph (``captured``) in fp16/bf16 on CUDA, with nvmath-python installed
    (``RESIDUAL_IN_MATMUL``), it is one cuBLASLt matmul with ``x`` as its C operand
    (``glmvit.kernels.lt_gemm.linear_residual``): the add rides in the matmul's epilogue, one launch and one rounding.
    Elsewhere it is the matmul, then :func:`residual_add`, which ``torch.compile`` fuses with the next norm. Captured
    only: the op's host work (nvmath-python's operand checks on every call) is paid once, at capture,
    never per eager forward; and the CPU float32 path stays transformers' exactly.
    """
    if captured and RESIDUAL_IN_MATMUL and _half_on_cuda(h):
        return linear_residual(h, linear.weight, x)
    return residual_add(x, linear(h))


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.out_hidden_size)

    def forward(self, x, cos, sin, meta: EncoderMetadata, backend: str, captured: bool = False) -> torch.Tensor:
        """x + attention(norm1(x)), then + mlp(norm2(·)). ``captured``: the forward is being recorded into a CUDA
        graph, so each residual add may ride in the matmul before it (:func:`project_residual`)."""
        x = project_residual(self.attn.proj, self.attn.heads(self.norm1(x), cos, sin, meta, backend), x, captured)
        return project_residual(self.mlp.down_proj, self.mlp.gated(self.norm2(x)), x, captured)


def run_block(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: EncoderMetadata,
              backend: str, captured: bool = False) -> torch.Tensor:
    """One block as a plain function of its module: what ``torch.compile`` compiles once for all blocks."""
    return block(x, cos, sin, meta, backend, captured)


StaticParts = tuple[Callable[..., Any], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]


class PatchMerger(nn.Module):
    gate_up_proj: nn.Linear
    gate_up_tile: int

    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.out_hidden_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim, eps=config.rms_norm_eps)
        # Plain [gate; up] (one tile of the whole width): only the blocks' MLP runs the fused SwiGLU GEMM, which is
        # what the packed layout is for; the merger's runs the unfused matmul and swiglu, which gain nothing from it.
        fuse_gate_up(self, dim, config.intermediate_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(swiglu(self.gate_up_proj(x), self.gate_up_tile))


class _Embeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.position_embedding = nn.Embedding(config.pos_grid**2, config.hidden_size)


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)


class _Rotary(nn.Module):
    """The rotary inverse frequencies, kept in float32 whatever dtype the model is cast to (as transformers does:
    a bf16 copy would shift rotary angles by up to 0.09 rad at patch positions below 200)."""

    inv_freq: torch.Tensor

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", inv_freq(self.head_dim, self.theta), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> "_Rotary":
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = inv_freq(self.head_dim, self.theta).to(self.inv_freq.device)
        return self


class GlmVisionEncoder(nn.Module):
    """GLM-4V vision tower; ``state_dict`` keys equal transformers' ``Glm4vVisionModel``'s."""

    def __init__(self, config: VisionConfig | None = None, attn_backend: str | None = None):
        super().__init__()
        self.config = config = config or VisionConfig.glm41v()
        self.embeddings = _Embeddings(config)
        self.patch_embed = _PatchEmbed(config)
        self.rotary_pos_emb = _Rotary(config)
        self.post_conv_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        m = config.spatial_merge_size
        self.downsample = nn.Conv2d(config.hidden_size, config.out_hidden_size, kernel_size=m, stride=m)
        self.merger = PatchMerger(config)
        self.attn_backend = attn_backend

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def attention_backend(self, name: str | None = None) -> str:
        """The attention backend ``name``, else the one set, checked against the device and dtype (a one-line
        ValueError naming the choices), else the device's default."""
        name = name if name is not None else self.attn_backend
        if name is None:
            return default_backend(self.device, self.dtype, self.config.head_dim)
        return check_backend(name, self.device, self.dtype, self.config.head_dim)

    def check_grid_thw(self, grid_thw) -> np.ndarray:
        """Validate grids alone (shape, positive integers, divisible by the merge size): an [n, 3] int64 array of
        the caller's own."""
        return self.request_of(grid_thw).grids.copy()

    def request_of(self, grid_thw: Any) -> EncoderRequest:
        """Grids as an :class:`~glmvit.request.EncoderRequest` at this tower's merge size: validated by
        :meth:`EncoderRequest.of <glmvit.request.EncoderRequest.of>`, or, given a request, checked only for its merge
        size (its grids were validated when it was made)."""
        merge = self.config.spatial_merge_size
        if isinstance(grid_thw, EncoderRequest):
            if grid_thw.merge != merge:
                raise ValueError(f"the request was made for merge size {grid_thw.merge}, the tower merges {merge}")
            return grid_thw
        return EncoderRequest.of(grid_thw, merge=merge)

    def check_request(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool = True) -> EncoderRequest:
        """Validate a batch: its grids (or a request validated already, :meth:`request_of`), then its pixels
        against them; returns the request.

        ``check_finite`` also refuses NaN/Inf pixels, naming the items (a host read of one sum per row; pass False
        for pixels validated already). Without it, a non-finite item still cannot change another item's output.
        """
        request = self.request_of(grid_thw)
        width = self.config.patch_dim
        if pixel_values.ndim != 2 or pixel_values.shape[1] != width:
            raise ValueError(
                f"pixel_values must be [rows, {width}] (C·T·P² = {self.config.in_channels}·"
                f"{self.config.temporal_patch_size}·{self.config.patch_size}²), got {tuple(pixel_values.shape)}"
            )
        request.check_pixel_rows(pixel_values.shape[0])
        bad = nonfinite_items(pixel_values, request.grids) if check_finite else []
        if bad:
            raise ValueError(f"pixel_values of item(s) {bad} hold NaN or Inf; fix or drop those items")
        return request

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw, check_finite: bool = True) -> np.ndarray:
        """:meth:`check_request`'s grids: the batch validated, as an [n, 3] int64 numpy array of the caller's own."""
        return self.check_request(pixel_values, grid_thw, check_finite).grids.copy()

    def forward(self, pixel_values: torch.Tensor, grid_thw, check_finite: bool = True,
                attention: str | None = None) -> torch.Tensor:
        """Merger output [Σ t·h·w / m², out_hidden_size] for a batch; a video row (t > 1) is t segments.

        ``grid_thw``: grids, or an :class:`~glmvit.request.EncoderRequest` (its grids are not checked again).
        ``check_finite=False`` skips the NaN/Inf check of ``check_inputs`` (for pixels validated already).
        ``attention``: see :meth:`forward_static`.
        """
        request = self.check_request(pixel_values, grid_thw, check_finite)
        if len(request) == 0:
            return pixel_values.new_zeros((0, self.config.out_hidden_size), dtype=self.dtype)
        meta = build_metadata(request).to(self.device)
        return self.forward_static(pixel_values, meta, attention=attention)

    def forward_static(self, pixels: torch.Tensor, meta: EncoderMetadata, parts: "StaticParts | None" = None,
                       attention: str | None = None, captured: bool = False) -> torch.Tensor:
        """Encode a padded batch of ``meta.shape.rows`` rows; padded output tokens are zero.

        No host syncs with a graph-safe backend. Padded rows lie outside every attention segment and every other op
        is row-local (the downsample merges aligned m²-row blocks), so nothing in a padded row reaches a real one.
        ``parts`` replaces the three stages (``embed``, every block, ``head``), e.g. by compiled versions of them:
        the blocks are 24 copies of one computation, so one compiled block serves them all. ``attention``: a
        backend checked already for this device and dtype (an encoder's, fixed when it was made); None:
        :meth:`attention_backend`. ``captured``: this forward (and the warm-up before it) is recorded into a CUDA graph,
        where host work per op is paid once (:func:`project_residual`).
        """
        cfg = self.config
        if pixels.shape != (meta.shape.rows, cfg.patch_dim):
            raise ValueError(f"pixels must be {(meta.shape.rows, cfg.patch_dim)}, got {tuple(pixels.shape)}")
        backend = attention if attention is not None else self.attention_backend()
        embed, run, head = parts or (self.embed, run_block, self.head)
        x, cos, sin = embed(pixels, meta)
        meta = prepare_attention(meta, backend, cfg.num_heads, cfg.head_dim)
        for block in self.blocks:
            x = run(block, x, cos, sin, meta, backend, captured)
        return head(x, meta)

    def embed(self, pixels: torch.Tensor, meta: EncoderMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Patch rows → hidden states (patch matmul, RMSNorm, + interpolated position table), and the rotary cos/sin."""
        cfg = self.config
        valid_rows = meta.token_valid[:, None].expand(-1, cfg.merge_area).reshape(-1, 1) != 0
        pixels = torch.where(valid_rows, pixels.to(self.dtype), 0)  # whatever sits in padded rows stays there
        conv = self.patch_embed.proj
        x = F.linear(pixels, conv.weight.view(cfg.hidden_size, -1), conv.bias)
        x = self.post_conv_layernorm(x)
        cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, self.rotary_pos_emb.inv_freq)
        table = self.embeddings.position_embedding.weight
        x = x + interpolate_pos_embed(table, meta.h_idx, meta.w_idx, meta.target_h, meta.target_w, check_values=False)
        return x, cos, sin

    def head(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """Hidden states → output tokens: RMSNorm, 2×2 downsample (a matmul over merged rows), merger; padding → 0."""
        cfg = self.config
        x = self.post_layernorm(x)
        x = x.view(-1, cfg.merge_area, cfg.hidden_size).transpose(1, 2).reshape(-1, cfg.merge_area * cfg.hidden_size)
        x = F.linear(x, self.downsample.weight.view(cfg.out_hidden_size, -1), self.downsample.bias)
        x = self.merger(x)
        return x.masked_fill(meta.token_valid[:, None] == 0, 0)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
                        attn_backend: str | None = None):
        """The vision tower of a safetensors checkpoint (a directory, or a file with ``config.json`` beside it).

        Config from ``config.json``; ``dtype=None`` or ``"auto"`` keeps the checkpoint's; built without a
        full-precision copy; returned in eval mode. Only local checkpoints are read (nothing is downloaded). See
        :func:`glmvit.weights.load_pretrained`.
        """
        from .weights import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, attn_backend=attn_backend)
