"""bench-serve reads an answer into one buffer of its Content-Length (glmvit.cli.bench_serve.read_body): every byte in
its place, a compressed or length-less answer read as aiohttp reads it, and a body shorter than its Content-Length a
failure of one line, counted as one. Against tiny aiohttp servers on 127.0.0.1 (an ephemeral port)."""
import argparse
import asyncio
import gzip

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from glmvit.cli.bench_serve import HttpTarget, Outcome, Workload, read_body, run_record

pytestmark = pytest.mark.timeout(120)
BODY = np.random.default_rng(0).integers(0, 256, (3 << 20) + 12345, dtype=np.uint8).tobytes()  # 3 MiB and a bit
TEXT = b"an embedding " * 300_000  # 3.9 MB that compress well


async def whole(request: web.Request) -> web.StreamResponse:
    """BODY, its length declared, written in pieces that come apart (the reader sees many chunks)."""
    response = web.StreamResponse()
    response.content_length = len(BODY)
    await response.prepare(request)
    for begin in range(0, len(BODY), 100_003):
        await response.write(BODY[begin : begin + 100_003])
        await asyncio.sleep(0)
    await response.write_eof()
    return response


async def short(request: web.Request) -> web.StreamResponse:
    """A Content-Length of BODY's, half of it sent, then the connection closed."""
    await request.read()
    response = web.StreamResponse(headers={"X-Queue-Delay-Ms": "1.0", "Server-Timing": "read;dur=1.000"})
    response.content_length = len(BODY)
    await response.prepare(request)
    await response.write(BODY[: len(BODY) // 2])
    assert request.transport is not None
    request.transport.close()
    return response


async def gzipped(request: web.Request) -> web.Response:
    """TEXT compressed (Content-Encoding: gzip): its Content-Length is the compressed size, not TEXT's."""
    return web.Response(body=gzip.compress(TEXT, 1), headers={"Content-Encoding": "gzip"})


async def chunked(request: web.Request) -> web.StreamResponse:
    """BODY without a Content-Length (chunked)."""
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    for begin in range(0, len(BODY), 1 << 20):
        await response.write(BODY[begin : begin + (1 << 20)])
    await response.write_eof()
    return response


async def serving(handler, fn):
    """``fn(url)`` with ``handler`` answering every GET and POST of a server on 127.0.0.1."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        return await fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def read_from(handler):
    """What read_body made of ``handler``'s answer, and the response's headers."""
    async def get(url):
        async with aiohttp.ClientSession() as session, session.get(url + "/answer") as response:
            return await read_body(response), response.headers.copy()
    return asyncio.run(asyncio.wait_for(serving(handler, get), 60))


def test_an_answer_of_many_chunks_is_read_whole_into_one_buffer_of_its_length():
    body, headers = read_from(whole)
    assert int(headers["Content-Length"]) == len(BODY)
    assert isinstance(body, bytearray) and len(body) == len(BODY) and body == BODY


@pytest.mark.parametrize("handler, sent", [(gzipped, TEXT), (chunked, BODY)], ids=["gzip", "no length"])
def test_a_compressed_or_length_less_answer_is_read_as_aiohttp_reads_it(handler, sent):
    body, headers = read_from(handler)
    assert bytes(body) == sent  # the inflated bytes, not as many as the compressed Content-Length
    if handler is gzipped:
        assert headers["Content-Encoding"] == "gzip" and int(headers["Content-Length"]) < len(sent) // 100
    else:
        assert "Content-Length" not in headers


WORKLOAD = Workload([np.array([[1, 4, 4]])], [[4]], [0], [], {})  # one item of 4 tokens


def one_request(handler) -> Outcome:
    """What bench-serve's HttpTarget makes of one request answered by ``handler`` (a width-8 model)."""
    async def send(url):
        target = HttpTarget(url, WORKLOAD, {"vision_config": {"out_hidden_size": 8}}, "float32", 30.0, [b"{}"])
        async with target:
            return await target.send(0)
    return asyncio.run(asyncio.wait_for(serving(handler, send), 60))


def test_a_body_short_of_its_content_length_is_a_failure_of_one_line():
    outcome = one_request(short)
    assert not outcome.ok and not outcome.refused and outcome.error is not None
    assert outcome.error.startswith("ClientPayloadError: ") and "\n" not in outcome.error, outcome.error
    args = argparse.Namespace(burstiness=1.0, max_concurrency=None)
    record = run_record("graph", float("inf"), args, WORKLOAD, [outcome], 1.0, {"busy_s": 0.0}, None)
    assert (record["successful"], record["refused"], record["failed"]) == (0, 0, 1)
    assert record["errors"] == {outcome.error: 1} and record["per_request"]["timing_ms"] == [None]


def test_bench_serves_target_reads_a_sized_answer_without_aiohttps_read(monkeypatch):
    """An answer with a Content-Length reaches the checks through read_body (response.read(), which joins what it
    buffers, is never called), its Server-Timing parsed."""
    import torch
    from safetensors.torch import save

    answer = save({"item_0": torch.zeros(4, 8)})

    async def encode(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"X-Queue-Delay-Ms": "2.5", "Server-Timing": "read;dur=1.5, "
                                               "queue;dur=2.500"})
        response.content_length = len(answer)
        await response.prepare(request)
        await response.write(answer)
        await response.write_eof()
        return response

    async def never(self):
        raise AssertionError("response.read() was called")

    monkeypatch.setattr(aiohttp.ClientResponse, "read", never)
    outcome = one_request(encode)
    assert outcome.ok and outcome.error is None, outcome.error
    assert outcome.queue_ms == 2.5 and outcome.timing_ms == {"read": 1.5, "queue": 2.5}


def test_an_answer_declaring_more_than_the_cap_is_read_as_aiohttp_reads_it(monkeypatch):
    """A Content-Length past MAX_SIZED_ANSWER is never allocated on the server's word: read() reads what comes."""
    from glmvit.cli import bench_serve

    monkeypatch.setattr(bench_serve, "MAX_SIZED_ANSWER", len(BODY) - 1)
    body, headers = read_from(whole)
    assert int(headers["Content-Length"]) == len(BODY) and isinstance(body, bytes) and body == BODY


def test_the_rows_default_is_the_one_the_record_run_decides():
    """``serve --rows``'s default is ``device`` until host rows serve more items/s than device rows both over the
    whole run and once full, in one record run (``serve_video8x224_rows_host`` beside ``serve_video8x224``, the same
    workload and mode): two runs of one workload agree only to their run-to-run spread, so a split verdict keeps the
    default."""
    from pathlib import Path

    from glmvit.cli.serve_app import DEFAULT_ROWS
    from glmvit.records import ServeRecord, load

    bench = Path(__file__).resolve().parents[1] / "data" / "bench"
    device, host = (load(bench / f"{name}.json", ServeRecord) for name in ("serve_video8x224",
                                                                            "serve_video8x224_rows_host"))
    if device.record_run != host.record_run:
        pytest.skip("the two records come from different record runs")
    assert device.settings["batching"]["rows"] == "device" and host.settings["batching"]["rows"] == "host"
    dev, hst = (next(r for r in rec.runs if r["mode"] == "graph-compiled" and r["request_rate"] == "inf")
                for rec in (device, host))
    host_wins = all(hst[key] > dev[key] for key in ("items_per_s", "steady_items_per_s"))
    assert DEFAULT_ROWS == ("host" if host_wins else "device"), {k: (dev[k], hst[k]) for k in ("items_per_s",
                                                                                             "steady_items_per_s")}
