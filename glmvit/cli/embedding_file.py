"""The embeddings file that ``encode --out`` writes and ``serve`` answers with: safetensors, one float32 tensor
``item_<i>`` [tokens, out_hidden] per item, and string metadata whose every value is JSON (the layout is in
:mod:`glmvit.cli.encode`'s docstring)."""
from __future__ import annotations

import json
from typing import Any

from ..processing import VisionFrames, VisionInputs


def item_record(source: str | None, sha256: str, kind: str, grid_thw: list[int], tokens: int,
                frame_indices: list[int] | None = None, timestamps: list[float] | None = None) -> dict[str, Any]:
    """What one encoded item is: where it came from (a file's path or name, None for pixel rows), the sha256 of its
    bytes, its kind and grid, its tokens, and a video's sampled frames and their times."""
    return {"source": source, "sha256": sha256, "kind": kind, "grid_thw": grid_thw, "tokens": tokens,
            "frame_indices": frame_indices, "timestamps": timestamps}


def inputs_record(source: str | None, sha256: str, inputs: VisionInputs | VisionFrames, tokens: int) -> dict[str, Any]:
    """:func:`item_record` of a one-item :class:`~glmvit.processing.VisionInputs` or
    :class:`~glmvit.processing.VisionFrames` (one processed file)."""
    return item_record(source, sha256, inputs.kinds[0], inputs.grid_thw[0].tolist(), tokens,
                       inputs.frame_indices[0], inputs.timestamps[0])


def file_metadata(items: list[dict[str, Any]], info: dict[str, Any], provenance: dict[str, Any]) -> dict[str, str]:
    """The safetensors metadata: ``item_<i>`` for each item, then the model's ``info`` and the provenance, as JSON."""
    metadata = {f"item_{i}": json.dumps(item) for i, item in enumerate(items)}
    metadata.update({k: json.dumps(v) for k, v in info.items()}, provenance=json.dumps(provenance))
    return metadata
