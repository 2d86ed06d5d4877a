"""Data-parallel encoding: every rank gets the whole request, encodes its share, and an all-gather rebuilds it.

This is vLLM's ``mm_encoder_tp_mode="data"`` for the vision tower (vLLM's ``run_dp_sharded_mrope_vision_model``):

1. :func:`balance_items` — LPT greedy, exactly vLLM's ``get_load_balance_assignment``: sort the items by input
   patch count t·h·w, largest first (ties keep input order), and give each to the currently least-loaded rank
   (ties go to the lowest rank).
2. Every rank selects its items' pixel rows (possibly none) and runs its own :class:`~glmvit.graphs.EncoderGraphRunner`
   (or the eager model) on them. The weights are replicated, so the graphs hold no collectives.
3. One ``all_gather`` *outside* the graphs: each rank concatenates its outputs, pads them to the largest rank's token
   count (a rank without items sends only padding), and after the gather every rank strips the padding and puts the
   items back in input order. Every rank returns the full list.

Works with NCCL (CUDA tensors) and gloo (CPU tensors; the outputs travel over gloo as their bytes, uint8, so any
dtype gathers bit for bit). :meth:`DataParallelEncoder.run` keeps the ranks in step with two small all-gathers
around the encode, so that the ranks never fall out of step silently:

- **Before encoding** every rank sends a header: its request id (the caller's ``request_id``, or a per-rank call
  counter), whether it could take the request (a bad grid, a bad id), a fingerprint of its model
  (:func:`model_fingerprint`: SHA-256 of the config, the dtype, out_hidden_size, and a SHA-256 of every weight,
  computed once when the :class:`DataParallelEncoder` is built) and one of the request (:func:`request_fingerprint`:
  item count, rows, width, dtype, SHA-256 of grid_thw and of the pixel bytes). Different models raise
  :class:`ModelMismatch` on every rank; different ids or requests raise :class:`RequestMismatch` (both are
  ``ValueError``), the latter with the request id where every rank can continue (``resume_at``); a rank that could
  not take the request raises its own error and every other rank raises :class:`RankFailed`. Nothing is encoded in
  any of these cases.
- **After encoding** every rank sends whether its encode succeeded. A failure on any rank raises there (the original
  error) and :class:`RankFailed` everywhere else; nobody enters the data gather, so nothing aborts or hangs, and the
  next request works.
- **Timeouts**: a rank that never arrives (stuck, killed) is bounded by the process group's timeout
  (``init_process_group(timeout=...)``; gloo's default is 30 minutes, :mod:`glmvit.cli.dp_bench` sets
  ``--timeout``). gloo then raises on the waiting ranks, reported as :class:`CollectiveError`; the group is not
  usable afterwards (destroy it and start again). NCCL's watchdog enforces the same timeout by tearing the process
  down. Errors that are not a timeout (a peer raised) never need it: they arrive through the exchanges above.

**Fingerprints** (:func:`tensor_digest`): SHA-256 of a tensor's bytes, equal exactly when the bits are and the
same on every device (a weighted sum misses changes that cancel). A CUDA tensor is copied to the host first; the copy
and the hash are counted in ``stats.check_s``. Pixels passed on the host are hashed in place, without a copy, and
:meth:`DataParallelEncoder.encode_share` copies only this rank's rows to its GPU.

The demo / benchmark on top of this is :mod:`glmvit.cli.dp_bench` (launched with torchrun).

"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import socket
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .encoder import EagerEncoder, Encoder
from .model import GlmVisionEncoder
from .request import EncoderRequest


# ---------------------------------------------------------------------------------------------------------------
# Balancing (pure)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """Which rank encodes which items: ``ranks[r]`` lists item indices in the order rank r encodes them."""

    ranks: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]  # Σ patch counts per rank

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def imbalance(self) -> float:
        """max load / mean load: 1.0 is perfect; the slowest rank sets the request's time. 1.0 for an empty request."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    @property
    def order(self) -> list[int]:
        """vLLM's ``shuffle_indices``: rank 0's items, then rank 1's, … (the layout of the gathered buffer)."""
        return [i for items in self.ranks for i in items]

    @property
    def counts(self) -> list[int]:
        """vLLM's ``gpu_sample_counts``: items per rank."""
        return [len(items) for items in self.ranks]


