"""Load vision-tower weights from safetensors (a Hugging Face checkpoint directory or one file). Never unpickles.

Loading is confined and atomic. Every file named by a directory (shards, the index, ``config.json``) must be a
regular file that resolves inside it (inside the cache repository for a Hugging Face cache snapshot, whose files
link into ``blobs/``), checked before it is opened. Every key, shape and dtype across all files is checked before
the first parameter is written, so a bad checkpoint leaves the model untouched. Every error names the file.
"""
from __future__ import annotations

import json
import os
import stat
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterator, Mapping, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from .config import VisionConfig
from .files import read_bounded
from .gate_up import state_like, writable_state
from .rotary import inv_freq

if TYPE_CHECKING:
    from .model import GlmVisionEncoder

    Encoder = TypeVar("Encoder", bound=GlmVisionEncoder)

VISION_PREFIXES = ("model.visual.", "visual.", "vision_model.", "")
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MAX_JSON_BYTES = 64 << 20  # an index or config.json larger than this is not one
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_VISION_LIKE = ("embeddings.", "patch_embed.", "blocks.", "post_", "downsample.", "merger.")


@dataclass(frozen=True)
class LoadedWeights:
    """What was loaded: the safetensors files read, the key prefix of the vision tower in them (e.g.
    ``"model.visual."``), and the checkpoint's dtype (that of most of its vision-weight elements)."""

    files: tuple[Path, ...]
    prefix: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _Source:
    file: Path
    key: str
    handle: Any


def load_vision_weights(model: torch.nn.Module, path: str | Path) -> LoadedWeights:
    """Copy the vision tower's weights from ``path`` (a checkpoint directory or one .safetensors file) into ``model``.

    Raises ValueError (FileNotFoundError for a missing file) before writing anything if a file is unsafe or
    unreadable, or a vision weight is missing, duplicated, misshapen, not floating point, or not in the model.
    """
    with _validated(Path(path), state_like(model)) as (loaded, plan):
        _copy(model, plan)
    return loaded


def load_pretrained(cls: type[Encoder], path: str | Path, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, attn_backend: str | None = None) -> Encoder:
    """``cls`` built from ``path``'s ``config.json`` holding its weights, on ``device`` in ``dtype``, in eval mode.

    ``path``: a local checkpoint directory, or a .safetensors file with ``config.json`` beside it (nothing is
    downloaded: :func:`missing_checkpoint` says how to fetch one). ``dtype=None`` or ``"auto"``: the checkpoint's
    (config.json's ``dtype``/``torch_dtype``, else the tensors'), as transformers' ``dtype="auto"``. Built on the
    meta device, materialised once in ``dtype`` and filled tensor by tensor: there is never a full-precision copy
    of the model.
    """
    path = Path(path)
    config, config_dtype = checkpoint_config(path)
    wanted = config_dtype if dtype is None or dtype == "auto" else _parse_dtype(dtype, "dtype")
    device = torch.device(device if device is not None else "cpu")
    with torch.device("meta"):
        model = cls(config, attn_backend=attn_backend)
    with _validated(path, state_like(model)) as (loaded, plan):
        model = model.to(wanted or loaded.dtype).to_empty(device=device)
        model.rotary_pos_emb.inv_freq = inv_freq(config.head_dim, config.rope_theta).to(device)  # to_empty left junk
        _copy(model, plan)
    return model.eval()


def checkpoint_config(path: str | Path) -> tuple[VisionConfig, torch.dtype | None]:
    """The vision config and the dtype (None when unstated) from the ``config.json`` of a checkpoint."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(missing_checkpoint(path))
    directory = path if path.is_dir() else path.parent
    file = _inside(directory, CONFIG_NAME, directory)
    data = _read_json(file)
    try:
        config = VisionConfig.from_hf(data)
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    raw = data.get("dtype") or data.get("torch_dtype")
    return config, None if raw in (None, "auto") else _parse_dtype(raw, f"{file}: dtype")


def missing_checkpoint(path: str | Path) -> str:
    """The one-line error for a checkpoint path that does not exist: only local files are read, and how to get one
    (a name like ``org/model`` is taken for a Hugging Face model id)."""
    text = str(path)
    hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/"))
    model = text if hub_id else "zai-org/GLM-4.1V-9B-Thinking"
    return (f"{text}: no such checkpoint file or directory (only local checkpoints are read, nothing is downloaded; "
            f"fetch {'it' if hub_id else 'one'} with: huggingface-cli download {model} --local-dir DIR, then pass DIR)")


def _parse_dtype(value: Any, what: str) -> torch.dtype:
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{what} {value!r} is not a floating-point torch dtype (e.g. 'bfloat16')")
    return dtype


@contextmanager
def _validated(path: Path, expected: Mapping[str, torch.Tensor]) -> Iterator[tuple[LoadedWeights, dict[str, _Source]]]:
    """Open every file of the checkpoint, check it against ``expected`` and yield where each weight is read from."""
    files, weight_map = _checkpoint_files(path)
    with ExitStack() as stack:
        handles = {file: _open(stack, file) for file in files}
        where = _locate(handles, weight_map, path)
        yield _plan(path, expected, where)


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files to read, and the index's key → file map when the directory has one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(missing_checkpoint(path)) from None
    if not stat.S_ISDIR(mode):
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: only .safetensors files are loaded (no pickle checkpoints)")
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file")
        return [path], None
    if os.path.lexists(path / INDEX_NAME):
        weight_map = _read_index(path, _inside(path, INDEX_NAME, path))
        return sorted(set(weight_map.values())), weight_map
    files = sorted(_inside(path, f.name, path) for f in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files (pickle checkpoints such as .bin are not loaded)")
    return files, None


def _read_index(directory: Path, index: Path) -> dict[str, Path]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no \"weight_map\" object of tensor name → shard file")
    files: dict[str, Path] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name.endswith(".safetensors"):
            raise ValueError(f"{index}: weight_map[{key!r}] is {name!r}, not a .safetensors file name")
        if name not in files:
            files[name] = _inside(directory, name, index)
    return {key: files[name] for key, name in weight_map.items()}


def _read_json(file: Path) -> dict[str, Any]:
    """A small JSON object from ``file``; any problem is a one-line error naming it."""
    raw = read_bounded(file, MAX_JSON_BYTES, "checkpoint JSON file")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _inside(directory: Path, name: str, source: Path) -> Path:
    """``directory / name``, a regular file that stays inside the checkpoint; ``source`` is the file that named it."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise ValueError(f"{source}: {name!r} is not a file name inside {directory}")
    file = directory / name
    if not file.resolve().is_relative_to(_root(directory)):
        raise ValueError(f"{source}: {name!r} resolves to {file.resolve()}, outside {directory}")
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        named = f" (named by {source})" if source != directory else ""
        raise FileNotFoundError(f"{file}: no such file{named}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{file}: not a regular file")
    return file


