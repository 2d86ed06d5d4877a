"""bench-serve --url --wait-s: a client started before its server waits for it to listen (what a record run does to
overlap the client's start with the server's capture), and without --wait-s fails at once."""
import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from glmvit.cli.bench_serve import fetch_health


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _info(request: web.Request) -> web.Response:
    return web.json_response({"mode": "graph"})


async def _late_server(port: int, delay: float) -> web.AppRunner:
    await asyncio.sleep(delay)
    app = web.Application()
    app.router.add_get("/v1/info", _info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_the_client_waits_for_a_server_that_starts_late():
    async def go() -> dict:
        port = _free_port()
        server = asyncio.create_task(_late_server(port, 1.2))
        try:
            return await fetch_health(f"http://127.0.0.1:{port}", wait_s=20)
        finally:
            await (await server).cleanup()

    assert asyncio.run(go()) == {"mode": "graph"}


def test_without_waiting_a_server_that_does_not_listen_fails_at_once():
    async def go() -> None:
        await fetch_health(f"http://127.0.0.1:{_free_port()}", wait_s=0)

    with pytest.raises(aiohttp.ClientConnectorError):
        asyncio.run(go())


def test_a_run_reports_the_rate_its_encoder_allows_beside_the_rate_it_reached():
    """vs_floor divides by the run's wall time, encoder_bound_vs_floor by the encoder's busy time: a run whose
    encoder idled half the time reached half the rate its encoder allows."""
    import argparse

    import numpy as np

    from glmvit.cli.bench_serve import Outcome, Workload, run_record

    grids = [np.array([[1, 4, 4]])] * 4
    workload = Workload(grids, [[4]] * 4, [0] * 4, [], {})
    outcomes = [Outcome(True, 0.0, 1.0)] * 3 + [Outcome(False, 0.0, 1.0, error="x")]
    args = argparse.Namespace(burstiness=1.0, max_concurrency=None)
    record = run_record("graph", float("inf"), args, workload, outcomes, 2.0, {"busy_s": 1.0}, 3.0)
    assert record["items_per_s"] == 1.5 and record["vs_floor"] == 0.5  # 3 items in 2 s, floor 3 items/s
    assert record["encoder_bound_vs_floor"] == 1.0  # 3 items in 1 s of encoding
    assert run_record("graph", 1.0, args, workload, outcomes, 2.0, {"busy_s": 0.0}, 3.0)[
        "encoder_bound_vs_floor"] is None


def test_the_steady_rate_counts_the_answers_between_the_first_and_the_last_tenth():
    """At rate inf a run's rate holds its fill and drain; the steady rate is the middle 80 % of the answers over
    their span: here 20 answers, the first two at 1 s (the fill) and then one every 0.1 s, so the 15 answers after
    the 3rd's time up to the 18th's, over 1.5 s: 10 a second, the spacing's rate, where the whole run's is 20 in 2.8 s.
    Fewer than 10 answers give none; a run's record counts its successful answers only."""
    import argparse

    import numpy as np

    from glmvit.cli.bench_serve import Outcome, Workload, run_record
    from glmvit.timing import steady_rate

    done = [1.0, 1.0] + [1.0 + 0.1 * k for k in range(1, 19)]
    assert steady_rate((t, 1) for t in done) == pytest.approx(10.0)  # 15 answers from 1.1 s to 2.6 s
    assert steady_rate((t, 2) for t in done) == pytest.approx(20.0)  # items, not answers
    assert steady_rate((t, 1) for t in done[:9]) is None  # too few to cut tenths from
    assert steady_rate((t, 1) for t in sorted([*done, 1.55])) != pytest.approx(10.0)  # so the failure below counts
    grids = [np.array([[1, 4, 4]])] * 21
    outcomes = [Outcome(True, 0.0, t) for t in done] + [Outcome(False, 0.0, 1.55, error="x")]  # failed mid-run
    record = run_record("graph", float("inf"), argparse.Namespace(burstiness=1.0, max_concurrency=None),
                        Workload(grids, [[4]] * 21, [0] * 21, [], {}), outcomes, 9.0, {"busy_s": 1.0}, 20.0)
    assert record["steady_items_per_s"] == pytest.approx(10.0) and record["steady_vs_floor"] == pytest.approx(0.5)


def test_at_rate_inf_the_first_request_is_on_the_wire_before_the_last_is_made():
    """drive starts one request a pass of the event loop: request 0 gets past its first await (its write, in the
    HTTP client) before request n−1 starts, rather than after all n are made; and every outcome comes back, in
    order."""
    import asyncio
    import math
    import time
    from types import SimpleNamespace

    from glmvit.cli import bench_serve

    log: list = []

    async def send(j):
        log.append(("start", j))
        await asyncio.sleep(0)
        log.append(("written", j))
        return SimpleNamespace(j=j, done=time.perf_counter())

    outcomes, start, end = asyncio.run(bench_serve.drive(send, 50, math.inf, 1.0, None, 0))
    assert [o.j for o in outcomes] == list(range(50)) and end == max(o.done for o in outcomes) > start
    assert log.index(("written", 0)) < log.index(("start", 49)), log[:8]