def _check_world(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size <= 0:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return int(world_size)


def _check_sizes(patch_counts: Any) -> list[int]:
    sizes = []
    for i, s in enumerate(patch_counts):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"patch_counts[{i}] must be a non-negative integer, got {s!r}")
        sizes.append(int(s))
    return sizes


def balance_items(patch_counts: Sequence[int], world_size: int) -> Assignment:
    """LPT greedy over ranks, as vLLM's ``get_load_balance_assignment`` (see the module docstring for the rule).

    >>> balance_items([1000, 100, 200, 50], 2).ranks   # vLLM's docstring example
    ((0,), (2, 1, 3))
    """
    world_size = _check_world(world_size)
    sizes = _check_sizes(patch_counts)
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    # sorted(..., reverse=True) is stable: equal sizes keep their input order, as in vLLM.
    for i in sorted(range(len(sizes)), key=lambda j: sizes[j], reverse=True):
        r = min(range(world_size), key=lambda q: loads[q])  # first minimum: ties go to the lowest rank
        ranks[r].append(i)
        loads[r] += sizes[i]
    return Assignment(tuple(tuple(r) for r in ranks), tuple(loads))


def round_robin_items(patch_counts: Sequence[int], world_size: int) -> Assignment:
    """The naive alternative: item i goes to rank i mod world_size (for comparison; not used for encoding)."""
    world_size = _check_world(world_size)
    sizes = _check_sizes(patch_counts)
    ranks = [tuple(range(r, len(sizes), world_size)) for r in range(world_size)]
    return Assignment(tuple(ranks), tuple(sum(sizes[i] for i in items) for items in ranks))


def patch_counts_of(grid_thw: Any) -> list[int]:
    """Input patches t·h·w per item: the load vLLM balances (rows of pixel_values, not output tokens)."""
    return [spec.rows for spec in EncoderRequest.of(grid_thw, merge=1).items]  # any h, w: rows need no merge


# ---------------------------------------------------------------------------------------------------------------
# What the ranks agree on before encoding (pure, local)
# ---------------------------------------------------------------------------------------------------------------
DIGEST_WORDS = 4  # a SHA-256 digest travels as four int64 words
HASH_PIECE_BYTES = 1 << 20  # tensors are hashed in 1 MiB pieces, on several threads (hashlib releases the GIL)
REQUEST_FIELDS = ("items", "rows", "width", "dtype", *("grid_thw",) * DIGEST_WORDS, *("pixels",) * DIGEST_WORDS)
MODEL_FIELDS = (*("config",) * DIGEST_WORDS, "dtype", "out_hidden_size", *("weights",) * DIGEST_WORDS)
MESSAGE_BYTES = 256  # a failing rank's one-line error travels to the others, UTF-8, truncated to this


def _sha256_pieces(data: memoryview, threads: int) -> bytes:
    """SHA-256 over the SHA-256 of each ``HASH_PIECE_BYTES`` piece of ``data`` (a two-level hash tree: as
    collision-resistant as SHA-256, and its pieces hash in parallel)."""
    pieces = [data[i : i + HASH_PIECE_BYTES] for i in range(0, len(data), HASH_PIECE_BYTES)]
    workers = min(len(pieces), max(1, threads))
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            leaves = list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))
    else:
        leaves = [hashlib.sha256(piece).digest() for piece in pieces]
    return hashlib.sha256(b"".join(leaves)).digest()


def tensor_digest(tensor: torch.Tensor, threads: int | None = None) -> bytes:
    """A SHA-256 digest (32 bytes) of a tensor's dtype, shape and bytes: equal digests mean equal bits.

    Bits, not values: NaN equals itself and −0 differs from +0. Runs on the host with :mod:`hashlib`, on
    ``threads`` threads (default ``torch.get_num_threads()``): a contiguous CPU tensor is read in place (no copy);
    any other is copied to the host first (a CUDA tensor: one device→host copy of its bytes, see the module
    docstring for the cost). Deliberately not a device-side checksum: any sum of the values, however weighted, has
    changes that cancel (+d and −d at the four corners of a rectangle keep every row and column sum).
    """
    x = tensor.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    data = x.contiguous().reshape(-1).view(torch.uint8).numpy().data  # a memoryview of the same memory
    head = f"{x.dtype}{tuple(x.shape)}".encode()
    body = _sha256_pieces(data, torch.get_num_threads() if threads is None else threads)
    return hashlib.sha256(head + body).digest()


