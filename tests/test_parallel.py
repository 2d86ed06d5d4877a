"""Data-parallel encoding: vLLM's LPT balancing (pure), and real gloo process groups on CPU (2 and 3 ranks).

The multi-process cases run inside ONE spawn per world size (spawning is slow); each rank records a verdict per
case and the parametrised tests below read them. Oracles, computed in every rank on the same random weights:

- per-item eager ``model.forward`` (atol 1e-5): what each item must become, whatever the batching;
- the same runner on the same per-rank batch in-process (``torch.equal``): the gather moves bytes, it must not
  change a single bit, and shapes there match exactly;
- rank 0's result broadcast (``torch.equal``): every rank returns the same list.

The fault cases (``FAULTS``) run in the same spawns: a rank that skips a request, pixels that differ under equal grids
(also by a change that keeps every row and column sum), a rank with other weights or another out_hidden_size, bad
input or an encode error on one rank; each must raise on every rank before the gather, and the next request must
work. bf16 models run through the same gather (over gloo, as bytes) and must match bit for bit. A stuck rank (the
collective timeout) gets its own processes, killed if they outlive their deadline. The tool, ``dp_bench``, is
tested in ``tests/test_dp_bench.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glmvit import VisionConfig, parallel
from glmvit.graphs import EncoderGraphRunner
from glmvit.model import GlmVisionEncoder
from glmvit.packing import BudgetConfig
from glmvit.parallel import (
    MODEL_FIELDS,
    REQUEST_FIELDS,
    Assignment,
    CollectiveError,
    DataParallelEncoder,
    ModelMismatch,
    RankFailed,
    RequestMismatch,
    balance_items,
    encode_data_parallel,
    free_port,
    model_fingerprint,
    patch_counts_of,
    request_fingerprint,
    round_robin_items,
    tensor_digest,
)
from glmvit.random_weights import randomize_
from glmvit.workloads import random_batch


# ---------------------------------------------------------------------------------------------------------------
# balance_items (pure)
# ---------------------------------------------------------------------------------------------------------------
def vllm_get_load_balance_assignment(sizes, num_gpus):
    """vLLM's ``vllm/model_executor/models/vision.py::get_load_balance_assignment``, transcribed as the oracle."""
    n_samples = len(sizes)
    if n_samples == 0:
        return [], [0] * num_gpus, [0] * num_gpus
    gpu_assignments = [[] for _ in range(num_gpus)]
    gpu_loads = [0] * num_gpus
    large_to_small_indices = sorted(range(n_samples), key=lambda i: sizes[i], reverse=True)
    for idx in large_to_small_indices:
        min_gpu = min(range(num_gpus), key=lambda i: gpu_loads[i])
        gpu_assignments[min_gpu].append(idx)
        gpu_loads[min_gpu] += sizes[idx]
    shuffle_indices, gpu_sample_counts = [], []
    for gpu_id in range(num_gpus):
        shuffle_indices.extend(gpu_assignments[gpu_id])
        gpu_sample_counts.append(len(gpu_assignments[gpu_id]))
    return shuffle_indices, gpu_sample_counts, gpu_loads


def test_vllm_docstring_example():
    a = balance_items([1000, 100, 200, 50], 2)
    assert a.ranks == ((0,), (2, 1, 3))
    assert a.order == [0, 2, 1, 3] and a.counts == [1, 3] and a.loads == (1000, 350)
    assert a.imbalance == pytest.approx(1000 / 675)


def test_ties_keep_input_order_and_go_to_the_lowest_rank():
    assert balance_items([5, 5, 5, 5, 5], 2).ranks == ((0, 2, 4), (1, 3))
    assert balance_items([1, 1], 3).ranks == ((0,), (1,), ())


