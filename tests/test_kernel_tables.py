"""The launch tables in glmvit.kernels against the sweep recorded on the H200 (data/bench/tune_h200.json, from
tools/tune_kernels.py): each choice within 10% of the fastest configuration measured for that layout, and the
decision to keep cuBLAS for every matmul backed by the split-K sweep."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from glmvit.config import VisionConfig
from glmvit.kernels.attention_table import CONFIGS, config_for
from glmvit.kernels.triton_attention_tma import TmaConfig
from glmvit.packing import SMALLEST_BUDGET
from glmvit.profiling import encoder_gemms

SWEEP = json.loads((Path(__file__).parents[1] / "data" / "bench" / "tune_h200.json").read_text())
TMA_AB = Path(__file__).parents[1] / "data" / "sweeps" / "tma_ab_h200.json"  # tools/tma_ab.py's record


def key(config) -> str:  # as tools/tune_kernels.py's attn_key
    return (f"{config.block_m}x{config.block_n}w{config.num_warps}s{config.num_stages}"
            + (f"k{config.split_k}" if config.split_k > 1 else "") + ("r" if config.prerotate else ""))


def worst_ratio(name: str, layouts: list[str]) -> float:
    """A configuration's slowest time over these layouts, as a multiple of each layout's fastest configuration."""
    entries = [SWEEP["attention"][layout] for layout in layouts]
    times = [(entry["configs"].get(name), entry["best_us"]) for entry in entries]
    return max(t / best if isinstance(t, float) else math.inf for t, best in times)


@pytest.mark.parametrize("rows", sorted({entry["rows"] for entry in SWEEP["attention"].values()}))
def test_attention_config_within_10_percent_of_the_best_one_configuration_can_do(rows):
    """The table is keyed by rows, so every layout of that many rows runs one configuration: the chosen one's worst
    ratio to each layout's fastest is within 10 % of the least worst ratio any measured configuration has."""
    if isinstance(config_for(rows), TmaConfig):
        pytest.skip("a Hopper-shaped configuration: the tune sweep does not time it, its A/B judges it "
                    "(test_a_hopper_entry_beats_the_readable_kernel_in_its_ab)")
    layouts = [layout for layout, entry in SWEEP["attention"].items() if entry["rows"] == rows]
    names = set.intersection(*(set(SWEEP["attention"][layout]["configs"]) for layout in layouts))
    least = min(worst_ratio(name, layouts) for name in names)
    assert worst_ratio(key(config_for(rows)), layouts) <= 1.10 * least, (rows, layouts, least)


def table_ranges() -> list[tuple[int, float, object]]:
    """Each launch-table entry with the rows it covers: (first row count, last, configuration)."""
    ranges, low = [], 1
    for limit, config in CONFIGS:
        high = math.inf if limit is None else limit
        ranges.append((low, high, config))
        low = int(high) + 1 if limit is not None else low
    return ranges


@pytest.mark.parametrize("entry", [k for k, (_, config) in enumerate(CONFIGS) if isinstance(config, TmaConfig)])
def test_a_hopper_entry_beats_the_readable_kernel_in_its_ab(entry):
    """An entry naming a TmaConfig is backed by tools/tma_ab.py's record: on every layout of the A/B within the
    entry's rows (at least one), its path (rotation launch + attention) is faster than the readable kernel's best
    long-segment configuration and within 10 % of the fastest Hopper-shaped configuration there."""
    low, high, config = table_ranges()[entry]
    assert TMA_AB.exists(), f"{config.name} in the table but no A/B record at {TMA_AB}"
    ab = json.loads(TMA_AB.read_text())
    layouts = [layout for layout in ab["layouts"].values() if low <= layout["rows"] <= high]
    assert layouts, f"no layout of {low}..{high} rows in the A/B for {config.name}"
    for layout in layouts:
        paths = layout["paths"]
        ours, baseline = paths[f"tma@{config.name}"], paths[ab["baseline"]]
        assert ours["ok"] and ours["us"] < baseline["us"], (layout["rows"], ours, baseline)
        best = min(row["us"] for path, row in paths.items()
                   if path.startswith("tma@") and "/" not in path and row.get("ok"))
        assert ours["us"] <= 1.10 * best, (layout["rows"], ours["us"], best)


