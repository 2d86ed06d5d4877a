"""The Triton attention kernel's source, for notebook 10b to walk (``glmvit.lab.show`` prints each).

``glmvit.kernels.triton_attention`` keeps its ``@triton.jit`` functions private. This module names the plain Python
function under each decorator, so that ``inspect.getsource`` prints the kernel as written, under the interpreter
(``TRITON_INTERPRET=1``) or compiled alike: ``rotate`` (the rotary on loaded halves), ``key_scores`` (one key
block's scores), ``online_softmax_step`` (the running max, sum and output updated by one key block),
``attention_kernel`` (one program per row block and head) and ``launcher`` (the grid and the arguments it is launched
with).
"""
from __future__ import annotations

from typing import Any, Callable

from glmvit.kernels import triton_attention


def _undecorated(kernel: Any) -> Callable[..., Any]:
    """The Python function a ``@triton.jit`` decorator wrapped (the JIT and the interpreter both keep it as ``fn``)."""
    return kernel.fn


rotate = _undecorated(triton_attention._rotate)
key_scores = _undecorated(triton_attention._key_scores)
online_softmax_step = _undecorated(triton_attention._online_softmax_step)
attention_kernel = _undecorated(triton_attention._rope_varlen_attention_kernel)
launcher = triton_attention.rope_varlen_attention_triton

__all__ = ["attention_kernel", "key_scores", "launcher", "online_softmax_step", "rotate"]
