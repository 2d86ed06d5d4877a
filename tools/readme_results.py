"""The README's GPU results, written from data/bench/*.json (never typed by hand).

    python tools/readme_results.py          # rewrite the block between the README's results markers
    python tools/readme_results.py --check  # exit 1 if the README differs from what the JSON says

tests/test_project.py runs the check, so a re-recorded result and the README cannot drift apart.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glmvit.cli.bench_serve import rate_label  # noqa: E402 - the repository's own package, by path
from glmvit.eager_agreement import eager_timings  # noqa: E402 - the repository's own package, by path
from glmvit.peer_check import compiled_peer_gain, compiled_peer_ran_compiled  # noqa: E402 - the package, by path
from glmvit.records import (  # noqa: E402 - the repository's own package, by path
    BenchRecord,
    InterpRecord,
    KernelsProfile,
    LatencySweep,
    NcuProfile,
    Record,
    ServeRecord,
    StartupRecord,
    changed_summary,
    load,
    load_any,
    staleness,
)

BENCH = ROOT / "data" / "bench"
BEGIN, END = "<!-- results:begin (tools/readme_results.py) -->", "<!-- results:end -->"
FIXED = {"img1x224": "1×224²", "img4x224": "4×224²", "video8x224": "224² clip, 8 frames",
         "video2x8x224": "two 8-frame 224² clips", "img8x448": "8×448²"}
MIXED = {"mixed_img": "mixed-img", "mixed_av": "mixed-av"}
MODES = ("transformers", "eager", "graph", "graph-compiled")
PEERS = ("transformers", "transformers-compiled", "eager", "graph", "graph-compiled")  # every mode a record may hold


def gpu(full: bool = False) -> str:
    """The one GPU every result record in data/bench names in its provenance (``H100 80GB HBM3``; ``full``: as
    named, ``NVIDIA H100 80GB HBM3``). Raises ValueError naming them if the results are several GPUs' (a record run
    on another GPU re-records them all: ``glmvit.cli.record.gpu_problem``); the ncu diagnostic names its own."""
    gpus = {r.provenance.gpu for r in (load_any(p) for p in sorted(BENCH.glob("*.json")))
            if r.kind not in ("ncu", "tune")}
    if len(gpus) != 1 or None in gpus:
        raise ValueError(f"data/bench: the results name {sorted(map(str, gpus))}, not one GPU: re-record them all")
    (name,) = gpus
    return name if full else name.removeprefix("NVIDIA ")


def bench(name: str) -> BenchRecord:
    return load(BENCH / f"{name}.json", BenchRecord)


def mark(record: Record) -> str:
    """`` (stale: …)`` after a record whose code has changed since it was made; nothing for a current one."""
    changed = staleness(record)
    if not changed:
        return ""
    return " ⚠ stale: " + ("recorded before fingerprints" if changed == ["no fingerprint"] else
                           changed_summary(changed) + " changed since")


def ms(x: float) -> str:
    return f"{x:.3g} ms" if x < 100 else f"{x:.0f} ms"


def median_cell(mode: dict) -> str:
    """A mode's median, its 95 % interval as ±%, and how many requests it timed."""
    timed = mode.get("timed_requests", mode["requests"])
    if not mode.get("median_ci95_ms"):
        return f"{ms(mode['median_ms'])} ({timed})"
    lo, hi = mode["median_ci95_ms"]
    return f"{ms(mode['median_ms'])} ±{(hi - lo) / 2 / mode['median_ms']:.1%} ({timed})"


def fixed_table() -> list[str]:
    rows = ["| workload (JSON) | " + " | ".join(PEERS) + " | graph-compiled P99 | floor | compiled time ÷ floor | "
            "transformers-compiled ÷ graph-compiled |", "|---|" + "---|" * (len(PEERS) + 4)]
    for name, label in FIXED.items():
        run = bench(name)
        m = {k: v.model_dump() for k, v in run.modes.items()}
        gc = m["graph-compiled"]
        peer = f"{m['transformers-compiled']['median_ms'] / gc['median_ms']:.2f}×" if "transformers-compiled" in m \
            else "–"
        if not compiled_peer_ran_compiled(run):  # a ratio to a peer that ran as if uncompiled is not glmvit's
            peer = f"– (the compiled peer took {compiled_peer_gain(run):.2f}× transformers' time: not compiled)"
        rows.append(f"| {label} (`{name}.json` @ {run.provenance.short_commit}, "
                    f"{run.workload['requests']} requests{mark(run)}) | "
                    + " | ".join(median_cell(m[k]) if k in m else "–" for k in PEERS)
                    + f" | {ms(gc['p99_ms'])} | {ms(run.floor['mean_ms'])} | {gc['vs_floor_median']:.1f}× | {peer} |")
    return rows


