"""``python -m glmvit ncu`` on CPU: the parser on real Nsight Compute output, the limiter's rules, the grouping, and
the command's one-line errors. The fixture ``tests/data/ncu_raw_8x448.csv`` is ncu's ``--csv --page raw`` output of
one replay of eight 448² images on the H200 (the first launch of each kernel, the columns the parser reads)."""
from __future__ import annotations

import csv
import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmvit.cli.ncu import HIGH, METRICS, limiter, parse_raw_csv, print_report, run_ncu, summarise_kernels, top_stalls
from glmvit.profiling import categorise
from glmvit.records import NcuProfile, load

RAW = (Path(__file__).parent / "data" / "ncu_raw_8x448.csv").read_text()
RECORD = Path(__file__).parents[1] / "data" / "bench" / "ncu.json"


def fixture_rows() -> list[dict[str, str]]:
    """The fixture read by the csv module alone: the oracle the parser is checked against."""
    lines = [line for line in RAW.splitlines() if not line.startswith("==")]
    rows = list(csv.DictReader(lines))
    units = rows[0]  # the first row holds the units: the parser reads durations as ns and skips this row
    assert units[METRICS["duration_us"]] == "ns" and units["Kernel Name"] == ""
    return rows[1:]


def test_parser_reads_every_kernel_row_and_its_counters_as_the_csv_has_them():
    kernels, rows = parse_raw_csv(RAW), fixture_rows()
    assert [k["name"] for k in kernels] == [r["Kernel Name"] for r in rows]
    for kernel, row in zip(kernels, rows, strict=True):
        assert kernel["sms"] == 132  # an H200
        assert kernel["duration_us"] == pytest.approx(float(row[METRICS["duration_us"]].replace(",", "")) / 1e3)
        assert kernel["grid"] == float(row[METRICS["grid"]].replace(",", ""))
        assert "selected" not in kernel["stalls"] and "long_scoreboard" in kernel["stalls"]


def test_limiter_rules_on_the_recorded_kernels():
    """A tensor-core matmul, a bandwidth-bound elementwise kernel and the attention (neither, enough blocks)."""
    by_name = {k["name"]: k for k in parse_raw_csv(RAW)}
    gemm = next(k for n, k in by_name.items() if n.startswith("nvjet") and "192x192" in n)
    assert gemm["tensor_pct"] >= HIGH and limiter(gemm) == "tensor"
    silu = by_name["triton_poi_fused_mul_silu_split_2"]
    assert silu["dram_pct"] >= HIGH and limiter(silu) == "dram"
    attention = by_name["_rope_varlen_attention_kernel"]
    assert max(attention["dram_pct"], attention["tensor_pct"], attention["issue_pct"]) < HIGH
    assert attention["grid"] > attention["sms"] and limiter(attention) == "latency"


def test_too_few_blocks_is_parallelism_and_throughput_wins_over_it():
    quiet = {"dram_pct": 10.0, "tensor_pct": 10.0, "issue_pct": 10.0, "grid": 48.0, "sms": 132}
    assert limiter(quiet) == "parallelism"
    assert limiter({**quiet, "grid": 132.0}) == "latency"
    assert limiter({**quiet, "dram_pct": HIGH}) == "dram"  # a few blocks can still saturate DRAM
    assert limiter({**quiet, "dram_pct": 65.0, "tensor_pct": 90.0}) == "tensor"  # two over the line: the busiest


def test_a_counter_ncu_could_not_read_makes_the_limiter_unknown_not_latency():
    known = {"dram_pct": 10.0, "tensor_pct": 10.0, "issue_pct": 10.0, "grid": 200.0, "sms": 132}
    assert limiter(known) == "latency"
    for metric in ("dram_pct", "tensor_pct", "issue_pct", "grid"):
        assert limiter({**known, metric: float("nan")}) == "unknown", metric  # as parsed from "n/a"
        assert limiter({**known, metric: None}) == "unknown", metric  # as read back from the JSON record


def test_grouping_keeps_every_microsecond_and_weights_counters_by_time():
    kernels = parse_raw_csv(RAW)
    twice = kernels + [dict(k, duration_us=3 * k["duration_us"], dram_pct=0.0) for k in kernels]
    summary = summarise_kernels(twice)
    total = sum(k["duration_us"] for k in twice)
    assert summary["kernels"] == len(twice) and summary["gpu_us"] == pytest.approx(total)
    assert sum(summary["by_category_us"].values()) == pytest.approx(total)
    assert sum(summary["by_limiter_us"].values()) == pytest.approx(total)
    for group in summary["groups"]:
        one = next(k for k in kernels if k["name"] == group["name"])
        assert group["launches"] == 2 and group["category"] == categorise(one["name"])
        assert group["dram_pct"] == pytest.approx(one["dram_pct"] / 4)  # weights 1 and 3, the second at 0 %


def test_top_stalls_most_first():
    assert top_stalls({"wait": 1.0, "barrier": 5.0, "long_scoreboard": 3.0}) == ["barrier", "long_scoreboard"]


def test_an_empty_profile_is_a_one_line_error():
    with pytest.raises(ValueError, match="no kernel rows"):
        parse_raw_csv("==PROF== Disconnected from process 1\n")
    header_and_units = "\n".join(RAW.splitlines()[:2])  # ncu's two header lines and no kernel
    with pytest.raises(ValueError, match="no kernel rows"):
        parse_raw_csv(header_and_units)