@pytest.mark.parametrize("seed", range(40))
def test_matches_vllm_and_covers_every_item_once(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.integers(1, 9))
    n = int(rng.integers(0, 30))
    # few distinct sizes ⇒ many ties, which is where a re-implementation drifts from vLLM's
    sizes = [int(s) for s in rng.choice([64, 256, 1024, 4 * 256, 5476, 0], size=n)]
    a = balance_items(sizes, world)
    order, counts, loads = vllm_get_load_balance_assignment(sizes, world)
    assert (a.order, a.counts, list(a.loads)) == (order, counts, loads)
    assert sorted(a.order) == list(range(n)) and a.world_size == world
    assert all(load == sum(sizes[i] for i in items) for load, items in zip(a.loads, a.ranks, strict=False))
    # the greedy invariant: replaying the decisions, each item went to a rank that was least loaded at the time
    running = [0] * world
    owner = {i: r for r, items in enumerate(a.ranks) for i in items}
    for i in sorted(range(n), key=lambda j: -sizes[j]):
        assert running[owner[i]] == min(running)
        running[owner[i]] += sizes[i]
    if n:  # list-scheduling bound: the slowest rank exceeds the mean by at most the largest item
        assert max(a.loads) <= sum(sizes) / world + max(sizes)


def test_imbalance_and_round_robin():
    sizes = [4096, 64, 64, 64, 4096, 64]
    lpt, rr = balance_items(sizes, 2), round_robin_items(sizes, 2)
    assert rr.ranks == ((0, 2, 4), (1, 3, 5)) and rr.loads == (8256, 192)
    assert lpt.loads == (4224, 4224) and lpt.imbalance == 1.0 < rr.imbalance
    assert balance_items([], 3) == Assignment(((), (), ()), (0, 0, 0)) and balance_items([], 3).imbalance == 1.0
    assert balance_items([7], 1).imbalance == 1.0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size"):
        balance_items([1, 2], bad)


@pytest.mark.parametrize("bad", [[-1], [1.5], [True]])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="patch_counts"):
        balance_items(bad, 2)


def test_patch_counts_are_input_rows():
    assert patch_counts_of([[1, 16, 16], [4, 16, 16]]) == [256, 1024]
    assert patch_counts_of(torch.zeros(0, 3, dtype=torch.long)) == []


# ---------------------------------------------------------------------------------------------------------------
# The request fingerprint (pure)
# ---------------------------------------------------------------------------------------------------------------
def _linear_checksum(x):
    """What the request check used to compare: the sum, the row-weighted and the column-weighted sums of the int16
    view (Python integers, exact). A change that keeps every row and column sum leaves it unchanged."""
    bits = x.contiguous().view(torch.int16).tolist()
    rows = [sum(r) for r in bits]
    cols = [sum(c) for c in zip(*bits, strict=True)]
    return sum(rows), sum((i + 1) * s for i, s in enumerate(rows)), sum((j + 1) * s for j, s in enumerate(cols))


def corners_changed(pixels, d=7):
    """+d, −d, −d, +d at the corners of a rectangle of the int16 view (rows 3 and 20, columns 5 and 11: the high
    halves of float32 values, far from int16's ends, so nothing wraps)."""
    x = pixels.clone()
    bits = x.view(torch.int16)
    for (r, c), step in zip([(3, 5), (3, 11), (20, 5), (20, 11)], [d, -d, -d, d], strict=True):
        bits[r, c] += step
    return x


def test_tensor_digest_is_of_the_bits():
    x = torch.randn(37, 24, generator=torch.Generator().manual_seed(1))
    base = tensor_digest(x)
    assert len(base) == 32 and tensor_digest(x.clone()) == base
    strided = torch.empty(24, 37).t()
    strided.copy_(x)  # the same values in a non-contiguous layout
    assert not strided.is_contiguous() and tensor_digest(strided) == base
    for r, c in [(0, 0), (18, 11), (36, 23)]:  # one ulp anywhere
        y = x.clone()
        y[r, c] = torch.nextafter(y[r, c], torch.tensor(float("inf")))
        assert tensor_digest(y) != base
    assert tensor_digest(x.view(torch.int32)) != base  # the same bytes as another dtype
    assert tensor_digest(x.reshape(24, 37)) != base  # or another shape
    zeros = torch.zeros(4)
    assert tensor_digest(zeros) != tensor_digest(-zeros)  # bits, not values: −0 is not +0
    nan = torch.full((4,), float("nan"))
    assert tensor_digest(nan) == tensor_digest(nan.clone())  # and NaN is itself
    assert tensor_digest(corners_changed(x)) != base