def _words(digest: bytes) -> list[int]:
    return np.frombuffer(digest, dtype="<i8").tolist()


def _name_code(name: str) -> int:
    """A small int for a dtype's name (for the header; the digests cover the dtype exactly)."""
    return zlib.crc32(name.encode())


def request_fingerprint(pixel_values: torch.Tensor, grids: np.ndarray, threads: int | None = None) -> torch.Tensor:
    """What every rank must agree on about a request, int64 [len(REQUEST_FIELDS)] on the CPU (names in
    ``REQUEST_FIELDS``): items, rows, width, a code of the pixels' dtype, the SHA-256 of grid_thw (int64) and
    :func:`tensor_digest` of the pixels."""
    grid_bytes = np.ascontiguousarray(grids, dtype="<i8").tobytes()
    words = [len(grids), int(pixel_values.shape[0]), int(pixel_values.shape[1]), _name_code(str(pixel_values.dtype)),
             *_words(hashlib.sha256(grid_bytes).digest()), *_words(tensor_digest(pixel_values, threads))]
    return torch.tensor(words, dtype=torch.int64)


def weights_digest(model: torch.nn.Module, threads: int | None = None) -> bytes:
    """SHA-256 over every ``state_dict`` entry's name and :func:`tensor_digest` (parameters and persistent buffers):
    one read of the weights, 1.8 GB for the GLM-4.1V tower in bf16 (on a GPU, a device→host copy of each first)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + b"\0" + tensor_digest(tensor, threads))
    return digest.digest()


def model_fingerprint(model: GlmVisionEncoder, threads: int | None = None) -> torch.Tensor:
    """What every rank must agree on about its model, int64 [len(MODEL_FIELDS)] on the CPU (names in
    ``MODEL_FIELDS``): the SHA-256 of the config's fields, a code of the dtype, out_hidden_size (the width of the
    gathered rows) and :func:`weights_digest`."""
    config = json.dumps(dataclasses.asdict(model.config), sort_keys=True).encode()
    words = [*_words(hashlib.sha256(config).digest()), _name_code(str(model.dtype)), model.config.out_hidden_size,
             *_words(weights_digest(model, threads))]
    return torch.tensor(words, dtype=torch.int64)


def _differences(rows: np.ndarray, names: Sequence[str]) -> dict[int, list[str]]:
    """rank q ≥ 1 → the names of the fields where its row differs from rank 0's (ranks that agree left out)."""
    out = {}
    for q in range(1, len(rows)):
        fields = list(dict.fromkeys(n for n, a, b in zip(names, rows[q], rows[0], strict=True) if a != b))
        if fields:
            out[q] = fields
    return out


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _pack_message(text: str) -> torch.Tensor:
    data = np.zeros(MESSAGE_BYTES, dtype=np.uint8)
    raw = text.encode("utf-8")[:MESSAGE_BYTES]
    data[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(data.view(np.int64).copy())


def _unpack_message(words: np.ndarray) -> str:
    return np.ascontiguousarray(words, dtype=np.int64).tobytes().rstrip(b"\0").decode("utf-8", "replace")


class RequestMismatch(ValueError):
    """The ranks were given different requests or are out of step: raised on every rank, before anything is encoded.

    ``request_ids[q]`` is rank q's request id. Every rank continues with a request id ≥ ``resume_at``: the ids up to
    it are spent on every rank (a rank that offers one gets an error saying so).
    """

    def __init__(self, message: str, request_ids: list[int], resume_at: int):
        super().__init__(message)
        self.request_ids, self.resume_at = request_ids, resume_at


class ModelMismatch(ValueError):
    """The ranks hold different models (config, dtype, out_hidden_size or weights): raised on every rank, before
    anything is encoded, on every request until each rank builds the same model. ``fields[q]`` names what rank q's
    model differs from rank 0's in."""

    def __init__(self, message: str, fields: dict[int, list[str]]):
        super().__init__(message)
        self.fields = fields


class RankFailed(RuntimeError):
    """Another rank failed this request (``failures``: rank → its error in one line); no rank returned anything.

    The failing rank itself raises its own error. The ranks stay in step: the next request works.
    """

    def __init__(self, message: str, request_id: int, failures: dict[int, str]):
        super().__init__(message)
        self.request_id, self.failures = request_id, failures


class CollectiveError(RuntimeError):
    """An exchange did not complete: a rank stuck past the process group's timeout, a rank gone, or ranks out of
    step in another collective. The process group is not usable afterwards."""


# ---------------------------------------------------------------------------------------------------------------
# The data-parallel encoder
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DPStats:
    """Counters over the requests that returned since construction; ``last`` describes the most recent one."""

    calls: int = 0
    items: int = 0
    local_items: int = 0  # items this rank encoded
    local_tokens: int = 0  # output tokens this rank encoded
    check_s: float = 0.0  # validate + fingerprint + the header exchange (waits for the last rank to arrive)
    local_s: float = 0.0  # select + encode on this rank (synchronised on CUDA)
    sync_s: float = 0.0  # the status exchange: waiting for the slowest rank to finish encoding
    gather_s: float = 0.0  # pack + all_gather + unpack of the outputs (everyone has finished encoding by then)
    total_s: float = 0.0
    imbalance_sum: float = 0.0
    last: dict = field(default_factory=dict)

    @property
    def mean_imbalance(self) -> float:
        return self.imbalance_sum / self.calls if self.calls else 1.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items()}
        d["mean_imbalance"] = self.mean_imbalance
        return d


