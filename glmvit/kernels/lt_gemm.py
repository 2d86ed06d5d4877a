"""x·Wᵀ + r in one cuBLASLt matmul: a block's residual add in the epilogue of the matmul before it.

Spec: ``F.linear(x, weight) + residual`` for x (rows, in), weight (out, in), residual (rows, out), one dtype.

Each block of the tower ends both halves with ``x + proj(·)`` and ``x + down(·)``: a matmul, then an elementwise add
that reads two (rows, out) tensors and writes one. cuBLASLt computes D = α·A·B + β·C with C and D apart, so with
β = 1 and C the residual the add happens in the tile that writes D: one launch, the residual read once, no
intermediate written. torch reaches cuBLASLt's C only through ``addmm``, which copies C into D first (C = D); NVIDIA's
nvmath-python binds cuBLASLt with C apart. ``tools/residual_gemm_ab.py`` measured it on the H100
(``data/sweeps/residual_gemm_ab_h100.json``): cuBLASLt's first-ranked algorithm with C beat ``F.linear`` then the add
on every shape and row count it timed (proj at 8192 rows 63.7 against 82.6 µs, down 143.3 against 168.1; at 256
rows 6.8 against 8.2 and 11.0 against 12.8), and was within 10 % of the best of the 8 ranked ones; so the heuristic's
first choice is the plan here.

:func:`linear_residual` is the op (``glmvit::linear_residual``, opaque to torch.compile, captured by a CUDA graph):
cuBLASLt where :func:`runs` (nvmath-python imports; x on CUDA in fp16/bf16, 2-D, contiguous, residual likewise),
else ``F.linear`` then the add (and where no plan can be made, said once in the log). A plan is made for each
(device, dtype, rows, in, out) on the first call in a thread (the nvmath-python object holds a cuBLASLt handle and a
workspace: not shared across threads), its workspace sized for cuBLASLt's first-ranked algorithm alone and at most
``WORKSPACE_LIMIT``; later calls rebind its operands (``reset_operands``),
execute on the current stream and let go of them again (``release_operands``: a plan must not keep a captured
graph's activations alive). A captured graph holds the plan's workspace pointer, so no plan is ever freed: they are
kept for the process's life (:func:`plans_made` counts them; two per distinct row count). The key has no stream: a
graph is captured on another stream than the warm-up that planned it (``torch.cuda.graph``'s own), and a plan made
inside a capture invalidates it (nvmath-python records events), so a forward must be warmed up, outside any capture,
in the thread that captures it. A plan then serves every stream: the graphs that hold plans made in one thread may be
replayed from any thread, but must be stream-ordered, never two at once on two streams, since they share the plan's
workspace (``execute`` on a stream does not wait for work on another). The runner replays its graphs under one lock on
one stream; the scheduler has one worker; the data-parallel ranks are processes.
Numerics: D = round(x·Wᵀ + r) with the sum in float32, one rounding where ``F.linear`` then the add round twice;
within the tolerance the GPU tests derive for a bf16 forward.

``glmvit.model.project_residual`` calls it in forwards recorded into CUDA graphs only: its host work per call
(nvmath-python's operand checks) is paid once there, at capture.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

_local = threading.local()
_kept: list[Any] = []  # every plan made, in any thread: a captured graph may use its workspace until the process ends
_kept_lock = threading.Lock()


WORKSPACE_LIMIT = 64 * 2**20  # bytes a plan's cuBLASLt workspace may take (kept for good: module docstring)
_log = logging.getLogger(__name__)  # nvmath-python's own (its default, the root logger, would log every call)


@functools.cache
def nvmath_installed() -> bool:
    """Whether nvmath-python's matmul imports here (optional: a CUDA-only binding of cuBLASLt). Asked once: every
    call of the op asks it. A package that is there but fails to import counts as missing (said once, in the log):
    the forwards then add apart, as without it."""
    if importlib.util.find_spec("nvmath") is None:
        return False
    try:
        import nvmath.linalg.advanced  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any broken install: the two ops instead
        _log.warning("nvmath-python is installed but does not import (%s): residual adds stay apart", err)
        return False
    return True


def runs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether :func:`linear_residual` runs cuBLASLt for these operands (else ``F.linear`` then the add)."""
    half = x.dtype in (torch.float16, torch.bfloat16)
    return (x.is_cuda and half and x.dim() == 2 and weight.dim() == 2 and residual.dim() == 2
            and x.dtype == weight.dtype == residual.dtype and x.is_contiguous() and weight.is_contiguous()
            and residual.is_contiguous() and nvmath_installed())


class _Key(NamedTuple):
    device: int
    dtype: torch.dtype
    rows: int
    inputs: int
    outputs: int


def plans_made() -> int:
    """How many plans this process holds (all threads): each keeps a cuBLASLt workspace until the process ends."""
    with _kept_lock:
        return len(_kept)


def _plan(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> Any:
    """This thread's nvmath-python ``Matmul`` for these operands' key, made and planned on a miss (and kept for
    good: module docstring), else rebound to these operands; None where no plan could be made for the key. A miss
    inside a CUDA graph capture raises RuntimeError: planning there would invalidate the capture (module
    docstring), and a fallback cached for good would hide a missing warm-up."""
    plans: dict[_Key, Any] = _local.__dict__.setdefault("plans", {})
    key = _Key(x.device.index or 0, x.dtype, x.shape[0], x.shape[1], weight.shape[0])
    if key not in plans and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"linear_residual: no plan for {key} was made before this capture; warm the forward up "
                           "outside the capture, in the capturing thread")
    stream = torch.cuda.current_stream(x.device)
    if key not in plans:
        from nvmath.linalg.advanced import Matmul

        options = {"logger": _log, "memory_limit": WORKSPACE_LIMIT}
        try:
            mm = Matmul(x, weight.T, c=residual, beta=1.0, options=options, stream=stream)
            # cuBLASLt's heuristic, its first-ranked algorithm only (module docstring): the workspace is sized for
            # the algorithms considered, and this one is all that runs
            mm.plan(preferences={"limit": 1})
        except Exception as err:  # noqa: BLE001 - no plan for this shape here: the two ops, said once
            _log.warning("no cuBLASLt plan for %s (%s): its residual adds stay apart", key, err)
            plans[key] = None
            return None
        with _kept_lock:
            _kept.append(mm)
        plans[key] = mm
        return mm
    mm = plans[key]
    if mm is not None:
        mm.reset_operands(a=x, b=weight.T, c=residual, stream=stream)
    return mm


@torch.library.custom_op("glmvit::linear_residual", mutates_args=())
def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight) + residual`` (module docstring): one cuBLASLt matmul with the residual as C where
    :func:`runs`, else the two ops. Returns a new (rows, out) tensor."""
    if x.shape[1] != weight.shape[1] or residual.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"linear_residual: x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{tuple(residual.shape)} do not make (rows, in)·(out, in)ᵀ + (rows, out)")
    if not runs(x, weight, residual):
        return F.linear(x, weight) + residual
    with torch.cuda.device(x.device):
        mm = _plan(x, weight, residual)
        if mm is None:
            return F.linear(x, weight) + residual
        try:
            return mm.execute(stream=torch.cuda.current_stream(x.device))
        finally:
            mm.release_operands()  # the next call rebinds all three; a failed call keeps none of them either


@linear_residual.register_fake
def _(x, weight, residual):
    return x.new_empty((x.shape[0], weight.shape[0]))
