"""How fast can ``glmvit serve``'s HTTP path feed an engine? The server's own work, measured with the GPU taken out.

``glmvit serve`` runs as it always does (its API server processes, decode workers, shared-memory frames, scheduler,
answers), except that the encoder is a stand-in: :class:`StandInEncoder` sleeps ``--engine-ms-per-item`` × items +
``--engine-ms-per-batch`` per batch (the GIL let go, as a thread waiting on a CUDA event does) and returns zero
outputs of each item's true shape and the model's dtype, so that every answer is as large as the real one (256 ×
4096 bf16 values for an 8-frame 224² clip); ``--engine-us-per-token`` adds a time per output token (items of mixed
sizes), ``--engine-host-ops`` tiny torch calls per batch before the sleep (a launch's host work, timed under the
load), ``--sample-engine`` where the engine process's threads stand. The load is ``python -m glmvit bench-serve
--url`` in its own process, at its defaults (encoded media, rate inf). With a zero engine time the items per second
are the host path's ceiling on this machine; with the engine time of a record (``--engine-ms-per-item 2.96``: the
in-process record's busy time per clip) they say whether the host keeps that engine fed.

CPU seconds are read from ``/proc`` for every process of the server's tree and for the load generator, every 20 ms,
over the window in which the server is under load (:func:`load_window`: the client's start-up imports and its
report left out), its warm-up requests included, and reported per role and per item:

- ``engine``: the process holding the scheduler (with ``--api-servers 1`` it also reads the bodies);
- ``api servers``: its children that read bodies and answer (``--api-servers N > 1``);
- ``decode``: the processes that decode media (children of the API servers, or of the engine with one);
- ``client``: ``bench-serve`` itself.

A role's CPU-ms per item over the host's cores bounds the rate that role can sustain (``cores × 1000 / ms``), a
bound that holds only if the role spreads over the cores; the table says which role is the first to run out.
Linux only (``/proc``); the tower's full widths on the CPU in bf16 (random weights, built in seconds, never run)::

    python tools/serve_ceiling.py                                   # the host path alone, video8x224
    python tools/serve_ceiling.py --engine-ms-per-item 2.96 --api-servers 4 --decode-workers 12
    python tools/serve_ceiling.py --json /tmp/ceiling.json -- --num-prompts 200 --workload img1x224

Arguments after ``--`` go to ``bench-serve`` as they are (its defaults: 400 clips at rate inf, ``--response-dtype
model``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SAMPLE_S = 0.02  # /proc is read this often while the load runs
BUSY_WINDOW = 5  # samples: the server is under load while it spent ...
BUSY_TICKS = 5  # ... this many clock ticks or more over them (half a CPU at the usual 100 ticks a second)
STAND_IN = "serve_ceiling stand-in (batches, host s):"  # the server's last line: its batches' host work
READY = re.compile(r"listening on (http://\S+)")


class StandInEncoder:
    """An :class:`~glmvit.encoder.Encoder` whose batch costs a fixed time and computes nothing: it sleeps
    ``ms_per_batch + ms_per_item × items + us_per_token × tokens`` (after ``host_ops`` tiny torch calls: the host
    work of launching a batch, each call letting go of the interpreter and taking it back) and returns zeros of each
    item's [tokens, out_hidden_size] in the model's dtype, on the model's device. For measuring what surrounds an
    encoder, never for an answer."""

    def __init__(self, model: Any, budgets: Any, ms_per_item: float, ms_per_batch: float, us_per_token: float = 0.0,
                 host_ops: int = 0):
        self._model, self._budgets = model, budgets
        self.ms_per_item, self.ms_per_batch, self.us_per_token = ms_per_item, ms_per_batch, us_per_token
        self.host_ops = host_ops
        self.host_s = 0.0  # the batches' host work, summed
        self.batches = 0

    model = property(lambda self: self._model)
    budgets = property(lambda self: self._budgets)
    label = "stand-in"
    attention = "none"

    @property
    def run_mode(self) -> Any:
        from glmvit.modes import RunMode
        return RunMode.parse("eager")

    def encode(self, pixel_values: Any, request: Any, *, sync: bool) -> list:
        import torch
        tokens = [item.tokens for item in request.items]
        start, one = time.perf_counter(), torch.zeros(1)
        for _ in range(self.host_ops):  # tiny torch calls, each letting go of the GIL and taking it back
            one.add_(1)
        self.host_s += time.perf_counter() - start
        time.sleep((self.ms_per_batch + self.ms_per_item * len(tokens)) / 1e3 + self.us_per_token * sum(tokens) / 1e6)
        self.batches += 1
        width = self._model.config.out_hidden_size
        return [torch.zeros(int(n), width, dtype=self._model.dtype, device=self._model.device)
                for n in tokens]


IDLE = {"wait", "select", "poll", "_wait_for_tstate_lock", "acquire", "sleep", "recv", "recv_bytes", "_recv",
        "_recv_bytes", "accept", "get", "_poll", "run_forever", "_run_once", "readinto", "wait_for",
        "_worker"}  # blocked (a pool thread's innermost Python frame while it waits in its queue's C get)


def sample_threads(path: str, every_s: float = 0.005) -> None:
    """Until the process exits, every ``every_s`` note where each other thread's Python stack stands (its innermost
    frame and the two callers above it); at exit write, per thread name, the samples not blocked in a wait
    (:data:`IDLE`) counted by stack, most first, to ``path`` as JSON. A thread holding the interpreter is seen only
    when it lets go, so the counts say where threads are, roughly in proportion, not a CPU profile."""
    import atexit
    import collections
    import threading

    counts: collections.Counter = collections.Counter()
    totals: collections.Counter = collections.Counter()
    me = threading.get_ident()

    def where(frame: Any) -> str:
        parts = []
        while frame is not None and len(parts) < 3:
            code = frame.f_code
            parts.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " < ".join(parts)

    def run() -> None:
        while True:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = re.sub(r"_\d+$", "_N", names.get(ident, "?"))  # pool threads: one name per pool
                totals[name] += 1
                if frame.f_code.co_name not in IDLE:
                    counts[(name, where(frame))] += 1
            time.sleep(every_s)

    def dump() -> None:
        report: dict[str, Any] = {}
        for (name, stack), n in counts.most_common():
            entry = report.setdefault(name, {"samples": totals[name], "busy": 0, "stacks": []})
            entry["busy"] += n
            if len(entry["stacks"]) < 15:
                entry["stacks"].append([n, stack])
        Path(path).write_text(json.dumps(report, indent=1) + "\n")

    atexit.register(dump)
    threading.Thread(target=run, name="serve-ceiling-sampler", daemon=True).start()


def serve_stand_in(argv: list[str], ms_per_item: float, ms_per_batch: float, us_per_token: float = 0.0,
                   sample: str | None = None, host_ops: int = 0) -> int:
    """``glmvit serve`` (eager) whose :func:`~glmvit.cli.serve.make_scheduler` gets a :class:`StandInEncoder` from
    ``build_encoder``: everything else as the flags say; ``sample``: :func:`sample_threads` to that path. Its last
    line on standard output (:data:`STAND_IN`) gives the batches run and their host work."""
    import atexit

    from glmvit.cli import serve

    def build_encoder(model: Any, mode: Any, budgets: Any, **_: Any) -> StandInEncoder:
        encoder = StandInEncoder(model, budgets, ms_per_item, ms_per_batch, us_per_token, host_ops)
        atexit.register(lambda: print(f"{STAND_IN} {encoder.batches} {encoder.host_s:.6f}", flush=True))
        return encoder

    serve.build_encoder = build_encoder
    if sample:
        sample_threads(sample)
    return serve.main(argv)


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` (all its threads), in clock ticks; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def tree(root: int) -> dict[int, int]:
    """Every process under ``root`` (itself included) → its depth."""
    depths, todo = {root: 0}, [root]
    while todo:
        pid = todo.pop()
        for child in children(pid):
            depths[child] = depths[pid] + 1
            todo.append(child)
    return depths


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def role(depth: int, command: str, api_servers: int) -> str:
    if depth == 0:
        return "engine"
    if "resource_tracker" in command or "semaphore_tracker" in command:
        return "other"
    if api_servers > 1:
        return "api servers" if depth == 1 else "decode"
    return "decode"


def snapshot(root: int, api_servers: int) -> dict[int, tuple[str, int]]:
    taken = {}
    for pid, depth in tree(root).items():
        ticks = cpu_ticks(pid)
        if ticks is not None:
            taken[pid] = (role(depth, cmdline(pid), api_servers), ticks)
    return taken


def load_window(history: list[tuple[float, int, dict[int, tuple[str, int]]]], before: dict[int, tuple[str, int]]
                ) -> tuple[int, int]:
    """The first and last samples at which the server is under load: its processes spent ``BUSY_TICKS`` or more
    over the ``BUSY_WINDOW`` samples up to then (an idle server's timers tick now and then, never that fast). Both
    ends are inclusive; the whole history if the server never looked busy (a load too short to tell)."""
    totals = [sum(t for _, t in before.values())] + [sum(t for _, t in now.values()) for _, _, now in history]
    busy = [i for i in range(len(history)) if totals[i + 1] - totals[max(0, i + 1 - BUSY_WINDOW)] >= BUSY_TICKS]
    if not busy:
        return 0, len(history) - 1
    return max(0, busy[0] - BUSY_WINDOW), busy[-1]


def wait_idle(root: int, api_servers: int, timeout_s: float = 300.0) -> None:
    """Return once the server's processes spent under ``BUSY_TICKS`` over a second (their start-up finished)."""
    deadline = time.monotonic() + timeout_s
    previous = sum(t for _, t in snapshot(root, api_servers).values())
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = sum(t for _, t in snapshot(root, api_servers).values())
        if now - previous < BUSY_TICKS:
            return
        previous = now
    raise SystemExit(f"serve_ceiling: the server was still busy {timeout_s:.0f} s after it listened")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-ms-per-item", type=float, default=0.0)
    p.add_argument("--engine-ms-per-batch", type=float, default=0.0)
    p.add_argument("--engine-us-per-token", type=float, default=0.0, help="the stand-in's time per output token "
                   "(a mixed workload: 11.6 is the in-process record's busy time per clip over its 256 tokens)")
    p.add_argument("--device", default="cpu", help="the model's device: where rows are made and answers copied from "
                   "(default cpu; cuda on a GPU host: the engine's copies then as the real server's)")
    p.add_argument("--config", default="full", choices=["full", "tiny"], help="the tower's widths (default full: "
                   "answers of the real size; tiny for a quick check)")
    p.add_argument("--engine-host-ops", type=int, default=0, help="tiny torch calls the stand-in makes per batch "
                   "before its sleep: a launch's host work, slowed as the engine's other threads hold the GIL")
    p.add_argument("--api-servers", type=int, default=None, help="the server's (default: its own default)")
    p.add_argument("--decode-workers", type=int, default=None, help="the server's (default: its own default)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more flag for serve, e.g. --threads=8")
    p.add_argument("--sample-engine", metavar="PATH", default=None, help="write where the engine process's threads "
                   "stand, sampled every 5 ms, to PATH (JSON; sample_threads)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="PATH", default=None)
    p.add_argument("--serve-stand-in", action="store_true", help=argparse.SUPPRESS)  # the server's own process
    return p.parse_args(own), rest


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve_stand_in:
        return serve_stand_in(rest, args.engine_ms_per_item, args.engine_ms_per_batch, args.engine_us_per_token,
                              args.sample_engine, args.engine_host_ops)
    if not Path("/proc/self/stat").exists():
        print("serve_ceiling: needs /proc (Linux)", file=sys.stderr)
        return 2
    serve_argv = ["--host", "127.0.0.1", "--port", "0", "--mode", "eager", "--device", args.device,
                  "--config", args.config, "--dtype", "bf16", "--quiet", *args.serve_arg]
    if args.api_servers is not None:
        serve_argv += ["--api-servers", str(args.api_servers)]
    if args.decode_workers is not None:
        serve_argv += ["--decode-workers", str(args.decode_workers)]
    server = subprocess.Popen([sys.executable, __file__, "--serve-stand-in",
                               "--engine-ms-per-item", str(args.engine_ms_per_item),
                               "--engine-ms-per-batch", str(args.engine_ms_per_batch),
                               "--engine-us-per-token", str(args.engine_us_per_token),
                               "--engine-host-ops", str(args.engine_host_ops),
                               *(["--sample-engine", args.sample_engine] if args.sample_engine else []),
                               "--", *serve_argv],
                              stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = {}
    try:
        url = wait_ready(server, args.startup_timeout)
        code = measure(args, rest, server.pid, url, result)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.stdout is not None
    for line in server.stdout.read().splitlines():
        if line.startswith(STAND_IN) and result:
            batches, host_s = line[len(STAND_IN):].split()
            result["stand_in"] = {"batches": int(batches), "host_ms_per_batch": 1e3 * float(host_s) / max(1, int(
                batches)), "host_ops": args.engine_host_ops}
            print(f"stand-in host work: {result['stand_in']['host_ms_per_batch']:.3f} ms a batch of "
                  f"{args.engine_host_ops} calls, over {batches} batches (warm-up included)")
    if args.json and result:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.sample_engine and Path(args.sample_engine).exists():
        print_samples(json.loads(Path(args.sample_engine).read_text()))
    return code


def print_samples(report: dict[str, Any], top: int = 3) -> None:
    """The engine's threads, busiest first: the share of samples not waiting, and the stacks seen most."""
    print("engine threads (share of samples not waiting; where, most seen first):")
    for name, entry in sorted(report.items(), key=lambda kv: -kv[1]["busy"]):
        if name == "serve-ceiling-sampler":
            continue
        print(f"  {name:<24} {100 * entry['busy'] / max(1, entry['samples']):5.1f} %")
        for n, stack in entry["stacks"][:top]:
            print(f"      {n:6d}  {stack}")


def wait_ready(server: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert server.stdout is not None
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            raise SystemExit(f"serve_ceiling: the server stopped before listening (exit {server.wait()})")
        if match := READY.search(line):
            return match.group(1).rstrip(")")
    raise SystemExit(f"serve_ceiling: the server did not listen within {timeout:.0f} s")


def measure(args: argparse.Namespace, rest: list[str], root: int, url: str, result: dict[str, Any]) -> int:
    """Load the server at ``url`` with bench-serve and fill ``result``; 0, or 1 if bench-serve failed."""
    api_servers = args.api_servers or 1
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        wait_idle(root, api_servers)  # its decode workers import torch after it listens: not the load's CPU
        before = snapshot(root, api_servers)
        client = subprocess.Popen([sys.executable, "-m", "glmvit", "bench-serve", "--url", url, "--json", str(out),
                                   "--response-dtype", "model", *rest])
        history: list[tuple[float, int, dict[int, tuple[str, int]]]] = []  # (time, client ticks, server readings)
        client_ticks = 0
        while client.poll() is None:
            client_ticks = cpu_ticks(client.pid) or client_ticks
            history.append((time.perf_counter(), client_ticks, snapshot(root, api_servers)))
            time.sleep(SAMPLE_S)
        first, last = load_window(history, before)
        start, client_start, _ = history[first]
        end, client_end, _ = history[last]
        readings = {**before, **history[first][2]}  # the window's baseline
        at_end: dict[int, tuple[str, int]] = {}
        for _, _, now in history[:last + 1]:
            at_end.update(now)  # every process's last reading up to the window's end, those gone since kept
        wall = end - start
        if client.returncode:
            print(f"serve_ceiling: bench-serve failed (exit {client.returncode})", file=sys.stderr)
            return 1
        record = json.loads(out.read_text())
    run = record["runs"][0]
    items = run["server"]["items"]
    warm = record["settings"].get("warmup_requests", 0)
    counted = items + warm * record["settings"].get("items_per_request", 1)
    cpu: dict[str, float] = {}
    for pid, (name, ticks) in at_end.items():
        cpu[name] = cpu.get(name, 0.0) + (ticks - readings.get(pid, (name, 0))[1]) / TICKS
    cpu["client"] = (client_end - client_start) / TICKS
    cores = os.cpu_count() or 1
    result.update({
        "engine_ms_per_item": args.engine_ms_per_item, "engine_ms_per_batch": args.engine_ms_per_batch,
        "engine_us_per_token": args.engine_us_per_token, "api_servers": api_servers, "cores": cores, "items": items,
        "items_counted_for_cpu": counted, "successful": run["successful"], "failed": run["failed"],
        "refused": run["refused"], "busy_s": run["server"]["busy_s"], "items_per_s": run["items_per_s"],
        "items_per_batch": run["server"]["items_per_batch"], "engine_busy": run["server"]["utilisation"],
        "time_split_ms": run["time_split_ms"], "wall_s": wall, "cpu_s": cpu,
        "cpu_ms_per_item": {k: 1e3 * v / counted for k, v in cpu.items()}, "settings": record["settings"]})
    print(f"{items} items at {run['items_per_s']:.1f} items/s, {run['server']['items_per_batch']:.1f} per batch, "
          f"engine busy {100 * run['server']['utilisation']:.1f} % (stand-in: {args.engine_ms_per_item} ms/item, "
          f"{args.engine_us_per_token} µs/token)")
    print(f"{'role':<12} {'cpu s':>7} {'ms/item':>8} {'items/s on ' + str(cores) + ' cores':>20}")
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        per = 1e3 * seconds / counted
        print(f"{name:<12} {seconds:7.2f} {per:8.2f} {cores * 1e3 / per if per else float('inf'):20.0f}")
    total = sum(cpu.values()) * 1e3 / counted
    print(f"{'all':<12} {sum(cpu.values()):7.2f} {total:8.2f} {cores * 1e3 / total:20.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