def ladder_shapes() -> set[tuple[int, int, int]]:
    """Every (M, K, N) the encoder runs at the default budgets (``packing.SMALLEST_BUDGET`` tokens and up) that the
    sweep's rows (64, 256, 1024) can meet: block matmuls from 256 rows, merger matmuls from 64 tokens."""
    config = VisionConfig.glm41v()
    smallest = SMALLEST_BUDGET * config.merge_area  # 256 rows
    return {(m, k, n) for rows in (smallest, 4 * smallest, 16 * smallest)
            for _, m, k, n, _ in encoder_gemms(config, rows)}


def test_cublas_stays_for_every_matmul_of_the_default_budgets_the_split_k_kernel_does_not_beat_by_10_percent():
    """glmvit keeps cuBLAS for all matmuls: on every shape the default budgets run, the split-K kernel never wins
    by a margin worth a second code path. Shapes only budgets below the default ladder run (block matmuls at 64
    rows) are timed too and left to cuBLAS; the kernel is checked correct on every shape."""
    swept_rows = {row["m"] for row in SWEEP["gemm"]}
    shapes = {shape for shape in ladder_shapes() if shape[0] in swept_rows}
    timed = [row for row in SWEEP["gemm"] if (row["m"], row["k"], row["n"]) in shapes]
    assert {(row["m"], row["k"], row["n"]) for row in timed} == shapes  # the sweep timed every one of them
    for row in timed:
        assert row["best_us"] >= 0.9 * row["cublas_us"], row
    for row in SWEEP["gemm"]:
        best = row["configs"][row["best"]]
        # randn inputs: outputs ~ N(0, K), |y| ≲ 5√K; two bf16 roundings of such values differ by ≤ 2⁻⁷·5√K
        assert best["max_abs_err"] <= 2**-7 * 5 * math.sqrt(row["k"])  # the kernel is correct, only slower


SWEEPS = Path(__file__).resolve().parent.parent / "data" / "sweeps"
ATTENTION_SWEEP = SWEEPS / "attention_sweep_h200.json"
FA4_SWEEP = SWEEPS / "attention_sweep_h100.json"  # the sweep that timed the fa4 backend


def test_auto_attention_picks_the_faster_kernel_on_every_swept_layout():
    """For every layout of the H200 sweep, the kernel ``auto`` runs for its rows without FlashAttention-4 is within
    5 % of the faster of ``triton`` and ``cudnn`` (each with the rotation, as the model runs them)."""
    from glmvit.kernels.attention_table import attention_for

    record = json.loads(ATTENTION_SWEEP.read_text())
    kernels = ("triton", "cudnn")
    assert record["provenance"]["gpu"] and all("us" in record["layouts"]["8x1024"]["paths"][k] for k in kernels)
    worse = {}
    for name, layout in record["layouts"].items():
        times = {k: layout["paths"][k]["us"] for k in kernels}
        assert all(layout["paths"][k]["ok"] for k in times), name
        chosen = times[attention_for(layout["rows"], False)]
        if chosen > 1.05 * min(times.values()):
            worse[name] = times
    assert not worse, worse


def test_auto_attention_with_fa4_is_never_slower_than_without_and_fa4_runs_where_it_wins():
    """Where FlashAttention-4 runs, on every layout of the sweep that timed it: ``auto``'s kernel is no slower than
    the one it runs without FlashAttention-4, and where it picks ``fa4``, that is within 5 % of the fastest of the
    three (each with the rotation, as the model runs them)."""
    from glmvit.kernels.attention_table import attention_for
    from glmvit.kernels.fa4_table import FA4_MIN_ROWS

    record = json.loads(FA4_SWEEP.read_text())
    assert record["provenance"]["gpu"] and FA4_MIN_ROWS is not None
    kernels = ("triton", "cudnn", "fa4")
    picked = []
    for name, layout in record["layouts"].items():
        times = {k: layout["paths"][k]["us"] for k in kernels}
        assert all(layout["paths"][k]["ok"] for k in times), name
        with_fa4, without = attention_for(layout["rows"], True), attention_for(layout["rows"], False)
        assert times[with_fa4] <= times[without], (name, times)
        if with_fa4 == "fa4":
            picked.append(name)
            assert times["fa4"] <= 1.05 * min(times.values()), (name, times)
    assert picked, "the rule runs fa4 on no swept layout"