def _require_group(group: Any) -> None:
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if not dist.is_initialized():
        raise RuntimeError(
            "data-parallel encoding needs an initialised process group: call "
            "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPU) on every rank first, "
            "or launch with `torchrun --nproc-per-node N -m glmvit.cli.dp_bench`"
        )


def _comm_device(group: Any) -> torch.device:
    """Where collective tensors live: the current CUDA device for NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_item(item: Any, position: int, count: int) -> int:
    if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= int(item) < count:
        raise ValueError(f"items[{position}] = {item!r} is not an item index of a request of {count} item(s)")
    return int(item)


def _check_request_id(request_id: Any, last: int) -> int:
    if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral) or request_id < 0:
        raise ValueError(f"request_id must be a non-negative integer, got {request_id!r}")
    if request_id <= last:
        raise ValueError(f"request_id {request_id} is spent on this rank (the last one was {last}): request ids "
                         "must increase (after a RequestMismatch, continue from its resume_at)")
    return int(request_id)


class DataParallelEncoder:
    """Encode a request across the ranks of ``group`` (default: the world); see the module docstring.

    ``encoder`` is an :class:`~glmvit.encoder.Encoder` (:func:`~glmvit.encoder.build_encoder`: a captured runner
    or the eager one) or a :class:`~glmvit.model.GlmVisionEncoder` (run eagerly). Every rank must construct one with
    the same model, and call :meth:`run` with the same requests in the same order. Construction reads the weights
    once to fingerprint the model (:func:`model_fingerprint`; ``model_digest`` is its weights digest in hex): weights
    changed afterwards are not seen, build a new encoder after loading others. Construction is local (no
    collective).
    """

    def __init__(self, encoder: Encoder | GlmVisionEncoder, group: Any = None) -> None:
        _require_group(group)
        if isinstance(encoder, GlmVisionEncoder):
            encoder = EagerEncoder(encoder)
        elif not isinstance(encoder, Encoder):
            raise TypeError(f"expected an Encoder or a GlmVisionEncoder, got {type(encoder).__name__}")
        self.encoder: Encoder = encoder
        self.model = encoder.model
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.comm_device = _comm_device(group)
        self.stats = DPStats()
        self.last_request_id = -1  # the last id this rank spent; ids must increase
        self._model_words = model_fingerprint(self.model)  # once: the weights are read here, never per request
        self.model_digest = self._model_words[-DIGEST_WORDS:].numpy().astype("<i8").tobytes().hex()

    # ---- the exchanges -------------------------------------------------------------------------------------
    def _exchange(self, row: torch.Tensor, phase: str, request_id: int) -> np.ndarray:
        """All-gather one small int64 row per rank: [world_size, len(row)] on the host."""
        parts = [torch.empty_like(row) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, row, group=self.group)
        except RuntimeError as err:  # gloo's timeouts and closed connections (DistBackendError is one)
            raise CollectiveError(f"rank {self.rank}: request {request_id}: the {phase} did not complete (a rank is "
                                  "stuck past the process group's timeout, gone, or out of step): "
                                  f"{_one_line(err)}") from err
        return torch.stack(parts).cpu().numpy()

    def _prepare(self, pixel_values: torch.Tensor, grid_thw: Any, request_id: int | None
                 ) -> tuple[int, EncoderRequest | None, torch.Tensor | None, Exception | None]:
        """This rank's request id, grids, fingerprint, or the error that stops it taking the request (never raises:
        the other ranks must hear of it)."""
        rid, request, fingerprint = -1, None, None
        try:
            rid = self.last_request_id + 1 if request_id is None else _check_request_id(request_id,
                                                                                       self.last_request_id)
            self.last_request_id = rid
            request = self.model.check_request(pixel_values, grid_thw)
            fingerprint = request_fingerprint(pixel_values, request.grids)
        except Exception as err:
            return rid, None, None, err
        return rid, request, fingerprint, None

    def _header(self, request_id: int, fingerprint: torch.Tensor | None, error: Exception | None) -> torch.Tensor:
        """[request id, failed, MODEL_FIELDS…, REQUEST_FIELDS…, message…]: the same length on every rank."""
        head = torch.tensor([request_id, error is not None], dtype=torch.int64)
        if fingerprint is None:
            fingerprint = torch.zeros(len(REQUEST_FIELDS), dtype=torch.int64)
        message = _pack_message(_one_line(error) if error else "")
        return torch.cat([head, self._model_words, fingerprint, message]).to(self.comm_device)

    def _status(self, error: Exception | None) -> torch.Tensor:
        head = torch.tensor([error is not None], dtype=torch.int64)
        return torch.cat([head, _pack_message(_one_line(error) if error else "")]).to(self.comm_device)

    def _raise_failures(self, failed: np.ndarray, messages: np.ndarray, error: Exception | None, request_id: int,
                        stage: str) -> None:
        """If any rank failed: the failing ranks raise their own error, every other rank :class:`RankFailed`."""
        if not failed.any():
            return
        if error is not None:
            raise error
        failures = {int(q): _unpack_message(messages[q]) for q in np.flatnonzero(failed)}
        text = "; ".join(f"rank {q}: {m}" for q, m in failures.items())
        raise RankFailed(f"rank {self.rank}: request {request_id} failed {stage} on rank(s) {sorted(failures)} "
                         f"({text}); no rank returns results for it, the next request can proceed",
                         request_id, failures)

    def _agree(self, table: np.ndarray, request_id: int, error: Exception | None) -> None:
        """Raise the same error on every rank unless every rank holds the same model and took the same request."""
        model_end = 2 + len(MODEL_FIELDS)
        request_end = model_end + len(REQUEST_FIELDS)
        ids, models, fingerprints = table[:, 0], table[:, 2:model_end], table[:, model_end:request_end]
        self._check_models(models, request_id)
        self._raise_failures(table[:, 1] != 0, table[:, request_end:], error, request_id, "before encoding")
        resume_at = int(ids.max()) + 1
        self.last_request_id = resume_at - 1
        if (ids != ids[0]).any():
            where = ", ".join(f"rank {q} at request {i}" for q, i in enumerate(ids.tolist()))
            raise RequestMismatch(f"the ranks are out of step ({where}): a rank skipped or repeated a request; "
                                  f"nothing was encoded; every rank must continue from request_id {resume_at}",
                                  ids.tolist(), resume_at)
        differ = _differences(fingerprints, REQUEST_FIELDS)
        if differ:
            what = "; ".join(f"rank {q} differs from rank 0 in {', '.join(f)}" for q, f in differ.items())
            raise RequestMismatch(f"request {request_id}: the ranks were given different requests ({what}); nothing "
                                  "was encoded; every rank must pass the same pixel_values and grid_thw in the same "
                                  "order (pass request_id to find a rank that skipped one)", ids.tolist(), resume_at)

    def _check_models(self, models: np.ndarray, request_id: int) -> None:
        differ = _differences(models, MODEL_FIELDS)
        if not differ:
            return
        width = MODEL_FIELDS.index("out_hidden_size")
        what = "; ".join(f"rank {q} differs from rank 0 in {', '.join(f)}"
                         + (f" ({models[0, width]} vs {models[q, width]})" if "out_hidden_size" in f else "")
                         for q, f in differ.items())
        raise ModelMismatch(f"rank {self.rank}: request {request_id}: the ranks hold different models ({what}); "
                            "nothing was encoded; every rank must build the same model (config, dtype, weights)",
                            differ)

    # ---- the pieces ----------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.model.device.type == "cuda" or self.comm_device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def assignment(self, grid_thw: Any) -> Assignment:
        """Which rank encodes which items of a request with these grids: what :meth:`run` uses
        (:func:`balance_items` over the items' patch counts)."""
        return balance_items(patch_counts_of(grid_thw), self.world_size)

    def encode_share(self, pixel_values: torch.Tensor, grid_thw: Any, items: Sequence[int],
                     check_finite: bool = True) -> list[torch.Tensor]:
        """The outputs of ``items`` (indices into the request), in that order, encoded on this rank alone: no
        collective, nothing exchanged.

        :meth:`run` encodes this rank's share, ``assignment(grid_thw).ranks[rank]``, through this method (with
        ``check_finite=False``: it checked already), so for that share it returns the bits :meth:`run` returns for
        those items. A subclass may override it to instrument the encode or inject a fault (``dp_bench``'s fault
        drill does). The pixels may live anywhere: only the share's rows are copied to the model's device.
        ``grid_thw``: grids, or an :class:`~glmvit.request.EncoderRequest` (validated already).
        """
        request = self.model.check_request(pixel_values, grid_thw, check_finite=False)
        items = [_check_item(i, k, len(request)) for k, i in enumerate(items)]
        if len(set(items)) != len(items):
            raise ValueError(f"items {items} name an item twice")
        if not items:
            return []
        share = request.select(items)
        local = torch.cat([pixel_values[slice(*request.row_range(i))] for i in items]).to(self.model.device)
        if check_finite:
            self.model.check_request(local, share)
        return self.encoder.encode(local, share, sync=False)  # the exchange that follows orders the stream

    def _encode_or_error(self, pixel_values: torch.Tensor, request: EncoderRequest, items: Sequence[int],
                         expected_tokens: int) -> tuple[list[torch.Tensor], Exception | None]:
        """This rank's outputs, or the error that stopped them (never raises: the other ranks must hear of it)."""
        try:
            outs = self.encode_share(pixel_values, request, items, check_finite=False)
            self._sync()
            got = sum(int(o.shape[0]) for o in outs)
            if got != expected_tokens:
                raise RuntimeError(f"rank {self.rank}: encoded {got} tokens but the assignment expects "
                                   f"{expected_tokens}")
        except Exception as err:
            return [], err
        return outs, None

    def _gather(self, local_outs: list[torch.Tensor], assignment: Assignment, tokens: list[int],
                request_id: int) -> list[torch.Tensor]:
        """Pad to the largest rank, all-gather, strip padding, reorder to input order."""
        width = self.model.config.out_hidden_size
        dtype = self.model.dtype
        pad_to = max(sum(tokens[i] for i in items) for items in assignment.ranks)
        send = torch.zeros(pad_to, width, dtype=dtype, device=self.comm_device)
        offset = 0
        for out in local_outs:
            send[offset : offset + out.shape[0]].copy_(out)
            offset += out.shape[0]
        # Nothing is reduced, only moved: over gloo every dtype travels as its bytes (gloo's dtypes vary by version
        # and exclude int16: torch 2.13 refuses it), so the gather is bitwise whatever the model's dtype.
        wire = send.view(torch.uint8) if self.backend != "nccl" else send
        try:
            if self.backend == "nccl":
                gathered = torch.empty(self.world_size * pad_to, width, dtype=wire.dtype, device=wire.device)
                dist.all_gather_into_tensor(gathered, wire, group=self.group)
                parts = list(gathered.view(self.world_size, pad_to, width))
            else:
                parts = [torch.empty_like(wire) for _ in range(self.world_size)]
                dist.all_gather(parts, wire, group=self.group)
        except RuntimeError as err:
            raise CollectiveError(f"rank {self.rank}: request {request_id}: the output gather did not complete: "
                                  f"{_one_line(err)}") from err
        if wire is not send:
            parts = [p.view(dtype) for p in parts]
        results: list[torch.Tensor | None] = [None] * len(tokens)
        for q, items in enumerate(assignment.ranks):
            part = parts[q].to(self.model.device) if parts[q].device != self.model.device else parts[q]
            start = 0
            for i in items:
                results[i] = part[start : start + tokens[i]]
                start += tokens[i]
        return [out for out in results if out is not None]  # every item belongs to exactly one rank

    # ---- the call ------------------------------------------------------------------------------------------
    def run(self, pixel_values: torch.Tensor, grid_thw: Any, request_id: int | None = None) -> list[torch.Tensor]:
        """The full request's per-item outputs [tokens_i, out_hidden_size], in input order, on every rank.

        ``request_id``: the request's place in the caller's stream (increasing; gaps allowed). Without it each rank
        numbers its calls, which still catches different requests (their fingerprints differ) but cannot say which
        rank skipped one. Raises :class:`ModelMismatch`, :class:`RequestMismatch`, :class:`RankFailed` (or this
        rank's own error) and :class:`CollectiveError` as the module docstring says. Returned tensors are views of
        one freshly allocated gather buffer (never of a graph's static buffer).
        """
        start = time.perf_counter()
        rid, request, fingerprint, error = self._prepare(pixel_values, grid_thw, request_id)
        self._agree(self._exchange(self._header(rid, fingerprint, error), "request check", rid), rid, error)
        assert request is not None  # _agree raised this rank's error otherwise
        t_checked = time.perf_counter()
        sizes = [spec.rows for spec in request.items]
        tokens = request.item_tokens
        assignment = balance_items(sizes, self.world_size)
        times = {"check": t_checked - start, "local": 0.0, "sync": 0.0, "gather": 0.0}
        results: list[torch.Tensor] = []
        if sizes:  # every rank agreed on the same request: an empty one has nothing to encode or gather
            results = self._encode_and_gather(pixel_values, request, assignment, tokens, rid, times)
        self._record(rid, assignment, tokens, times, time.perf_counter() - start)
        return results

    __call__ = run

    def _encode_and_gather(self, pixel_values: torch.Tensor, request: EncoderRequest, assignment: Assignment,
                           tokens: list[int], request_id: int, times: dict) -> list[torch.Tensor]:
        """Encode this rank's items, agree that every rank succeeded, gather; fills ``times`` (seconds)."""
        t0 = time.perf_counter()
        mine = assignment.ranks[self.rank]
        local_outs, error = self._encode_or_error(pixel_values, request, mine, sum(tokens[i] for i in mine))
        t_local = time.perf_counter()
        status = self._exchange(self._status(error), "status exchange", request_id)
        self._raise_failures(status[:, 0] != 0, status[:, 1:], error, request_id, "while encoding")
        t_synced = time.perf_counter()
        results = self._gather(local_outs, assignment, tokens, request_id)
        self._sync()
        times.update(local=t_local - t0, sync=t_synced - t_local, gather=time.perf_counter() - t_synced)
        return results

    def _record(self, request_id: int, assignment: Assignment, tokens: list[int], times: dict, total_s: float) -> None:
        s, mine = self.stats, assignment.ranks[self.rank]
        s.calls += 1
        s.items += len(tokens)
        s.local_items += len(mine)
        s.local_tokens += sum(tokens[i] for i in mine)
        s.check_s += times["check"]
        s.local_s += times["local"]
        s.sync_s += times["sync"]
        s.gather_s += times["gather"]
        s.total_s += total_s
        s.imbalance_sum += assignment.imbalance
        s.last = {
            "rank": self.rank,
            "request_id": request_id,
            "items_per_rank": assignment.counts,
            "tokens_per_rank": [sum(tokens[i] for i in items) for items in assignment.ranks],
            "patches_per_rank": list(assignment.loads),
            "imbalance": assignment.imbalance,
            **{f"{k}_ms": v * 1e3 for k, v in times.items()},
            "total_ms": total_s * 1e3,
        }


def encode_data_parallel(runner_or_model: Encoder | GlmVisionEncoder, pixel_values: torch.Tensor, grid_thw: Any,
                         group: Any = None) -> list[torch.Tensor]:
    """One-shot :meth:`DataParallelEncoder.run`. It hashes the weights on every call: for a stream of requests
    build one :class:`DataParallelEncoder` (which also keeps the stats)."""
    return DataParallelEncoder(runner_or_model, group=group).run(pixel_values, grid_thw)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for single-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