def test_tensor_digest_does_not_depend_on_threads(monkeypatch):
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for piece in (1 << 20, 100, 7):  # one piece; many; a ragged last piece
        monkeypatch.setattr(parallel, "HASH_PIECE_BYTES", piece)
        assert len({tensor_digest(x, threads) for threads in (1, 2, 5)}) == 1


@pytest.mark.gpu
def test_tensor_digest_is_the_same_on_the_gpu():
    x = torch.randn(300, 1176).to(torch.bfloat16)
    assert tensor_digest(x.cuda()) == tensor_digest(x)


def _differs(names, a, b):
    return {f for f, x, y in zip(names, a.tolist(), b.tolist(), strict=True) if x != y}


def test_fingerprint_tells_same_size_requests_apart(tiny_config):
    pixels, grid = random_batch([[1, 4, 4], [1, 4, 4]], tiny_config, seed=0)
    grids = grid.numpy()
    base = request_fingerprint(pixels, grids)

    def differs(p, g=grids):
        return _differs(REQUEST_FIELDS, request_fingerprint(p, np.asarray(g)), base)

    one_ulp = pixels.clone()
    one_ulp[20, 7] = torch.nextafter(one_ulp[20, 7], torch.tensor(float("inf")))
    swapped = torch.cat([pixels[16:], pixels[:16]])  # the two images in the other order: the same grids
    bgr = pixels.view(32, 3, -1).flip(1).reshape(32, -1)  # channels in the other order: every row keeps its values
    assert differs(pixels.clone()) == set()
    assert differs(one_ulp) == differs(swapped) == differs(bgr) == {"pixels"}
    assert differs(pixels, [[1, 2, 8], [1, 4, 4]]) == {"grid_thw"}
    assert "dtype" in differs(pixels.to(torch.bfloat16))


def test_fingerprint_sees_changes_a_linear_checksum_cannot(tiny_config):
    """+7/−7/−7/+7 at a rectangle's corners keeps every row and column sum: the old checksum passed it, and each
    rank returned the other's pixels' embeddings. The fingerprint hashes the bytes."""
    pixels, grid = random_batch([[1, 4, 4], [1, 4, 4]], tiny_config, seed=0)
    changed = corners_changed(pixels)
    assert _linear_checksum(changed) == _linear_checksum(pixels) and not torch.equal(changed, pixels)
    assert torch.isfinite(changed).all()  # still a valid request: only the fingerprint can tell them apart
    assert _differs(REQUEST_FIELDS, request_fingerprint(changed, grid.numpy()),
                    request_fingerprint(pixels, grid.numpy())) == {"pixels"}


def test_model_fingerprint_covers_config_dtype_and_weights(tiny_config):
    def model(config=tiny_config, seed=0):
        return randomize_(GlmVisionEncoder(config), seed=seed).eval()

    base = model_fingerprint(model())
    assert torch.equal(model_fingerprint(model()), base)  # the same seed builds the same model
    assert _differs(MODEL_FIELDS, model_fingerprint(model(seed=1)), base) == {"weights"}
    wider = dataclasses.replace(tiny_config, out_hidden_size=2 * tiny_config.out_hidden_size)
    assert _differs(MODEL_FIELDS, model_fingerprint(model(wider)), base) == {"config", "out_hidden_size", "weights"}
    assert _differs(MODEL_FIELDS, model_fingerprint(model().to(torch.bfloat16)), base) == {"dtype", "weights"}
    nudged = model()
    with torch.no_grad():
        w = nudged.blocks[-1].mlp.down_proj.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))  # one ulp of one weight
    assert _differs(MODEL_FIELDS, model_fingerprint(nudged), base) == {"weights"}


def test_needs_an_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised process group"):
        DataParallelEncoder(GlmVisionEncoder(VisionConfig.tiny()))