def _root(directory: Path) -> Path:
    """Where a checkpoint's files may resolve: the directory, or the whole repository for a Hugging Face cache
    snapshot (``models--org--name/snapshots/REV/`` links into ``models--org--name/blobs/``)."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def _open(stack: ExitStack, file: Path) -> Any:
    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from None


def _locate(handles: dict[Path, Any], weight_map: dict[str, Path] | None, path: Path) -> dict[str, tuple[Path, Any]]:
    """Tensor name → (file, handle); a name in two files, or not where the index says, is an error."""
    where: dict[str, tuple[Path, Any]] = {}
    for file, handle in handles.items():
        for key in handle.keys():
            if key in where:
                raise ValueError(f"{file}: tensor {key!r} is also in {where[key][0]} (a stale or duplicate shard?)")
            where[key] = (file, handle)
    for key, file in (weight_map or {}).items():
        if where.get(key, (None,))[0] != file:
            raise ValueError(f"{path / INDEX_NAME}: weight_map puts {key!r} in {file.name}, which does not hold it")
    return where


def _plan(path: Path, expected: Mapping[str, torch.Tensor],
          where: dict[str, tuple[Path, Any]]) -> tuple[LoadedWeights, dict[str, _Source]]:
    """Check every expected weight (present, right shape, floating point) and that no vision weight is left over."""
    prefix = _detect_prefix(path, list(where), set(expected))
    found = {k[len(prefix):]: k for k in where if k.startswith(prefix)}
    missing = sorted(set(expected) - set(found))
    extra = sorted(k for k in found if k not in expected and k.startswith(_VISION_LIKE))
    problems = [f"missing vision weights {_few(missing)}"] if missing else []
    problems += [f"vision weights the model does not have {_few(extra)} (a config for another tower?)"] if extra else []
    plan: dict[str, _Source] = {}
    elements: Counter[torch.dtype] = Counter()
    for name in sorted(set(expected) & set(found)):
        file, handle = where[found[name]]
        shape, dtype = _header(handle, found[name])
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{file.name}: {name} is {dtype}, not floating point")
        elif shape != tuple(expected[name].shape):
            problems.append(f"{file.name}: {name}: checkpoint {shape} vs model {tuple(expected[name].shape)}")
        else:
            plan[name] = _Source(file, found[name], handle)
            elements[FLOAT_DTYPES[dtype]] += expected[name].numel()
    if problems:
        raise ValueError(f"{path} (prefix {prefix!r}): " + "; ".join(problems[:8])
                         + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    files = tuple(sorted({source.file for source in plan.values()}))
    return LoadedWeights(files, prefix, elements.most_common(1)[0][0]), plan


def _header(handle: Any, key: str) -> tuple[tuple[int, ...], str]:
    """Shape and safetensors dtype of one tensor, read from the header (the slice, which maps the file, is dropped)."""
    tensor = handle.get_slice(key)
    return tuple(tensor.get_shape()), tensor.get_dtype()


def _detect_prefix(path: Path, keys: list[str], expected: set[str]) -> str:
    for prefix in VISION_PREFIXES:
        if any(k.startswith(prefix) and k[len(prefix):] in expected for k in keys):
            return prefix
    raise ValueError(
        f"{path}: checkpoint holds no GLM-4V vision weights (looked for keys such as "
        f"'model.visual.{min(expected)}' under prefixes {VISION_PREFIXES})"
    )


def _few(names: list[str]) -> str:
    return str(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _copy(model: torch.nn.Module, plan: dict[str, _Source]) -> None:
    """Write each planned tensor into ``model``, converting dtype and device: through ``writable_state``, whose
    entries share the model's storage (a packed gate_up weight's ``state_dict()`` halves are copies)."""
    state = writable_state(model)
    with torch.no_grad():
        for name, source in plan.items():
            target = state[name]
            target.copy_(source.handle.get_tensor(source.key).view(target.shape))