def mixed_table() -> list[str]:
    rows = ["| workload | mode | mean | median | P99 | slower than eager | worst / eager | padding | batches routed to "
            "eager | cost model |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in MIXED.items():
        run = bench(name)
        prediction = run.prediction or {}
        for mode in MODES:
            r = run.modes[mode].model_dump()
            vs = r["vs_eager_per_request"]
            pad = f"{r['runner']['padding_fraction']:.1%}" if "runner" in r else ""
            routed = ""
            if "runner" in r:
                runner = r["runner"]
                batches = runner["replays"] + runner["eager_batches"]
                routed = f"{runner['routed_eager']} of {batches}" if "routed_eager" in runner else "(no routing)"
            model = f"{prediction[mode]['error']:+.1%}" if mode in prediction else ""
            rows.append(f"| {label} (@ {run.provenance.short_commit}, {run.workload['requests']} requests, "
                        f"{run.settings.attn_backend}{mark(run)}) | {mode} | {ms(r['mean_ms'])} | "
                        f"{ms(r['median_ms'])} | {ms(r['p99_ms'])} | {vs['share_slower']:.0%} | "
                        f"{vs['worst_ratio']:.2f} | {pad} | {routed} | {model} |")
    return rows


def sweep_line() -> str:
    sweep = load(BENCH / "latency.json", LatencySweep)
    times = [{x.name: x.graph_ms for x in b.layouts} for b in sweep.budgets]
    alone = [t["one-small"] / t["many-small"] for t in times if "many-small" in t]
    single = max(t["full"] / t["one-small"] for t in times if "one-small" in t)
    return (f"A replay costs its budget, not its batch: over {len(alone)} budgets, one 224² image alone replays in "
            f"{min(alone):.2f}–{max(alone):.2f}× the time of the same budget filled with small images (as many as fit, "
            f"up to sixteen), so a padded row "
            f"costs what a real one does. Only attention changes with the layout: one image filling the budget (a "
            f"single long segment) is the slowest, up to {single:.1f}× one small image "
            f"(`latency.json` @ {sweep.provenance.short_commit}{mark(sweep)}).")


def kernels_lines() -> list[str]:
    """Where a compiled replay's GPU time goes (``kernels.json``) and how long a start takes
    (``capture.json``: regional compile, the default)."""
    record = load(BENCH / "kernels.json", KernelsProfile)
    run = record.model_dump()
    lines = ["**Kernels** (`python -m glmvit kernels`, `kernels.json` @ "
             f"{record.provenance.short_commit}{mark(record)}; GPU time of one replay, triton attention, compiled in "
             "regions as by default, by kernel category, and each kind against its roofline at the rates measured in "
             "the same run):", "",
             "| layout | GPU time | kernels | matmuls (roofline) | attention (roofline) | fused elementwise |",
             "|---|---|---|---|---|---|"]
    for layout, p in run["profile"]["triton-compiled"].items():
        if layout == "capture":
            continue
        gemm = run["gemm"][layout]
        gemm_roof = sum(r["roofline_us"] * r["count"] for r in gemm)
        attn = run["attention"][layout]
        cats = p["by_category_us"]
        depth = gemm[1]["count"]
        lines.append(f"| {layout} | {p['gpu_us_per_call']:.0f} µs | {p['kernels_per_call']:.0f} | "
                     f"{cats.get('gemm', 0):.0f} µs ({gemm_roof:.0f} µs) | {cats.get('attention', 0):.0f} µs "
                     f"({attn['roofline_us'] * depth:.0f} µs) | {cats.get('fused elementwise', 0):.0f} µs |")
    data = load(BENCH / "capture.json", StartupRecord)
    runs = {k: v for k, v in data.runs.items() if k.endswith(("auto-cold", "auto-warm"))}
    cold = next(v["capture_s"] for k, v in runs.items() if k.endswith("cold"))
    warm = next(v["capture_s"] for k, v in runs.items() if k.endswith("warm"))
    lines += ["", f"Compile + capture of the default ladder of {len(data.budgets)} budgets in a fresh process, "
              f"compiled in regions as by default: {cold:.1f} s cold (a record run's first process, on empty compile "
              f"caches), {warm:.1f} s warm (its next process, on the caches the first filled) "
              f"(`capture.json`{mark(data)})."]
    return lines


def ncu_line() -> str:
    """What limits each kernel of a replay (``ncu.json``): its time by limiter, and the attention's counters."""
    record = load(BENCH / "ncu.json", NcuProfile)
    parts = []
    for layout, entry in record.layouts.items():
        shares = sorted(((us / entry["gpu_us"], name) for name, us in entry["by_limiter_us"].items()), reverse=True)
        attn = next(g for g in entry["groups"] if g["name"] == "_rope_varlen_attention_kernel")
        parts.append(f"{layout}: " + ", ".join(f"{name} {share:.0%}" for share, name in shares if share >= 0.01)
                     + f" (the attention: {attn['limiter']}, {attn['grid']:.0f} blocks on {attn['sms']} SMs, tensor "
                     f"pipe {attn['tensor_pct']:.0f} %)")
    return ("**What limits each kernel** (`python -m glmvit ncu`, Nsight Compute's counters for every kernel of one "
            f"graph-compiled replay on an {record.provenance.gpu}, `ncu.json` @ {record.provenance.short_commit}"
            f"{mark(record)}; kernel time by "
            "limiter — the busiest of dram, tensor and issue at ≥ 60 % of peak, else parallelism with fewer blocks "
            "than SMs, else latency): " + "; ".join(parts) + ". Notebook 10 section 7 reads it.")


def interp_line() -> str:
    run = load(BENCH / "interp.json", InterpRecord)
    us = [r["median_us"]["triton"] for r in run.results]
    per_item = [r["speedup"]["per_item"] for r in run.results]
    return (f"The Triton interpolation kernel: {min(us):.0f}–{max(us):.0f} µs per single call (launch included) for "
            f"{len(us)} batch shapes, {min(per_item):.0f}–{max(per_item):.0f}× a per-item `grid_sample` loop "
            f"(`interp.json`{mark(run)}).")


def host_line() -> str:
    """What the host adds to one small request: the benchmark's wall time against the graph's time on the device."""
    run, kernels = bench("img1x224"), load(BENCH / "kernels.json", KernelsProfile)
    wall = run.modes["graph-compiled"].median_ms
    replay = kernels.profile["triton-compiled"]["1x224"]
    busy, device = replay["graph_gpu_us_per_call"] / 1e3, replay["replay_device"]["median_ms"]
    runner = run.modes["graph-compiled"].runner
    host = runner["host_s"] / runner["runs"] * 1e3
    return (f"One 224² image, graph-compiled: {ms(wall)} wall per request (`img1x224.json`, median), of which "
            f"`runner.run` spends {host:.3f} ms of host time before its one wait. Its kernels sum to {ms(busy)} under "
            f"the profiler and its replays, timed back to back, take {ms(device)} (`kernels.json` @ "
            f"{kernels.provenance.short_commit}{mark(kernels)}); the "
            f"difference is idle time between kernels or the unprofiled replays' slower clock: `tools/gap_probe.py` "
            f"tells the two apart, profiling a replay's own idle time and reading the SM clock beside it.")


def seed_lines() -> list[str]:
    """The seed PR's published numbers (data/seed_pr40576.json) beside glmvit's in the PR's own configuration."""
    import json

    seed = json.loads((ROOT / "data" / "seed_pr40576.json").read_text())
    lines = ["**The seed's configuration** (vLLM PR 40576: budgets 128…2048, 4 items, 32 frames; mean and P99 ms per "
             "request; the PR measured vLLM on RTX 4090s, glmvit is measured here on the " + gpu() + " — compare the "
             "ratios, "
             "and see notebook 08 for why they differ):", "",
             "| workload | PR eager → graph (RTX 4090) | glmvit eager | glmvit graph | glmvit graph-compiled "
             "| padding |",
             "|---|---|---|---|---|---|"]
    pr_rows = seed["encoder_forward_ms"]
    for name, pr in (("seed_img1x224", pr_rows[0]), ("seed_video8x224", pr_rows[2])):
        run = bench(name)
        m = run.modes
        pad = m["graph"].runner["padding_fraction"]
        cells = [f"{ms(m[k].mean_ms)} ({ms(m[k].p99_ms)})" for k in ("eager", "graph", "graph-compiled")]
        lines.append(f"| {pr['workload']} (`{name}.json` @ {run.provenance.short_commit}{mark(run)}) | "
                     f"{pr['eager']['mean_ms']} → {pr['graph']['mean_ms']} ms ({pr['eager']['p99_ms']} → "
                     f"{pr['graph']['p99_ms']}) | " + " | ".join(cells) + f" | {pad:.0%} |")
    return lines


# every bench-serve job's record
SERVE_RECORDS = ("serve_video8x224", "serve_video8x224_one_process", "serve_video8x224_rows_host",
                 "serve_video8x224_in_process", "serve_video8x224_in_process_ragged", "serve_video8x224_sweep",
                 "serve_mixed_av")


def serve_label(settings: dict[str, Any]) -> str:
    """What sets a serve record's server apart from the default one, as its rows' label says it."""
    batching = settings.get("batching") or {}
    uniform = batching.get("uniform_lengths") or []
    ragged = ", *no uniform graphs*" if batching.get("uniform_graphs") == "off" else ""
    if settings.get("target") == "in-process":
        return ", *in process*" + ragged
    return (", *one process*" if batching.get("api_servers") == 1 else "") + (
        ", *rows on host*" if batching.get("rows") == "host" else "") + ragged + (
        f", *uniform {','.join(map(str, uniform))}*" if batching.get("uniform_graphs") == "given" else "")


def serve_lines() -> list[str]:
    """The served encoder under load (``python -m glmvit bench-serve``): the seed's serve workload, and rate sweeps."""
    lines = ["**Served under load** (the record run's serve jobs: `bench-serve`'s load against the server `--spawn` "
             "would start, its HTTP side in the default API servers, except the row marked *one process* "
             "(`--api-servers 1`), its pixel rows made on the GPU, except the row marked *rows on host* "
             "(`--rows host`: the decode processes make them), its graph modes with uniform graphs for the workload's "
             "segment lengths (`--uniform-graphs auto`, as `bench`: batches of one segment length take the dense "
             "attention), except the row marked *no uniform graphs* (`--uniform-graphs off`: every batch in its "
             "budget's ragged graph); *once full*: at rate inf, the items/s between the 10th and the 90th percentile "
             "of the answers' times, the pipeline's fill and drain left out (`glmvit.timing.steady_rate`), as a "
             "share of the floor rate; one "
             f"{gpu()}, over HTTP on loopback, except the row marked *in process*: the scheduler driven in the "
             "record's "
             "process, no HTTP; time to embedding from request sent to answer read):", "",
             "| workload | mode | rate sent, req/s (share of saturation) | req/s | items/s | of floor rate | "
             "once full | TTE median (P99) | queue median | items per batch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SERVE_RECORDS:
        if not (BENCH / f"{name}.json").exists():
            lines.append(f"| `{name}.json`: not recorded yet (python -m glmvit record --only {name}) "
                         "| | | | | | | | | |")
            continue
        record = load(BENCH / f"{name}.json", ServeRecord)
        where = serve_label(record.settings)
        for r in record.runs:
            floor = f"{r['vs_floor']:.0%}" if r.get("vs_floor") else ""
            # the rate once the pipeline is full (glmvit.timing.steady_rate); only a run at rate inf fills it
            full = f"{r['steady_vs_floor']:.0%}" if r.get("steady_vs_floor") and r["request_rate"] == "inf" else ""
            lines.append(f"| {record.settings['workload']}{where} (`{name}.json` @ "
                         f"{record.provenance.short_commit}{mark(record)}) | {r['mode']} | {rate_label(r)} | "
                         f"{r['requests_per_s']:.1f} | "
                         f"{r['items_per_s']:.1f} | {floor} | {full} | "
                         f"{ms(r['tte_ms']['median'])} ({ms(r['tte_ms']['p99'])}) | "
                         f"{ms(r['queue_ms']['median'])} | {r['server']['items_per_batch']:.1f} |")
    return lines


def eager_line() -> str:
    """How far the records of this run that time one eager forward agree (:mod:`glmvit.eager_agreement`): every
    "× eager" divides by a host-bound time. Medians, then P10s (the forward at the host's full speed), then what
    the committed probe says of the host."""
    timings = eager_timings(BENCH)
    parts = [f"{t.forward}: " + ", ".join(f"{ms(v)} (`{n}`)" for n, v in t.medians.items()) + f", {t.spread:.2f}× apart"
             for t in timings]
    fast = [f"{t.forward}: " + ", ".join(ms(v) for v in t.fast.values()) + f", {t.fast_spread:.2f}× apart"
            for t in timings if len(t.fast) > 1]
    probe = json.loads((ROOT / "data" / "sweeps" / "eager_probe_h200.json").read_text())["summary"]
    return ("**Eager is the host's speed.** An eager forward of a small batch is bound by its kernel launches, and the "
            "records of one run that time the same eager forward give, as medians: " + "; ".join(parts) + ". At the "
            "host's full speed (each benchmark record's P10 over all its requests) they give " + "; ".join(fast) +
            ". The record machines' CPUs change speed within seconds: on the H200's, "
            "`data/sweeps/eager_probe_h200.json` times host "
            "work with no GPU in it beside each forward, and it slows in step with the forward (correlation "
            f"{probe['corr_wall_host']:.2f}). So a median carries the share of its requests the host ran slow, and "
            "every ratio to eager in these tables with it; the graph modes' medians do not.")


def runs_line() -> str:
    """Which record runs the results below come from: one for the results, and the diagnostics' own."""
    results = sorted({r.record_run or "(none)" for r in (load_any(p) for p in sorted(BENCH.glob("*.json")))
                      if r.kind not in ("ncu", "tune")})
    ncu = load(BENCH / "ncu.json", NcuProfile)
    return (f"Every result below comes from record run{'s' if len(results) > 1 else ''} {', '.join(results)} "
            "(`python -m glmvit record`: a process for the timings, then one for the profiles); the Nsight "
            f"Compute counters are a diagnostic recorded on request, in run {ncu.record_run or '(none)'}.")


def block() -> str:
    prov = bench("mixed_img").provenance
    head = (f"Recorded on an {gpu(full=True)} (driver {prov.driver}, torch {prov.torch}, triton {prov.triton}, "
            f"transformers {prov.transformers}); each JSON names its commit and command. A row marked ⚠ stale was "
            "measured on code that has changed since (`python -m glmvit records` lists them). " + runs_line())
    mixed = ("**Mixed workloads** (vLLM random-mm style, requests in arrival order; cost model = predicted mean / "
             "measured − 1):")
    return "\n".join([BEGIN, head, "", "**Fixed workloads** (median per request ± half its 95 % interval, and the "
                      "requests timed; every peer of the same run; transformers-compiled is `torch.compile(mode="
                      "\"reduce-overhead\")` on transformers' model, compiled once for the workload's one shape):", "",
                      *fixed_table(), "", eager_line(), "", host_line(), "", *kernels_lines(), "", ncu_line(), "",
                      mixed, "", *mixed_table(), "", sweep_line(), "", *seed_lines(), "", *serve_lines(), "",
                      interp_line(), END])


def render(readme: str) -> str:
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + block() + readme[end:]


def main(argv: list[str]) -> int:
    path = ROOT / "README.md"
    text = path.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print("README.md's results differ from data/bench: run python tools/readme_results.py")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