@pytest.fixture
def world_of_one():
    """A gloo group of one rank in this process, destroyed afterwards (the other tests see none)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_encode_share_is_what_run_encodes(world_of_one, tiny_config):
    model = randomize_(GlmVisionEncoder(tiny_config), seed=0).eval()
    dp = DataParallelEncoder(model)
    pixels, grids = random_batch([[1, 4, 4], [2, 4, 4], [1, 2, 2]], tiny_config, seed=0)
    assignment = dp.assignment(grids)
    assert assignment == balance_items(patch_counts_of(grids), 1) and assignment.ranks == ((1, 0, 2),)
    outs = dp.run(pixels, grids)
    share = dp.encode_share(pixels, grids, assignment.ranks[0])
    assert all(torch.equal(outs[i], o) for i, o in zip(assignment.ranks[0], share, strict=True))
    assert dp.encode_share(pixels, grids, []) == []
    for items, message in [([3], r"items\[0\] = 3 is not an item index of a request of 3 item"),
                           ([0, True], r"items\[1\] = True"), ([-1], r"items\[0\] = -1"),
                           ([1, 1], "name an item twice")]:
        with pytest.raises(ValueError, match=message):
            dp.encode_share(pixels, grids, items)
    with pytest.raises(ValueError, match="rows"):
        dp.encode_share(pixels[:-1], grids, [0])


def test_the_weights_are_hashed_once_per_encoder(world_of_one, tiny_config, monkeypatch):
    model = randomize_(GlmVisionEncoder(tiny_config), seed=0).eval()
    calls = []
    digest = parallel.weights_digest
    monkeypatch.setattr(parallel, "weights_digest", lambda *a, **k: calls.append(1) or digest(*a, **k))
    dp = DataParallelEncoder(model)
    for k in range(3):
        dp.run(*_stream(model, k))
    assert len(calls) == 1 and len(dp.model_digest) == 64
    assert dp.model_digest == digest(model).hex()


# ---------------------------------------------------------------------------------------------------------------
# Real process groups (gloo on CPU; NCCL on ≥ 2 GPUs)
# ---------------------------------------------------------------------------------------------------------------
BUDGETS = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)
CASES = {
    "one_item": [[1, 4, 4]],  # fewer items than ranks: the other ranks send only padding
    "two_items": [[1, 4, 6], [1, 2, 2]],
    "mixed": [[1, 4, 4], [2, 4, 4], [1, 12, 12], [1, 2, 4], [3, 2, 2], [1, 6, 6], [1, 4, 8]],
    "oversize_only": [[1, 12, 12]],  # 36 tokens > the largest budget (32): eager fallback on one rank
    "videos": [[2, 4, 4], [4, 2, 6], [3, 4, 2]],
    "ties": [[1, 4, 4]] * 5,
    "empty": [],
}
GPU_TOL = 1e-4  # fp32 on CUDA: batched vs per-item attention / GEMM shapes differ
BF16_CASES = ("mixed", "one_item")  # several items per rank; a rank that sends only padding


def _encode_rank_batch(engine, model, pixels, grids, items):
    """What one rank computes for ``items`` when alone in this process (the bitwise oracle)."""
    if not items:
        return []
    sizes = patch_counts_of(grids)
    start = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    local = torch.cat([pixels[start[i] : start[i + 1]] for i in items]).to(model.device)
    sub = grids[list(items)]
    if isinstance(engine, EncoderGraphRunner):
        return engine.run(local, sub)
    with torch.inference_mode():
        return list(model(local, sub).split([sizes[i] // model.config.merge_area for i in items]))


def _check_case(dp, engine, model, grids_list, seed, tol):
    config, rank, world = model.config, dist.get_rank(), dist.get_world_size()
    pixels, grids = random_batch(grids_list, config, seed=seed)
    pixels = pixels.to(model.device)
    fallback_before = engine.stats.fallback_items if isinstance(engine, EncoderGraphRunner) else 0
    outs = dp.run(pixels, grids)
    sizes = patch_counts_of(grids)
    assignment = balance_items(sizes, world)
    tokens = [s // config.merge_area for s in sizes]
    assert len(outs) == len(sizes)
    assert [tuple(o.shape) for o in outs] == [(t, config.out_hidden_size) for t in tokens]
    assert dp.stats.last["items_per_rank"] == assignment.counts
    assert dp.stats.last["tokens_per_rank"] == [sum(tokens[i] for i in r) for r in assignment.ranks]
    # 1) per-item eager forward, single process
    start = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    with torch.inference_mode():
        for i, out in enumerate(outs):
            ref = model(pixels[start[i] : start[i + 1]], grids[i : i + 1])
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # 2) every rank's items equal, bitwise, that rank's batch run here alone
    for q, items in enumerate(assignment.ranks):
        for i, ref in zip(items, _encode_rank_batch(engine, model, pixels, grids, items), strict=False):
            assert torch.equal(outs[i], ref), f"item {i} (rank {q}'s batch) differs from a local run of that batch"
    # 3) every rank returns the same bits as rank 0
    flat = torch.cat(outs) if outs else torch.zeros(0, config.out_hidden_size, device=model.device)
    flat = flat.to(dp.comm_device).contiguous()
    theirs = flat.clone()
    if flat.numel():
        dist.broadcast(theirs, src=0)
    assert torch.equal(flat, theirs)
    # oversize items ran eagerly on the rank that owns them
    if isinstance(engine, EncoderGraphRunner):
        oversize = sum(1 for i in assignment.ranks[rank] if tokens[i] > BUDGETS.largest)
        assert engine.stats.fallback_items - fallback_before >= oversize


def _check_bf16_case(dp, engine, model, grids_list, seed):
    """bf16 through the gather (over gloo: as bytes): every item equals, bit for bit, its rank's batch encoded
    here alone, and every rank returns rank 0's bits."""
    pixels, grids = random_batch(grids_list, model.config, seed=seed)
    pixels = pixels.to(model.device, torch.bfloat16)
    outs = dp.run(pixels, grids)
    assert len(outs) == len(grids) and all(o.dtype == torch.bfloat16 for o in outs)
    for items in balance_items(patch_counts_of(grids), dist.get_world_size()).ranks:
        for i, ref in zip(items, _encode_rank_batch(engine, model, pixels, grids, items), strict=True):
            assert torch.equal(outs[i].view(torch.int16), ref.view(torch.int16)), f"item {i} is not bitwise equal"
    bits = torch.cat(outs).view(torch.uint8).to(dp.comm_device).contiguous()  # gloo has no int16
    theirs = bits.clone()
    dist.broadcast(theirs, src=0)
    assert torch.equal(bits, theirs)