FUSED = {  # fused_gemm_table's rules: (threshold name, configuration function, A/B records, read together)
    "swiglu": ("SWIGLU_MIN_ROWS", "swiglu_config", ("swiglu_ab_h100.json",)),  # the A/B that timed both layouts
    "qkv_rope": ("QKV_ROPE_MIN_ROWS", "qkv_rope_config",  # two heads a tile, then the row counts between
                 ("qkv_rope_ab_h100.json", "qkv_rope_ab_rows_h100.json")),
}


def _fused_rules() -> list[str]:
    from glmvit.kernels import fused_gemm_table

    return [name for name, (threshold, _, _) in FUSED.items() if getattr(fused_gemm_table, threshold) is not None]


@pytest.mark.parametrize("rule", _fused_rules())
def test_a_fused_gemm_threshold_is_where_its_ab_says_the_fused_kernel_wins(rule):
    """A fused GEMM switched on from MIN_ROWS rows is backed by its A/B record: at every row count of the A/B from
    MIN_ROWS on, the configuration the table picks is faster than both unfused paths (eager torch and compiled, the
    modes it replaces), and below MIN_ROWS it does not win by more than 2 % (the threshold leaves no clear win); and
    MIN_ROWS is no smaller than the smallest row count the A/B measured (no row count is switched on unmeasured)."""
    from glmvit.kernels import fused_gemm_table

    threshold, config_fn, records = FUSED[rule]
    results = []
    for name in records:
        path = Path(__file__).parents[1] / "data" / "sweeps" / name
        assert path.exists(), f"{rule} is switched on but its A/B record {path} is missing"
        results += json.loads(path.read_text())["results"]
    min_rows = getattr(fused_gemm_table, threshold)
    assert min_rows >= min(result["rows"] for result in results), (rule, min_rows)
    for result in results:
        paths, rows = result["paths"], result["rows"]
        fused = paths[f"triton@{_fused_config(rule, rows, packed=False).name}"]
        unfused = min(paths["torch"]["us"], paths["compiled"]["us"])
        assert fused["ok"], (rows, fused)
        if rows >= min_rows:
            assert fused["us"] < unfused, (rule, rows, fused["us"], unfused)
        else:
            assert fused["us"] >= 0.98 * unfused, (rule, rows, fused["us"], unfused)


def _fused_config(rule, rows, packed):
    """The configuration the table picks for ``rows`` rows (SwiGLU: for a weight in the ``packed`` layout or not)."""
    from glmvit.kernels import fused_gemm_table

    config_fn = getattr(fused_gemm_table, FUSED[rule][1])
    return config_fn(rows, packed) if rule == "swiglu" else config_fn(rows)


def test_the_packed_swiglu_configurations_the_model_runs_win_in_their_ab():
    """For a weight packed in tiles (glmvit.gate_up) the table picks the packed twins of the plain configurations: the
    same tiles and grid, packed=True, BLOCK_N = PACK_TILE (the tile the weight is packed in). The A/B record times
    them, and they win where the plain ones are checked to win above; one the record never timed fails."""
    from glmvit.kernels import fused_gemm_table

    record = json.loads((Path(__file__).parents[1] / "data" / "sweeps" / FUSED["swiglu"][2][0]).read_text())["results"]
    for rows in (fused_gemm_table.SWIGLU_MIN_ROWS, fused_gemm_table.SWIGLU_PERSISTENT_MIN_ROWS):
        plain, packed = _fused_config("swiglu", rows, False), _fused_config("swiglu", rows, True)
        assert not plain.packed and packed.packed and packed.block_n == fused_gemm_table.PACK_TILE
        assert packed == dataclasses.replace(plain, packed=True)
    pending = []
    for result in record:
        if result["rows"] < fused_gemm_table.SWIGLU_MIN_ROWS:
            continue
        packed = _fused_config("swiglu", result["rows"], True)
        timed = result["paths"].get(f"triton@{packed.name}")
        if timed is None:
            pending.append(f"{packed.name} at {result['rows']} rows")
            continue
        unfused = min(result["paths"]["torch"]["us"], result["paths"]["compiled"]["us"])
        assert timed["ok"] and timed["us"] < unfused, (result["rows"], timed, unfused)
    assert not pending, f"the model runs packed SwiGLU configurations its A/B never timed: {', '.join(pending)}"


