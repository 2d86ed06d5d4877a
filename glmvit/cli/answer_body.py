"""The body ``glmvit serve`` answers with, written in place: a safetensors file of one tensor ``item_<i>`` per item.

:func:`answer_body` sizes the whole file first (the header, then every item's data, in item order), allocates it
once and copies each embedding straight into its slice, converting to the answer's dtype on the way; a CUDA tensor
crosses to the host there, on the calling thread's own stream (:func:`~glmvit.scheduler.finished_work`), never
behind the encoder's replays. No host copy of an embedding is made first and no second copy of the data follows
(``safetensors.torch.save`` over host copies made both), so an answer costs one pass over its bytes.

The file is what ``safetensors.torch.load`` reads back as ``save`` would have written it: the same names, dtypes,
shapes, values and string metadata. Its layout follows the format: 8 bytes of little-endian header length, the
JSON header (``__metadata__`` first, then each tensor's dtype, shape and data offsets) padded with spaces to a
multiple of 8 bytes, then the data, contiguous, in item order.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Callable

import torch

from ..scheduler import finished_work

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
ALIGN = 8  # the header is padded to this many bytes, as safetensors pads it: the data starts aligned


def answer_body(outputs: list[torch.Tensor], dtype: torch.dtype, metadata: dict[str, str] | None = None,
                allocate: Callable[[int], Any] = bytearray) -> Any:
    """A safetensors file of ``item_<i>`` = ``outputs[i]`` in ``dtype`` (each converted as ``Tensor.to`` converts,
    on the host or on its device), with string ``metadata``. The ``outputs`` must be finished (as the scheduler
    hands them out): a CUDA tensor is copied on this thread's own stream, finished before this returns. The file
    is written into ``allocate(size)``: a zeroed bytearray by default, or any writable buffer of that size (a
    shared-memory file mapped, so that the answer crosses to another process without a copy)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"an answer's dtype must be one of {', '.join(str(d)[6:] for d in DTYPE_NAMES)}, "
                         f"not {str(dtype)[6:]}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    spans, end = [], 0
    for i, tensor in enumerate(outputs):
        size = tensor.numel() * itemsize
        spans.append((end, end + size))
        header[f"item_{i}"] = {"dtype": DTYPE_NAMES[dtype], "shape": list(tensor.shape),
                               "data_offsets": [end, end + size]}
        end += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % ALIGN)
    start = 8 + len(head)
    body = allocate(start + end)
    body[:start] = struct.pack("<Q", len(head)) + head
    device = outputs[0].device if outputs else torch.device("cpu")
    with finished_work(device):
        for tensor, (begin, stop) in zip(outputs, spans, strict=True):
            if begin == stop:
                continue  # an empty tensor has no slice (and torch.frombuffer refuses an empty one)
            target = torch.frombuffer(body, dtype=dtype, count=(stop - begin) // itemsize, offset=start + begin)
            target.view(tensor.shape).copy_(tensor)
            del target  # the body's buffer is exported while a tensor views it
    return body