def _bf16_verdicts(device, backend):
    with torch.device(device):
        model = GlmVisionEncoder(VisionConfig.tiny())
    model = randomize_(model.cpu(), seed=0).to(device, torch.bfloat16).eval()
    runner = EncoderGraphRunner(model, BUDGETS, mode="cuda" if backend == "nccl" else "emulate",
                                progress=False).capture()
    verdicts = {}
    for engine_name, engine in {"runner": runner, "eager": model}.items():
        dp = DataParallelEncoder(engine)
        for k, name in enumerate(BF16_CASES):
            try:
                _check_bf16_case(dp, engine, model, CASES[name], seed=20 + k)
                verdicts[f"bf16:{engine_name}:{name}"] = "ok"
            except Exception:
                verdicts[f"bf16:{engine_name}:{name}"] = traceback.format_exc()
    return verdicts


def _mismatch_raises_everywhere(dp, model):
    grids = [[1, 4, 4]] if dist.get_rank() == 0 else [[1, 4, 6]]
    _expect(functools.partial(dp.run, *random_batch(grids, model.config, seed=0)), RequestMismatch,
            "rank 1 differs from rank 0 in rows, grid_thw, pixels")


# ---- faults: every rank raises the same way, before the gather, and the next request works --------------------
def _expect(call, error_type, *fragments):
    """``call()`` must raise ``error_type`` with every fragment in its message; returns the error."""
    try:
        call()
    except error_type as err:
        assert all(f in str(err) for f in fragments), f"{fragments} not all in: {err}"
        return err
    raise AssertionError(f"expected {error_type.__name__}, nothing was raised")


def _stream(model, k):
    """Request k of a stream of same-size images (two 4×4-patch images): every request passes a grid-only check."""
    pixels, grids = random_batch([[1, 4, 4], [1, 4, 4]], model.config, seed=1000 + k)
    return pixels.to(model.device), grids