@pytest.fixture
def capabilities(monkeypatch):
    """cuda:0 an sm_89 GPU, cuda:1 an sm_90 one, cuda:2 an sm_120 one (consumer Blackwell: 99 KiB of shared memory
    a block), as fused_gemm_table asks the driver; the queries it makes."""
    import torch

    from glmvit.kernels import fused_gemm_table

    asked: list[int] = []

    def capability(index):
        asked.append(index)
        return {0: (8, 9), 1: (9, 0), 2: (12, 0)}[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    fused_gemm_table._capability.cache_clear()
    yield asked
    fused_gemm_table._capability.cache_clear()


def test_the_fused_gemms_run_only_on_hopper(capabilities, monkeypatch):
    """The fused GEMMs were tuned and measured on the H200 (sm_90): an older GPU, and a newer one whose blocks get
    less shared memory than their configurations stage, keep the unfused path at every row count; the driver is
    asked once per device, not per block."""
    import torch

    from glmvit.kernels import fused_gemm_table

    monkeypatch.setattr(fused_gemm_table, "QKV_ROPE_MIN_ROWS", 256)
    ada, hopper, blackwell = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)
    for fused in (fused_gemm_table.swiglu_fused, fused_gemm_table.qkv_rope_fused):
        assert not fused(8192, ada) and fused(256, hopper) and fused(8192, hopper) and not fused(255, hopper)
        assert not fused(8192, blackwell)
    assert sorted(capabilities) == [0, 1, 2]
    configs = {fused_gemm_table.swiglu_config(rows, packed) for packed in (False, True)
               for rows in (fused_gemm_table.SWIGLU_MIN_ROWS, fused_gemm_table.SWIGLU_PERSISTENT_MIN_ROWS)}
    assert len(configs) == 4
    assert min(config.shared_bytes() for config in configs) > 99 * 1024  # why sm_12x is left out


def test_the_hopper_gate_compiles_to_a_constant(capabilities):
    """Under torch.compile the gate is decided once, outside the graph: no break, no driver query traced."""
    import torch

    from glmvit.kernels import fused_gemm_table

    def forward(x):
        return x + 1 if fused_gemm_table.swiglu_fused(x.shape[0], torch.device("cuda", 1)) else x - 1

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(256, 2)), torch.ones(256, 2))
    assert torch.equal(compiled(torch.zeros(16, 2)), -torch.ones(16, 2))

    def marked():
        pass

    torch.compiler.assume_constant_result(marked)  # the mark, set without importing dynamo at import time
    assert vars(marked) and all(getattr(fused_gemm_table.measured_gpu, k, None) == v for k, v in vars(marked).items())


UNIFORM_AB = Path(__file__).resolve().parent.parent / "data" / "sweeps" / "uniform_ab_h200.json"  # tools/uniform_ab.py


@pytest.mark.skipif(not UNIFORM_AB.exists(), reason="tools/uniform_ab.py has not been recorded on the H200 yet")
def test_uniform_graphs_are_captured_where_their_ab_says_they_pay():
    """glmvit.uniform.DENSE_MIN_ROWS against the whole-runner A/B (graph-compiled, one-length layouts, every budget
    given uniform graphs): from that many rows the uniform runner is no slower than 2 % (the A/B's medians'
    noise), below it the rule gives up at most 5 % (what a uniform graph there would have saved)."""
    from glmvit.uniform import DENSE_MIN_ROWS

    record = json.loads(UNIFORM_AB.read_text())
    assert record["provenance"]["gpu"]
    compiled = [r for r in record["results"].values() if r["mode"] == "graph-compiled"]
    assert compiled and all(r["uniform_replays"] == r["replays"] for r in compiled)
    wrong = {}
    for r in compiled:
        rows = sum(t * h * w for t, h, w in r["grids"])
        ratio = r["uniform_ms"] / r["plain_ms"]
        if (rows >= DENSE_MIN_ROWS and ratio > 1.02) or (rows < DENSE_MIN_ROWS and ratio < 0.95):
            wrong[r["layout"]] = (rows, round(ratio, 3))
    assert not wrong, f"uniform/plain per layout where the rule disagrees (rows, ratio): {wrong}"