def replace_duration_column(row: int, value: str) -> str:
    """The fixture with row ``row`` of the duration column (0: the units row) set to ``value``."""
    lines = [line for line in RAW.splitlines() if not line.startswith("==")]
    table = list(csv.reader(lines))
    table[row + 1][table[0].index(METRICS["duration_us"])] = value
    out = io.StringIO()
    csv.writer(out, quoting=csv.QUOTE_ALL).writerows(table)
    return out.getvalue()


def test_durations_are_read_in_the_unit_the_units_row_names():
    in_ns = parse_raw_csv(RAW)
    in_us = parse_raw_csv(replace_duration_column(0, "us"))
    assert [k["duration_us"] for k in in_us] == pytest.approx([k["duration_us"] * 1e3 for k in in_ns])
    with pytest.raises(ValueError, match="'cycle'"):
        parse_raw_csv(replace_duration_column(0, "cycle"))
    with pytest.raises(ValueError, match="no duration"):
        parse_raw_csv(replace_duration_column(1, "n/a"))


def test_one_kernel_at_two_launch_shapes_is_two_groups():
    """cuBLAS runs one kernel for several projections: their grids differ, so must their rows (and limiters)."""
    kernel = parse_raw_csv(RAW)[0]
    small = dict(kernel, grid=48.0, tensor_pct=5.0, dram_pct=5.0, issue_pct=5.0)
    groups = summarise_kernels([kernel, small, dict(kernel)])["groups"]
    assert sorted((g["grid"], g["launches"]) for g in groups) == sorted([(kernel["grid"], 2), (48.0, 1)])
    assert next(g for g in groups if g["grid"] == 48)["limiter"] == "parallelism"


def test_a_groups_launch_shape_is_the_launches_own_not_a_time_weighted_mean(capsys):
    """48 blocks weighted by these durations average to 48.00000000000001: the record must say 48."""
    kernel = dict(parse_raw_csv(RAW)[0], grid=48.0, registers=222.0)
    durations = [7.678, 6.943, 4.075]
    assert sum(48.0 * d for d in durations) / sum(durations) != 48.0  # the mean would not be exact
    (group,) = summarise_kernels([dict(kernel, duration_us=d) for d in durations])["groups"]
    assert (group["grid"], group["registers"], group["launches"]) == (48.0, 222.0, 3)
    unread = dict(kernel, grid=float("nan"))  # two n/a counts: one group, its grid unknown, and reported
    summary = summarise_kernels([dict(unread), dict(unread)])
    (group,) = summary["groups"]
    assert group["launches"] == 2 and math.isnan(group["grid"]) and group["limiter"] == "unknown"
    print_report({"layouts": {"1x224": summary}})
    assert "grid nan" in capsys.readouterr().out


def test_missing_columns_name_the_sections_to_collect():
    with pytest.raises(ValueError, match="SpeedOfLight"):
        parse_raw_csv('"ID","Kernel Name"\n"",""\n"0","k"\n')


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_command_refuses_a_machine_without_cuda_in_one_line():
    done = subprocess.run([sys.executable, "-m", "glmvit", "ncu"], capture_output=True, text=True)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_command_names_an_unknown_layout():
    done = subprocess.run([sys.executable, "-m", "glmvit", "ncu", "--layouts", "1x224,3x3"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "3x3" in done.stderr


def test_recorded_profile_adds_up():
    """The record: every layout's µs split by category and by limiter, each the sum of its groups."""
    record = load(RECORD, NcuProfile)
    assert set(record.layouts) == {"1x224", "8x448"}
    for entry in record.layouts.values():
        groups = entry["groups"]
        assert sum(g["launches"] for g in groups) == entry["kernels"]
        for split in ("by_category_us", "by_limiter_us"):
            assert math.isclose(sum(entry[split].values()), entry["gpu_us"], rel_tol=1e-9)
        assert all(g["limiter"] == limiter(g) for g in groups)


def fake_ncu(tmp_path: Path, body: str) -> str:
    """An executable standing in for ncu: ``body`` is its shell script (``$log`` is its --log-file argument)."""
    path = tmp_path / "ncu"
    path.write_text('#!/bin/sh\nlog=""\nwhile [ $# -gt 0 ]; do [ "$1" = --log-file ] && log="$2"; shift; done\n'
                    + body)
    path.chmod(0o755)
    return str(path)


def test_run_ncu_returns_what_ncu_wrote_to_its_log_file(tmp_path):
    fixture = Path(__file__).parent / "data" / "ncu_raw_8x448.csv"
    args = tmp_path / "args"
    ncu = fake_ncu(tmp_path, f'cp "{fixture}" "$log"\n')
    (tmp_path / "ncu").write_text((tmp_path / "ncu").read_text().replace('log=""', f'echo "$@" > "{args}"\nlog=""'))
    assert parse_raw_csv(run_ncu(ncu, "8x448")) == parse_raw_csv(RAW)
    called = args.read_text().split()
    for flag, value in (("--profile-from-start", "off"), ("--clock-control", "none"), ("--page", "raw"),
                        ("--target-processes", "application-only"), ("--target", "8x448")):
        assert called[called.index(flag) + 1] == value, flag
    assert called[called.index("--target") - 1] == "ncu"  # the child: python -m glmvit ncu --target 8x448


def test_run_ncu_failing_names_the_layout_and_ncus_last_line(tmp_path):
    ncu = fake_ncu(tmp_path, 'echo "==ERROR== ERR_NVGPUCTRPERM - no permission to the GPU counters" >&2\nexit 1\n')
    with pytest.raises(OSError, match="layout 1x224 exited with 1: ==ERROR== ERR_NVGPUCTRPERM"):
        run_ncu(ncu, "1x224")