def _works(dp, model, request, tol, **kwargs):
    """The request goes through and every item equals its per-item eager forward."""
    pixels, grids = request
    outs = dp.run(pixels, grids, **kwargs)
    assert len(outs) == len(grids)
    start = np.concatenate([[0], np.cumsum(patch_counts_of(grids))]).astype(int)
    with torch.inference_mode():
        for i, out in enumerate(outs):
            ref = model(pixels[start[i] : start[i + 1]], grids[i : i + 1])
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def _skip_with_request_ids(engine, model, tol):
    dp, rank, last = DataParallelEncoder(engine), dist.get_rank(), dist.get_world_size() - 1
    _works(dp, model, _stream(model, 0), tol, request_id=0)
    k = 2 if rank == last else 1  # the last rank's caller caught a preprocessing error on request 1 and skipped it
    err = _expect(functools.partial(dp.run, *_stream(model, k), request_id=k), RequestMismatch, "out of step",
                  f"rank {last} at request 2", "continue from request_id 3")
    assert err.request_ids == [1] * last + [2] and err.resume_at == 3
    if rank == 0:  # a rank that does not resume at resume_at is refused, and the others hear of it
        _expect(functools.partial(dp.run, *_stream(model, 2), request_id=2), ValueError, "request_id 2 is spent")
    else:
        _expect(functools.partial(dp.run, *_stream(model, 3), request_id=3), RankFailed,
                "before encoding on rank(s) [0]", "request_id 2 is spent")
    _works(dp, model, _stream(model, 4), tol, request_id=4)


def _skip_without_request_ids(engine, model, tol):
    dp, rank, last = DataParallelEncoder(engine), dist.get_rank(), dist.get_world_size() - 1
    _works(dp, model, _stream(model, 0), tol)
    ahead = int(rank == last)  # the last rank skipped request 1: from then on it is one request ahead
    for k in (1, 2):  # out of step, every call raises on every rank: never another request's items
        _expect(functools.partial(dp.run, *_stream(model, k + ahead)), RequestMismatch,
                f"rank {last} differs from rank 0 in pixels", "nothing was encoded")
    _works(dp, model, _stream(model, 4), tol)  # the callers realigned their streams


def _pixels_differ(engine, model, tol):
    dp = DataParallelEncoder(engine)
    pixels, grids = _stream(model, 0)
    if dist.get_rank() == 1:
        pixels = pixels.clone()
        pixels[-1, -1] += 1
    err = _expect(functools.partial(dp.run, pixels, grids), RequestMismatch, "rank 1 differs from rank 0 in pixels")
    assert "rank 2" not in str(err)
    _works(dp, model, _stream(model, 1), tol)


class _CountingEncoder(DataParallelEncoder):
    """Counts this rank's encodes: a check that must stop a request before encoding leaves it at zero."""

    encodes = 0

    def encode_share(self, *args, **kwargs):
        self.encodes += 1
        return super().encode_share(*args, **kwargs)


def _pixels_differ_at_rectangle_corners(engine, model, tol):
    dp = _CountingEncoder(engine)
    pixels, grids = _stream(model, 0)
    if dist.get_rank() == 1:  # every row and column sum of the bits is the same as rank 0's
        pixels = corners_changed(pixels)
    _expect(functools.partial(dp.run, pixels, grids), RequestMismatch, "rank 1 differs from rank 0 in pixels",
            "nothing was encoded")
    assert dp.encodes == 0
    _works(dp, model, _stream(model, 1), tol)


def _other_model(model, **changes):
    """Rank 1's model: the tiny config with ``changes`` (seeded as every rank's) or, without changes, other weights."""
    config = dataclasses.replace(model.config, **changes)
    return randomize_(GlmVisionEncoder(config), seed=0 if changes else 1).to(model.device).eval()


def _models_differ(engine, model, tol, changes, fragments):
    rank = dist.get_rank()
    dp = _CountingEncoder(_other_model(model, **changes) if rank == 1 else engine)
    for k in (0, 1):  # every request, until the ranks hold the same model
        err = _expect(functools.partial(dp.run, *_stream(model, k)), ModelMismatch, f"rank {rank}: request {k}",
                      *fragments, "nothing was encoded")
        assert list(err.fields) == [1]
    assert dp.encodes == 0
    _works(DataParallelEncoder(engine), model, _stream(model, 2), tol)  # nothing aborted: the group still works


def _different_weights(engine, model, tol):
    _models_differ(engine, model, tol, {}, ["rank 1 differs from rank 0 in weights)"])


def _different_out_hidden_size(engine, model, tol):
    width = model.config.out_hidden_size
    _models_differ(engine, model, tol, {"out_hidden_size": width // 2},
                   [f"rank 1 differs from rank 0 in config, out_hidden_size, weights ({width} vs {width // 2})"])


def _bad_input_on_one_rank(engine, model, tol):
    dp = DataParallelEncoder(engine)
    pixels, grids = _stream(model, 0)
    if dist.get_rank() == 1:
        _expect(functools.partial(dp.run, pixels[:-1], grids), ValueError, "rows")
    else:
        _expect(functools.partial(dp.run, pixels, grids), RankFailed, "before encoding on rank(s) [1]", "rows")
    _works(dp, model, _stream(model, 1), tol)


@contextlib.contextmanager
def _runner_raises(runner):
    def boom(*args, **kwargs):
        raise RuntimeError("injected fault inside the runner")

    runner.encode = boom  # the instance attribute shadows the method
    try:
        yield
    finally:
        del runner.encode


def _encode_fails_on_one_rank(runner, model, tol):
    dp = DataParallelEncoder(runner)
    request = _stream(model, 0)  # two items: ranks 0 and 1 encode one each, a third rank none
    if dist.get_rank() == 1:
        with _runner_raises(runner):
            _expect(functools.partial(dp.run, *request), RuntimeError, "injected fault")
    else:
        err = _expect(functools.partial(dp.run, *request), RankFailed, "while encoding on rank(s) [1]",
                      "RuntimeError: injected fault")
        assert err.failures == {1: "RuntimeError: injected fault inside the runner"}
    _works(dp, model, _stream(model, 1), tol)


FAULTS = {"skip_with_request_ids": _skip_with_request_ids, "skip_without_request_ids": _skip_without_request_ids,
          "pixels_differ": _pixels_differ, "pixels_differ_at_rectangle_corners": _pixels_differ_at_rectangle_corners,
          "different_weights": _different_weights, "different_out_hidden_size": _different_out_hidden_size,
          "bad_input_on_one_rank": _bad_input_on_one_rank, "encode_fails_on_one_rank": _encode_fails_on_one_rank}


def _worker(rank, world, port, outdir, backend):
    verdicts = {}
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        with torch.device(device):
            model = GlmVisionEncoder(VisionConfig.tiny())
        model = randomize_(model.cpu(), seed=0).to(device).eval()  # same weights on every rank
        runner = EncoderGraphRunner(model, BUDGETS, mode="cuda" if backend == "nccl" else "emulate",
                                    progress=False).capture()
        tol = 1e-5 if backend == "gloo" else GPU_TOL
        engines = {"runner": runner, "eager": model}
        for engine_name, engine in engines.items():
            dp = DataParallelEncoder(engine)
            for k, (name, grids) in enumerate(CASES.items()):
                if engine_name == "eager" and name not in ("mixed", "one_item", "empty"):
                    continue
                key = f"{engine_name}:{name}"
                try:
                    _check_case(dp, engine, model, grids, seed=k, tol=tol)
                    verdicts[key] = "ok"
                except Exception:
                    verdicts[key] = traceback.format_exc()
        dp = DataParallelEncoder(runner)
        for key, fn in [("mismatch", lambda: _mismatch_raises_everywhere(dp, model)),
                        ("after_mismatch", lambda: _check_case(dp, runner, model, CASES["two_items"], 9, tol)),
                        ("function", lambda: _check_function(runner, model, tol))]:
            try:
                fn()
                verdicts[key] = "ok"
            except Exception:
                verdicts[key] = traceback.format_exc()
        for name, fault in FAULTS.items():
            try:
                fault(runner, model, tol)
                verdicts[f"fault:{name}"] = "ok"
            except Exception:
                verdicts[f"fault:{name}"] = traceback.format_exc()
        verdicts.update(_bf16_verdicts(device, backend))
    except Exception:
        verdicts["setup"] = traceback.format_exc()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(verdicts, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_function(runner, model, tol):
    pixels, grids = random_batch(CASES["videos"], model.config, seed=3)
    outs = encode_data_parallel(runner, pixels.to(model.device), grids)
    with torch.inference_mode():
        torch.testing.assert_close(torch.cat(outs), model(pixels.to(model.device), grids), atol=tol, rtol=tol)


def _spawn(worker, world, outdir, *args, deadline_s=120):
    """Run ``worker(rank, world, port, outdir, *args)`` on ``world`` ranks and read each rank's JSON record; kill
    them all if they outlive ``deadline_s`` (a hang fails the test, it never waits for it)."""
    context = mp.spawn(worker, args=(world, free_port(), outdir, *args), nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            raise AssertionError(f"{world} ranks of {worker.__name__} still running after {deadline_s} s")
    return [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]


@pytest.fixture(scope="module")
def gloo_verdicts(tmp_path_factory):
    return {world: _spawn(_worker, world, str(tmp_path_factory.mktemp(f"dp_gloo_{world}")), "gloo")
            for world in (2, 3)}


VERDICT_KEYS = ([f"runner:{c}" for c in CASES] + [f"eager:{c}" for c in ("mixed", "one_item", "empty")]
                + ["mismatch", "after_mismatch", "function"] + [f"fault:{name}" for name in FAULTS]
                + [f"bf16:{e}:{c}" for e in ("runner", "eager") for c in BF16_CASES])


def _assert_verdicts(per_rank, key):
    for rank, verdicts in enumerate(per_rank):
        assert "setup" not in verdicts, f"rank {rank} failed to set up:\n{verdicts['setup']}"
        assert verdicts.get(key) == "ok", f"rank {rank}, case {key}:\n{verdicts.get(key, 'not run')}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("key", VERDICT_KEYS)
def test_gloo_data_parallel(gloo_verdicts, world, key):
    _assert_verdicts(gloo_verdicts[world], key)


@pytest.mark.multigpu
@pytest.mark.timeout(300)
def test_nccl_data_parallel_with_cuda_graphs(tmp_path_factory):
    per_rank = _spawn(_worker, 2, str(tmp_path_factory.mktemp("dp_nccl")), "nccl", deadline_s=280)
    for key in VERDICT_KEYS:
        _assert_verdicts(per_rank, key)


# ---------------------------------------------------------------------------------------------------------------
# A stuck rank: the collective timeout turns it into an error (gloo, 2 ranks, a 2 s timeout)
# ---------------------------------------------------------------------------------------------------------------
STUCK_TIMEOUT_S = 2


def _stuck_rank_worker(rank, world, port, outdir):
    record = {}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=STUCK_TIMEOUT_S))
        model = randomize_(GlmVisionEncoder(VisionConfig.tiny()), seed=0).eval()
        dp = DataParallelEncoder(model)
        request = _stream(model, 0)
        dp.run(*request)  # every rank is up and in step
        if rank == 1:  # rank 1 hangs inside its encode for longer than the timeout, then carries on
            forward = model.forward
            model.forward = lambda *a, **k: time.sleep(STUCK_TIMEOUT_S + 1) or forward(*a, **k)
        start = time.monotonic()
        try:
            dp.run(*request)
            record["error"] = None
        except CollectiveError as err:
            record["error"] = str(err)
        record["seconds"] = time.monotonic() - start
    except Exception:
        record["setup"] = traceback.format_exc()
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_a_stuck_rank_becomes_an_error_within_the_timeout(tmp_path):
    waiting, stuck = _spawn(_stuck_rank_worker, 2, str(tmp_path), deadline_s=60)
    assert "setup" not in waiting and "setup" not in stuck, waiting.get("setup") or stuck.get("setup")
    assert waiting["error"] and "rank 0: request 1: the status exchange did not complete" in waiting["error"]
    assert STUCK_TIMEOUT_S - 0.5 <= waiting["seconds"] <= STUCK_TIMEOUT_S + 3  # the timeout, plus a loaded CI's slack
    # the stuck rank, once awake, finds nobody in the exchange: an error too, not a hang and not an abort
    assert stuck["error"] and "rank 1: request 1: the status exchange did not complete" in stuck["error"]
    assert stuck["seconds"] <= 2 * STUCK_TIMEOUT_S + 1 + 3
