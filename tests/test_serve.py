"""glmvit serve on CPU: the real aiohttp server on 127.0.0.1 (an ephemeral port), driven over HTTP by concurrent
clients. Files come back as ``encode --out`` writes them; pixel rows of concurrent clients come back bitwise as
requests encoded alone (why bitwise: tests/test_scheduler.py); overload, bad input and shutdown mid-request answer as
the server promises. No traffic leaves the loopback interface; every wait is bounded."""
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load, save

from glmvit import VisionConfig
from glmvit.cli import main as cli_main
from glmvit.cli.common import resolve_model_args
from glmvit.cli.serve import build_parser, build_service, make_scheduler
from glmvit.cli.serve_app import EncoderService, HttpLimits, ServerThread
from glmvit.graphs import EncoderGraphRunner
from glmvit.packing import BudgetConfig
from glmvit.records import ServeRecord
from glmvit.records import load as load_record
from glmvit.scheduler import SWITCH_INTERVAL_S, BatchScheduler
from glmvit.workloads import random_batch

ROOT = Path(__file__).resolve().parent.parent
TINY = VisionConfig.tiny()
ONE_BUDGET = BudgetConfig(token_budgets=(32,), max_items=4, max_segments=8)
TIMEOUT = 60
SAFETENSORS = {"Content-Type": "application/x-safetensors"}
pytestmark = pytest.mark.timeout(300)


def pixel_body(pixels, grid):
    return save({"pixel_values": pixels.contiguous(), "grid_thw": grid.contiguous()})


def random_request(seed):
    rng = np.random.default_rng(seed)
    grids = [[int(rng.choice([1, 1, 2])), *(2 * rng.integers(1, 4, size=2)).tolist()]
             for _ in range(int(rng.integers(1, 4)))]
    return random_batch(grids, TINY, seed=500 + seed)


def service_for(model, start=True, limits=None, config=ONE_BUDGET, **scheduler_args):
    runner = EncoderGraphRunner(model, config, mode="emulate").capture()
    scheduler = BatchScheduler(runner, start=start, **scheduler_args)
    return EncoderService(scheduler, {"description": "tiny test tower"}, {"command": "test"}, limits or HttpLimits(),
                          threads=2)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT))


async def post(session, url, body, headers=SAFETENSORS, **kw):
    async with session.post(url + "/v1/encode", data=body, headers=headers, **kw) as response:
        return response.status, response.headers.copy(), await response.read()


def error_of(status_body):
    status, _, body = status_body
    return status, json.loads(body)["error"]


def wait_until(condition, what):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def one_past_two_queued(service, body, headers=SAFETENSORS):
    """With ``service``'s scheduler not started: two requests of ``body`` admitted and waiting, a third sent (the one
    a bound refuses), then the scheduler started; the third's (status, headers, body) and the two queued answers."""
    with ServerThread(service) as server:
        async def overfill():
            async with aiohttp.ClientSession() as session:
                queued = [asyncio.create_task(post(session, server.url, body, headers)) for _ in range(2)]
                await asyncio.to_thread(wait_until, lambda: service.scheduler.stats()["outstanding_requests"] == 2,
                                        "two queued requests")
                refused = await post(session, server.url, body, headers)
                service.scheduler.start()
                return refused, await asyncio.gather(*queued)
        return run(overfill())


def test_files_come_back_as_encode_out_writes_them(tmp_path, capsys):
    files = [ROOT / "data/images/coffee.jpg", ROOT / "data/clip.gif"]
    dest = tmp_path / "emb.safetensors"
    assert cli_main(["encode", *map(str, files), "--out", str(dest), "--device", "cpu", "--quiet"]) == 0
    parser = build_parser()  # the same model: tiny tower, random weights of seed 0, fp32, CPU
    args = parser.parse_args(["--device", "cpu", "--budgets", "32", "--no-measure-floor", "--quiet"])
    resolve_model_args(parser, args)
    with ServerThread(build_service(args, "test")) as server:  # every sample item exceeds budget 32: eager, alone
        async def send():
            form = aiohttp.FormData()
            for path in files:
                form.add_field("file", path.read_bytes(), filename=path.name)
            async with aiohttp.ClientSession() as session:
                return await post(session, server.url, form, headers={})
        status, headers, body = run(send())
    assert status == 200 and headers["Content-Type"] == "application/x-safetensors", body[:300]
    got, want = load(body), load(dest.read_bytes())
    assert sorted(got) == sorted(want) == ["item_0", "item_1"]
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in want)
    served = json.loads(file_metadata_of(body)["item_1"])
    written = json.loads(file_metadata_of(dest.read_bytes())["item_1"])
    assert served.pop("source") == "clip.gif" and written.pop("source") == str(files[1].resolve())
    assert served == written and served["kind"] == "video" and served["timestamps"]
    for key in ("vision_config", "dtype", "weights", "device", "description"):
        assert file_metadata_of(body)[key] == file_metadata_of(dest.read_bytes())[key], key


@pytest.mark.parametrize("flag, seconds", [([], SWITCH_INTERVAL_S), (["--switch-interval-ms", "0"], None),
                                           (["--switch-interval-ms", "1.5"], 1.5e-3)])
def test_the_switch_interval_flag_reaches_the_scheduler(tiny_model, flag, seconds):
    parser = build_parser()
    args = parser.parse_args(["--device", "cpu", "--budgets", "32", *flag])
    resolve_model_args(parser, args)
    scheduler, _ = make_scheduler(tiny_model, "eager", args)
    scheduler.close(TIMEOUT)
    assert scheduler.switch_interval_s == seconds


def test_uniform_lengths_reach_the_runner_and_its_uniform_graphs_take_their_batches(tiny_model, tiny_config):
    """``--uniform-lengths 16``: the runner captures 16-row uniform graphs where they hold DENSE_MIN_ROWS rows (the
    rule is patched to 64 rows: budget 16's 64 rows, not budget 8's 32), and 64 rows of 16-row frames replay there."""
    from glmvit import encoder as encoder_module

    parser = build_parser()
    args = parser.parse_args(["--device", "cpu", "--budgets", "8,16", "--uniform-lengths", "16,16"])
    resolve_model_args(parser, args)
    assert args.uniform_lengths == (16,)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(encoder_module, "DENSE_MIN_ROWS", 64)
        scheduler, runner = make_scheduler(tiny_model, "graph", args)
    try:
        assert runner is not None and set(runner.uniform_graphs) == {(16, 16)}
        grids = [[2, 4, 4], [2, 4, 4]]  # 64 rows of 16-row frames: budget 16, full
        pixels, grid = random_batch(grids, tiny_config, seed=52)
        runner.run(pixels, grid)
        assert runner.stats.uniform_replays == 1
    finally:
        scheduler.close(TIMEOUT)


@pytest.mark.parametrize("value", ["0", "-4", "x", "256,,1024"])
def test_a_bad_uniform_length_is_refused_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--uniform-lengths", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "--uniform-lengths" in err[-1]


@pytest.mark.parametrize("value", ["0.0005", "-1", "1001", "nan", "fast"])
def test_a_switch_interval_below_a_microsecond_is_refused_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--switch-interval-ms", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "--switch-interval-ms" in err[-1] and value in err[-1]


def file_metadata_of(data: bytes) -> dict:
    header = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header])["__metadata__"]


def test_concurrent_clients_get_exactly_their_own_items(tiny_model):
    requests = [random_request(seed) for seed in range(32)]
    alone = EncoderGraphRunner(tiny_model, ONE_BUDGET, mode="emulate").capture()
    expected = [alone.run(*r) for r in requests]
    service = service_for(tiny_model, start=False)  # the worker starts once every request is queued: they mix
    with ServerThread(service) as server:
        async def clients():
            async with aiohttp.ClientSession() as session:
                async def client(k):
                    return [await post(session, server.url, pixel_body(*requests[j]))
                            for j in range(k, len(requests), 8)]
                tasks = [asyncio.create_task(client(k)) for k in range(8)]
                await asyncio.to_thread(wait_until, lambda: service.scheduler.stats()["outstanding_requests"] == 8,
                                        "the first request of every client to be queued")
                service.scheduler.start()
                return await asyncio.gather(*tasks)
        answers = run(clients())
    ids = set()
    for k, per_client in enumerate(answers):
        for n, (status, headers, body) in enumerate(per_client):
            j = k + 8 * n
            assert status == 200, body
            got = load(body)
            assert len(got) == len(expected[j])
            for i, ref in enumerate(expected[j]):  # to float32 rounding: tests/test_scheduler.py says why
                torch.testing.assert_close(got[f"item_{i}"], ref, atol=1e-5, rtol=1e-5, msg=f"request {j} item {i}")
            ids.add(headers["X-Request-Id"])
            assert float(headers["X-Queue-Delay-Ms"]) >= 0
    assert len(ids) == len(requests)
    assert service.scheduler.stats()["mixed_batches"] > 0


def test_overload_is_429_with_a_reason(tiny_model):
    service = service_for(tiny_model, start=False, max_requests=2)
    small = pixel_body(*random_batch([[1, 2, 2]], TINY))
    (status, headers, body), done = one_past_two_queued(service, small)
    assert status == 429 and headers["Retry-After"] == "1" and "queue is full" in json.loads(body)["error"]
    assert [s for s, _, _ in done] == [200, 200]


def test_the_server_refuses_requests_past_its_own_bound_before_reading_them(tiny_model):
    service = service_for(tiny_model, start=False, limits=HttpLimits(max_requests=1))
    small = pixel_body(*random_batch([[1, 2, 2]], TINY))
    with ServerThread(service) as server:
        async def two():
            async with aiohttp.ClientSession() as session:
                first = asyncio.create_task(post(session, server.url, small))
                await asyncio.to_thread(wait_until, lambda: service.in_server == 1, "one request in the server")
                second = await post(session, server.url, small)
                service.scheduler.start()
                return second, await first
        second, first = run(two())
    assert error_of(second)[0] == 429 and "at most 1" in error_of(second)[1]
    assert first[0] == 200



def test_a_body_declared_past_the_body_bound_is_a_413_even_past_the_held_bound(tiny_model):
    """A Content-Length past max_body_bytes can never be served: 413, not 429's "retry later", whatever the
    server holds."""
    service = service_for(tiny_model, limits=HttpLimits(max_body_bytes=1000, max_held_bytes=5000))
    with ServerThread(service) as server:
        for declared in (2000, 10**12):
            head = (f"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: {SAFETENSORS['Content-Type']}\r\n"
                    f"Content-Length: {declared}\r\n\r\n").encode()
            status, error = raw_exchange(server.url, head, [b"x" * 100])
            assert status == 413 and f"{declared:,} bytes: at most 1,000" in error

BAD_PIXELS = [
    ("nan", 400, r"item(s) [1]"),
    ("grid", 400, "item 1: grid h×w = 3×2"),
    ("rows", 400, "rows but grid_thw needs"),
    ("keys", 400, "exactly pixel_values and grid_thw"),
    ("dtype", 400, "pixel_values must be float32"),
    ("float grid", 400, "grid_thw must hold integers"),
    ("garbage", 400, "not a safetensors file"),
    ("empty", 400, "no items"),
    ("too many", 413, "5 items in one request: at most 4"),
]


def bad_pixel_body(kind):
    pixels, grid = random_batch([[1, 4, 4], [2, 2, 2]], TINY)
    if kind == "nan":
        pixels[20, 0] = float("nan")  # a row of item 1
    if kind == "grid":
        return pixel_body(*random_batch([[1, 2, 2], [1, 3, 2]], TINY))
    if kind == "rows":
        pixels = pixels[:-1]
    if kind == "keys":
        return save({"pixel_values": pixels, "grid_thw": grid, "extra": grid.clone()})
    if kind == "dtype":
        pixels = pixels.double()
    if kind == "float grid":
        grid = grid.float()
    if kind == "garbage":
        return b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"
    if kind == "empty":
        return pixel_body(torch.zeros(0, TINY.patch_dim), torch.zeros(0, 3, dtype=torch.long))
    if kind == "too many":
        return pixel_body(*random_batch([[1, 2, 2]] * 5, TINY))
    return pixel_body(pixels, grid)


def test_bad_input_is_a_4xx_that_names_the_item_or_file(tiny_model):
    service = service_for(tiny_model, limits=HttpLimits(max_body_bytes=2**20, max_items=4))
    jpeg = (ROOT / "data/images/coffee.jpg").read_bytes()
    gif = io.BytesIO()
    frames = [Image.fromarray(np.random.default_rng(k).integers(0, 255, (32, 32, 3), dtype=np.uint8)) for k in range(5)]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    cut_gif = gif.getvalue()[: len(gif.getvalue()) * 2 // 3]  # PIL counts its frames with an IndexError
    with ServerThread(service) as server:
        async def send_all():
            async with aiohttp.ClientSession() as session:
                answers = {kind: await post(session, server.url, bad_pixel_body(kind)) for kind, _, _ in BAD_PIXELS}
                for name, data in (("notes.txt", b"hello"), ("broken.png", jpeg[:200]), ("../../etc/x.jpg", b""),
                                   ("cut.gif", cut_gif)):
                    form = aiohttp.FormData()
                    form.add_field("file", jpeg, filename="fine.jpg")
                    form.add_field("file", data, filename=name)
                    answers[name] = await post(session, server.url, form, headers={})
                answers["json"] = await post(session, server.url, b"{}", headers={"Content-Type": "application/json"})
                answers["text"] = await post(session, server.url, b"{}", headers={"Content-Type": "text/plain"})
                answers["huge"] = await post(session, server.url, b"\0" * (2**20 + 1))
                answers["dtype query"] = await post(session, server.url, bad_pixel_body("ok"), params={"dtype": "x"})
                form = aiohttp.FormData()
                form.add_field("a", "b", content_type="text/plain")  # a multipart field without a filename
                answers["no file"] = await post(session, server.url, form, headers={})
                return answers
        answers = run(send_all())
    for kind, status, words in BAD_PIXELS:
        assert error_of(answers[kind])[0] == status and words in error_of(answers[kind])[1], (kind, answers[kind])
    expected = {"notes.txt": (400, "file 1 (notes.txt): unsupported file type '.txt'"),
                "broken.png": (400, "file 1 (broken.png): "), "../../etc/x.jpg": (400, "file 1 (x.jpg): empty file"),
                "cut.gif": (400, "file 1 (cut.gif): cannot decode it"),
                "json": (400, "exactly one of content (a list of parts) and messages"),
                "text": (415, "content type 'text/plain'"), "huge": (413, "at most 1,048,576"),
                "dtype query": (400, "dtype must be float32 or model"), "no file": (400, "part 0 is not a file")}
    for kind, (status, words) in expected.items():
        got_status, message = error_of(answers[kind])
        assert got_status == status and words in message, (kind, message)
        assert "glmvit-serve-" not in message and "Traceback" not in message  # never the temporary path
    assert service.responses[500] == 0


def raw_exchange(url, head, body_parts, pause_s=0.0):
    """Send a raw HTTP request over a socket (headers, then each body part, pausing ``pause_s`` before the last);
    the status and JSON error of the answer."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) as sock:
        sock.sendall(head)
        for k, part in enumerate(body_parts):
            if k == len(body_parts) - 1 and pause_s:
                time.sleep(pause_s)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed first
                break
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_a_malformed_part_header_is_a_400_and_a_stalled_body_a_408_that_frees_its_place(tiny_model):
    import socket
    from urllib.parse import urlsplit

    service = service_for(tiny_model, limits=HttpLimits(read_timeout_s=0.5))
    body = (b"--b\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a.png\"\r\nno colon here\r\n\r\n"
            b"data\r\n--b--\r\n")
    head = (b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: %d\r\n\r\n")
    with ServerThread(service) as server:
        where = urlsplit(server.url)
        malformed = raw_exchange(server.url, head % len(body), [body])
        pixels = pixel_body(*random_request(3))
        stalled = raw_exchange(server.url, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: "
                               b"application/x-safetensors\r\nContent-Length: %d\r\n\r\n" % len(pixels),
                               [pixels[:100], pixels[100:]], pause_s=2.0)
        held = service.in_server
        with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) as sock:  # leaves mid-body
            sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
                         b"Content-Length: 100000\r\n\r\n" + pixels[:100])
        wait_until(lambda: service.clients_left == 1, "the dropped upload counted as a client that left")
    assert malformed[0] == 400 and "multipart body is malformed" in malformed[1], malformed
    assert stalled == (408, "the body did not arrive within 0.5 s"), stalled
    assert held == 0 and service.responses[500] == 0 and service.responses[400] == 1  # the malformed one only


def test_stalled_headers_are_closed_and_connections_past_the_limit_get_a_503(tiny_model):
    """Clients that connect and stall inside their headers (slowloris) hold a connection for header_timeout_s at
    most, and never more than max_connections at once: past that a connection is answered 503 at once, so they
    cannot use up the server's open files. What aiohttp's own parser refuses is one line of JSON too."""
    import socket
    from urllib.parse import urlsplit

    service = service_for(tiny_model, limits=HttpLimits(header_timeout_s=1.0, max_connections=3))
    with ServerThread(service) as server:
        where = urlsplit(server.url)
        stalled = [socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) for _ in range(3)]
        for sock in stalled:
            sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n")  # and never the rest of its headers
        wait_until(lambda: service.metrics_json()["http"]["connections"] == 3, "three open connections")
        past = raw_exchange(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", [])
        closed = [sock.recv(1) for sock in stalled]  # b"": the server closed it (a timeout here raises)
        for sock in stalled:
            sock.close()
        wait_until(lambda: service.metrics_json()["http"]["connections"] == 0, "the stalled connections closed")
        oversized = raw_exchange(server.url, b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                 + b"1" * 31 + b"\r\n\r\n", [])
        health = run(get_status(server.url + "/health"))
    assert past == (503, "the server holds 3 connections already (at most 3); retry later"), past
    assert closed == [b""] * 3
    assert oversized[0] == 400 and oversized[1].startswith("malformed HTTP request"), oversized
    assert health == 200 and service.responses[503] == 1 and service.responses[400] == 1
    assert service.responses[500] == 0


async def get_status(url):
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


def gated(service):
    entered, release, encode = threading.Event(), threading.Event(), service.scheduler._encode

    def held(pixels, grids):
        entered.set()
        assert release.wait(TIMEOUT)
        return encode(pixels, grids)

    service.scheduler._encode = held
    return entered, release


def test_shutdown_mid_request_finishes_it_and_refuses_new_ones(tiny_model):
    request = random_request(7)
    expected = EncoderGraphRunner(tiny_model, ONE_BUDGET, mode="emulate").capture().run(*request)
    service = service_for(tiny_model)
    entered, release = gated(service)
    server = ServerThread(service).start()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            in_flight = asyncio.create_task(post(session, server.url, pixel_body(*request)))
            await asyncio.to_thread(entered.wait, TIMEOUT)  # the worker is inside the encoder with it
            stopper = asyncio.create_task(asyncio.to_thread(server.shutdown, TIMEOUT))
            await asyncio.to_thread(wait_until, lambda: service.draining, "the drain to begin")
            async with aiohttp.ClientSession() as fresh:  # a new connection: the listener is closed (or 503)
                try:
                    late = (await post(fresh, server.url, pixel_body(*request)))[0]
                except aiohttp.ClientConnectionError:
                    late = "refused"
            release.set()
            return await in_flight, late, await stopper
    (status, _, body), late, stopped = run(scenario())
    assert status == 200 and all(torch.equal(load(body)[f"item_{i}"], e) for i, e in enumerate(expected))
    assert late in (503, "refused") and stopped and server.drained
    assert not service.scheduler.accepting


def test_a_drain_past_its_timeout_abandons_what_is_in_flight_and_says_so(tiny_model, caplog):
    service = service_for(tiny_model, start=False)  # the request waits in the queue for ever
    server = ServerThread(service, shutdown_timeout=0.5).start()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            in_flight = asyncio.create_task(post(session, server.url, pixel_body(*random_request(1))))
            await asyncio.to_thread(wait_until, lambda: service.scheduler.stats()["outstanding_requests"] == 1,
                                    "the request queued")
            assert await asyncio.to_thread(server.shutdown, TIMEOUT)
            with pytest.raises(aiohttp.ClientError):
                await in_flight
    run(scenario())
    assert server.drained is False and service.abandoned == 1
    (line,) = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert line == "the drain ran out of time (0.5 s): 1 request(s) in flight abandoned"


CHILD = """
import os, threading, sys, time
import glmvit.cli.serve as serve, glmvit.cli.serve_app as app
drain = threading.Event()
begin = app.EncoderService.begin_drain
def begin_drain(self):
    drain.set()
    begin(self)
app.EncoderService.begin_drain = begin_drain
make = serve.make_scheduler
def make_scheduler(*a, **k):  # the encoder holds every batch until the drain has begun: SIGTERM lands mid-request
    scheduler, runner = make(*a, **k)
    encode = scheduler._encode
    def held(pixels, grids):
        print("encoding", flush=True)
        assert drain.wait(60)
        time.sleep(float(os.environ.get("HOLD_S", "0")))  # past --shutdown-timeout: the drain runs out of time
        return encode(pixels, grids)
    scheduler._encode = held
    return scheduler, runner
serve.make_scheduler = make_scheduler
sys.exit(serve.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("late", [False, True], ids=["in-time", "past-the-timeout"])
def test_sigterm_lets_the_request_in_flight_finish(tmp_path, late):
    """SIGTERM mid-request: the request is answered and the server exits 0; or, when it is still running after
    --shutdown-timeout, the server says in one line that it abandoned it and exits 1."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HOLD_S="30" if late else "0")
    child = subprocess.Popen([sys.executable, "-c", CHILD, "--device", "cpu", "--port", "0", "--budgets", "32",
                              "--no-measure-floor", "--quiet", "--api-servers", "1", "--shutdown-timeout",
                              "1" if late else "60"], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + child.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        request = random_request(3)

        async def scenario():
            async with aiohttp.ClientSession() as session:
                in_flight = asyncio.create_task(post(session, url, pixel_body(*request)))
                assert await asyncio.to_thread(child.stdout.readline) == "encoding\n"
                child.send_signal(signal.SIGTERM)
                try:
                    return await in_flight
                except aiohttp.ClientError:
                    return None, None, None
        status, _, body = run(scenario())
        assert child.wait(TIMEOUT) == (1 if late else 0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(TIMEOUT)
    out, err = child.stdout.read(), child.stderr.read()
    assert "1 request(s) in the server will finish" in err
    if late:
        assert status is None and "stopped" not in out
        assert [line for line in err.splitlines() if "abandoned" in line] == [
            "glmvit serve: the drain ran out of time (1 s): 1 request(s) in flight abandoned"]
    else:
        assert status == 200 and len(load(body)) == len(request[1]) and "stopped" in out and "abandoned" not in err


def strict_prometheus(text):
    """{family: {sample line's name and labels: value}} of Prometheus text, asserting what promtool checks: one
    HELP and one TYPE per family, both before its samples, samples of a family together, conventional names
    (counters end in _total; base units, so no _ms or _s suffix)."""
    import re

    families, seen, current = {}, set(), None
    for line in text.splitlines():
        if line.startswith("# "):
            kind, name, rest = line[2:].split(" ", 2)
            assert kind in ("HELP", "TYPE") and (kind, name) not in seen, f"second {kind} line for {name}"
            seen.add((kind, name))
            if kind == "TYPE":
                assert ("HELP", name) in seen and name not in families, line
                assert rest in ("counter", "gauge") and (rest != "counter" or name.endswith("_total")), line
                assert not re.search(r"_(ms|s)(_|$)", name), f"{name}: not in base units"
                families[name], current = {}, name
            continue
        match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (\S+)', line)
        assert match and match.group(1) == current, f"a sample outside its family: {line!r}"
        families[current][match.group(1) + (match.group(2) or "")] = float(match.group(4))
    return families


def test_health_and_metrics(tiny_model, monkeypatch):
    from glmvit.cli import serve_app
    from glmvit.records import Fingerprint

    service = service_for(tiny_model)  # the fingerprint is taken per /v1/info, after the service is made
    monkeypatch.setattr(serve_app, "fingerprint_now", lambda: Fingerprint(modules={"glmvit.kernels.x": "hash"}))
    with ServerThread(service) as server:
        async def read():
            async with aiohttp.ClientSession() as session:
                await post(session, server.url, pixel_body(*random_request(1)))
                await post(session, server.url, b"junk")
                out = []
                for path in ("/metrics", "/metrics?format=json", "/health", "/v1/info", "/nowhere"):
                    async with session.get(server.url + path) as response:
                        out.append((response.status, await response.text()))
                return out
        text, metrics, health, info, missing = run(read())
    assert health[0] == 200 and json.loads(health[1])["mode"] == "graph-emulated"
    assert json.loads(health[1])["scheduler"]["limits"]["token_budgets"] == [32]
    assert len(health[1]) < 1024 and "fingerprint" not in json.loads(health[1])  # light: a probe reads it often
    assert json.loads(info[1])["fingerprint"] == {"modules": {"glmvit.kernels.x": "hash"}}  # bench-serve merges it
    assert json.loads(info[1])["vision_config"]["out_hidden_size"] == TINY.out_hidden_size
    families = strict_prometheus(text[1])
    assert families["glmvit_http_responses_total"] == {'glmvit_http_responses_total{status="200"}': 1,
                                                       'glmvit_http_responses_total{status="400"}': 1}
    assert families["glmvit_scheduler_completed_total"] == {"glmvit_scheduler_completed_total": 1}
    assert families["glmvit_http_clients_left_total"] == {"glmvit_http_clients_left_total": 0}
    assert set(families["glmvit_scheduler_rejected_total"]) == {'glmvit_scheduler_rejected_total{reason="full"}',
                                                                'glmvit_scheduler_rejected_total{reason="closed"}'}
    assert "glmvit_scheduler_busy_seconds_total" in families
    assert json.loads(metrics[1])["scheduler"]["completed"] == 1
    assert json.loads(metrics[1])["http"]["responses"] == {"200": 2, "400": 1}  # the first /metrics counted too
    assert missing[0] == 404 and json.loads(missing[1])["error"] == "Not Found"


def half_closed_exchange(url, data):
    """Send ``data`` over a socket, shut its sending side (a half-close), and read until the server closes."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=TIMEOUT) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_client_that_half_closes_after_a_whole_connection_close_request_is_answered(tiny_model):
    """A client that shuts its sending side once its request is sent got nothing: aiohttp took the FIN as the
    client leaving and cancelled the encoding. A request that said Connection: close is now answered, then the
    connection closed; on a keep-alive connection the FIN still means the client left (no answer, counted so)."""
    pixels, grid = random_request(3)
    body = pixel_body(pixels, grid)
    head = (b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
            b"Content-Length: %d\r\n" % len(body))
    service = service_for(tiny_model)
    with ServerThread(service) as server:
        left = half_closed_exchange(server.url, head + b"\r\n" + body)  # keep-alive: the client left
        wait_until(lambda: service.clients_left == 1 and service.in_server == 0, "the request to end")
        answer = half_closed_exchange(server.url, head + b"Connection: close\r\n\r\n" + body)
    assert left == b"" and service.clients_left == 1 and service.responses[200] == 1
    status, rest = answer.split(b"\r\n", 1)
    assert status == b"HTTP/1.1 200 OK", answer[:300]
    embeddings = load(rest.split(b"\r\n\r\n", 1)[1])
    assert len([k for k in embeddings if k.startswith("item_")]) == len(grid)


def test_a_client_that_leaves_before_its_answer_is_counted_apart_not_as_an_error(tiny_model):
    """A client gives up while its request waits in the queue: the server answers nobody, counts no response and no
    internal error, drops the request from the queue unencoded, and says how many left and how many it dropped, in
    /metrics (valid Prometheus text) and its JSON."""
    service = service_for(tiny_model, start=False)
    with ServerThread(service) as server:
        async def leave():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
                with pytest.raises(asyncio.TimeoutError):
                    await post(session, server.url, pixel_body(*random_request(1)))
            await asyncio.to_thread(wait_until, lambda: service.clients_left == 1 and service.in_server == 0,
                                    "the request to end")
            service.scheduler.start()
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/metrics") as response:
                    text = await response.text()
                async with session.get(server.url + "/metrics?format=json") as response:
                    data = await response.json()
            return text, data
        text, data = run(leave())
    families = strict_prometheus(text)
    assert families["glmvit_http_clients_left_total"] == {"glmvit_http_clients_left_total": 1}
    assert "glmvit_http_responses_total" not in families  # the first /metrics is counted once it is answered
    assert data["http"]["clients_left"] == 1 and data["http"]["responses"] == {"200": 1}  # the text /metrics
    assert families["glmvit_scheduler_withdrawn_total"] == {"glmvit_scheduler_withdrawn_total": 1}
    s = data["scheduler"]
    assert (s["withdrawn"], s["batches"], s["failed"], s["outstanding_requests"]) == (1, 0, 0, 0)  # never encoded


def test_graph_compiled_needs_cuda(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--device", "cpu", "--mode", "graph-compiled"])
    assert exit_.value.code == 2 and "graph-compiled needs CUDA" in capsys.readouterr().err


# ---- bench-serve ---------------------------------------------------------------------------------------------------
def test_bench_serve_runs_the_seeds_workload_and_a_sweep_against_a_server(tiny_model, tmp_path, capsys):
    """8-frame 224² clips, one per request (the seed's serve workload, smaller), at rate inf, at a finite rate and
    at half the rate the inf run achieved (run after it, whatever the order given)."""
    service = service_for(tiny_model, config=BudgetConfig((256, 512, 1024), 4, 16))  # a clip: 256 tokens, 4 segments
    out = tmp_path / "serve.json"
    with ServerThread(service) as server:
        assert cli_main(["bench-serve", "--url", server.url, "--workload", "video8x224", "--num-prompts", "6",
                         "--request-rate", "50%,inf,40", "--warmup-requests", "2", "--device", "cpu",
                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result: graph-emulated" in printed and "Time to Embedding" in printed
    record = json.loads(out.read_text())
    saturated = record["runs"][0]["requests_per_s"]
    assert [r["request_rate"] for r in record["runs"]] == ["inf", 40.0, pytest.approx(saturated / 2)]
    assert [r["saturation_share"] for r in record["runs"]] == [None, None, 0.5]
    for run_ in record["runs"]:
        assert (run_["successful"], run_["refused"], run_["failed"]) == (6, 0, 0)
        split = run_["time_split_ms"]  # the server's Server-Timing, and the rest of the time to embedding
        assert list(split) == ["read", "decode", "preprocess", "queue", "host_to_device", "encode", "serialise",
                               "write"] and split["decode"] > 0 and split["preprocess"] > 0
        assert run_["tokens_per_s"] == pytest.approx(256 * run_["items_per_s"])
        assert len(run_["per_request"]["queue_ms"]) == 6 and all(q >= 0 for q in run_["per_request"]["queue_ms"])
        timings = run_["per_request"]["timing_ms"]  # each request's own Server-Timing: the phases before write
        assert len(timings) == 6 and all(list(t) == list(split)[:-1] and min(t.values()) >= 0 for t in timings)
        assert split["queue"] == pytest.approx(sum(t["queue"] for t in timings) / 6)
        assert run_["tte_ms"]["median"] >= run_["queue_ms"]["median"]
        assert run_["server"]["items"] == 6 and run_["server"]["batches"] >= 2  # 4 items at most per batch
    settings = record["settings"]
    assert settings["workload"] == "video8x224" and settings["request_rates"] == ["50%", "inf", 40.0]
    assert settings["body"] == "media" and settings["media"]["video"] in ("mp4", "gif")
    assert service.metrics_json()["http"]["phase_s"]["decode"] > 0  # the clips were decoded by the server
    assert record["workload"]["grids"] == [[[4, 16, 16]]] * 6
    assert "bench-serve" in record["provenance"]["command"] and record["provenance"]["server_command"] == "test"
    assert record["floor"]["graph-emulated"] is None  # this test server measured no floor
    assert load_record(out, ServeRecord).runs[0]["per_request"]["timing_ms"] == record["runs"][0]["per_request"][
        "timing_ms"]  # the typed record reads it back


def test_bench_serve_counts_refusals_apart_from_failures_with_their_reason(tiny_model, tmp_path, capsys):
    service = service_for(tiny_model, max_requests=2)
    entered, release = gated(service)
    releaser = threading.Thread(target=lambda: (wait_until(lambda: service.responses[429] == 4, "four 429s"),
                                                release.set()))
    releaser.start()
    with ServerThread(service) as server:
        assert cli_main(["bench-serve", "--url", server.url, "--bucket-config", "{(224, 224, 1): 1.0}",
                         "--num-prompts", "6", "--warmup-requests", "0", "--device", "cpu", "--body", "pixels",
                         "--json", str(tmp_path / "x.json")]) == 0
    releaser.join(TIMEOUT)
    record = json.loads((tmp_path / "x.json").read_text())
    (run_,) = record["runs"]
    assert (run_["successful"], run_["refused"], run_["failed"]) == (2, 4, 0)
    assert record["settings"]["body"] == "pixels" and record["settings"]["pixel_dtype"] == "float32"
    assert "Refused requests (429, 503):" in capsys.readouterr().out
    ((error, count),) = run_["errors"].items()
    assert count == 4 and error.startswith("HTTP 429: the queue is full")


def test_bench_serve_in_process_and_spawned(tmp_path, capsys):
    common = ["--device", "cpu", "--budgets", "64,256", "--bucket-config", "{(224, 224, 1): 1.0}",
              "--items-per-request", "2", "--num-prompts", "4", "--warmup-requests", "1"]
    assert cli_main(["bench-serve", "--in-process", "--modes", "eager,graph", *common,
                     "--json", str(tmp_path / "a.json")]) == 0
    record = json.loads((tmp_path / "a.json").read_text())
    assert [r["mode"] for r in record["runs"]] == ["eager", "graph-emulated"]
    assert all(r["successful"] == 4 and r["items_per_s"] > 0 for r in record["runs"])
    assert record["floor"]["eager"]["items_per_s"] > 0  # measured here, in-process
    assert cli_main(["bench-serve", "--spawn", "--modes", "graph", *common, "--decode-workers", "1",
                     "--switch-interval-ms", "1", "--json", str(tmp_path / "b.json")]) == 0
    record = json.loads((tmp_path / "b.json").read_text())
    (run_,) = record["runs"]
    assert run_["successful"] == 4 and record["servers"]["graph-emulated"]["url"].startswith("http://127.0.0.1:")
    assert "--budgets 64,256" in record["provenance"]["server_command"]
    assert "--decode-workers 1" in record["provenance"]["server_command"] and record["settings"]["body"] == "media"
    assert "--switch-interval-ms 1.0" in record["provenance"]["server_command"]
    assert record["settings"]["batching"]["switch_interval_ms"] == 1.0
    assert "fingerprint" not in record["servers"]["graph-emulated"]  # merged into the record's own
    assert {"glmvit.model", "glmvit.scheduler"} <= set(record["fingerprint"]["modules"])


@pytest.mark.parametrize("argv, words", [
    (["--url", "http://127.0.0.1:1", "--modes", "eager"], "--modes applies to --spawn and --in-process"),
    (["--url", "127.0.0.1:8000"], "expected http://HOST:PORT"),
    (["--url", "http://127.0.0.1:1", "--decode-workers", "2"], "--decode-workers applies to --spawn"),
    (["--spawn", "--request-rate", "0"], "must be at least 0.01 per second"),
    (["--spawn", "--switch-interval-ms", "0.0001"], "give 0 (leave the interpreter's interval) or 0.001 to 1000 ms"),
    (["--spawn", "--request-rate", "1e-300"], "must be at least 0.01 per second"),
    (["--spawn", "--request-rate", "fast"], "is not a number, inf or a percentage"),
    (["--spawn", "--request-rate", "1e400"], "too large for a float: write inf"),
    (["--spawn", "--request-rate", ",".join(["1"] * 17)], "17 request rates: at most 16"),
    (["--spawn", "--request-rate", "50%"], "needs inf in the sweep"),
    (["--spawn", "--request-rate", "inf,150%"], "lies in (0, 100]%"),
    (["--in-process", "--modes", "graph,turbo"], "unknown mode(s) ['turbo']"),
    (["--spawn", "--modes", "graph-compiled", "--device", "cpu"], "graph-compiled needs CUDA"),
    ([], "one of the arguments --url --spawn --in-process is required"),
    (["--spawn", "--workload", "img8x448", "--items-per-request", "100"], "--items-per-request with --workload"),
    (["--spawn", "--workload", "img1x224", "--bucket-config", "{(448, 448, 1): 1.0}", "--range-ratio", "0.5"],
     "--bucket-config, --range-ratio with --workload"),
])
def test_bench_serve_refuses_bad_arguments_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench-serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_arrivals_are_vllms_gamma_process():
    from glmvit.cli.bench_serve import arrival_offsets

    assert not arrival_offsets(5, float("inf"), 1.0, seed=0).any()
    for burstiness in (1.0, 4.0):  # Poisson (exponential gaps, CV 1) and a steadier process (CV 1/2)
        offsets = arrival_offsets(40_001, 10.0, burstiness, seed=1)
        gaps = np.diff(offsets)
        assert offsets[0] == 0 and (gaps >= 0).all()
        # 40,000 gaps: the sample mean is within 5 standard errors (σ/√n = 0.1/√burstiness/200) of 1/rate
        assert abs(gaps.mean() - 0.1) < 5 * 0.1 / np.sqrt(burstiness) / 200
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


@pytest.mark.gpu
def test_cuda_server_answers_concurrent_clients():
    """The full tower in bf16 behind real graphs: float32 answers within tests/test_gpu.py's bound (from the item's
    own bf16 error) of each item encoded alone, read back through the answering threads' own CUDA streams."""
    from glmvit.random_weights import random_encoder
    from tests.test_gpu import assert_per_item

    model = random_encoder(VisionConfig.glm41v(), "cuda", torch.bfloat16)
    runner = EncoderGraphRunner(model, BudgetConfig((256, 1024), 4, 16), mode="cuda").capture()
    service = EncoderService(BatchScheduler(runner), {"description": "full tower"}, {"command": "test"},
                             HttpLimits(), threads=4)
    requests = [random_batch([[4, 16, 16]] * (1 + j % 2), VisionConfig(), seed=j) for j in range(12)]
    with ServerThread(service) as server:
        async def clients():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(post(session, server.url, pixel_body(*r)) for r in requests))
        answers = run(clients())
    for (pixels, grid), (status, _, body) in zip(requests, answers, strict=True):
        assert status == 200, body
        got = load(body)
        outs = [got[f"item_{i}"] for i in range(len(grid))]
        assert all(out.dtype == torch.float32 for out in outs)  # bf16 values, answered as float32 (exact)
        assert_per_item(model, [out.cuda().bfloat16() for out in outs], pixels.cuda().bfloat16(), grid)


@pytest.mark.parametrize("host", ["127.0.0.1", "256.1.1.1"])
def test_serve_refuses_an_address_it_cannot_listen_on_before_building_the_model(monkeypatch, capsys, host):
    """A port in use or a host that is no address here is a one-line usage error before the model is built and
    its budgets captured (it came only after the whole start-up, after a 'shutting down' line)."""
    import socket

    from glmvit.cli import serve

    monkeypatch.setattr(serve, "build_service", lambda *a, **k: pytest.fail("the model was built first"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            serve.main(["--device", "cpu", "--config", "tiny", "--host", host, "--port", str(port)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--host {host} --port {port}: cannot listen there" in err[0], err


def test_a_client_that_leaves_while_its_request_is_admitted_has_it_withdrawn(tiny_model):
    """The client leaves while the scheduler admits its request (on a thread of the service's pool): once
    admitted, the request is withdrawn from the queue unencoded, as one that left later would be (it was encoded
    and answered for nobody)."""
    service = service_for(tiny_model, start=False)
    inside, release, submit = threading.Event(), threading.Event(), service.scheduler.submit

    def slow_submit(*args):
        inside.set()
        assert release.wait(TIMEOUT)
        return submit(*args)

    service.scheduler.submit = slow_submit
    with ServerThread(service) as server:
        async def leave():
            async with aiohttp.ClientSession() as session:
                sent = asyncio.create_task(post(session, server.url, pixel_body(*random_request(1))))
                await asyncio.to_thread(inside.wait, TIMEOUT)
                sent.cancel()
            await asyncio.to_thread(wait_until, lambda: service.clients_left == 1, "the client to be counted")
            release.set()
            await asyncio.to_thread(wait_until, lambda: service.in_server == 0, "the request to end")
        run(leave())
        stats = service.scheduler.stats
        wait_until(lambda: stats()["submitted"] == 1 and stats()["outstanding_requests"] == 0,
                   "the request to be admitted, then withdrawn")
        s = service.scheduler.stats()
        assert (s["submitted"], s["withdrawn"], s["batches"]) == (1, 1, 0)


def test_a_drain_past_its_timeout_lets_the_encoders_batch_end_before_it_returns(tiny_model):
    """A drain that runs out of time still gives the batch in the encoder a moment to end, so that the worker has
    stopped when the server returns: a worker that ended while the interpreter was exiting (it used torch on its
    own thread) aborted the process (SIGABRT, 'terminate called without an active exception') instead of exit 1."""
    service = service_for(tiny_model)
    entered, release = gated(service)
    closing, close = threading.Event(), service.scheduler.close

    def close_then_note(timeout=None):
        closing.set()
        return close(timeout)

    service.scheduler.close = close_then_note
    threading.Thread(target=lambda: closing.wait(TIMEOUT) and (time.sleep(0.2), release.set()), daemon=True).start()
    server = ServerThread(service, shutdown_timeout=0.3).start()

    async def scenario():
        async with aiohttp.ClientSession() as session:
            in_flight = asyncio.create_task(post(session, server.url, pixel_body(*random_request(1))))
            await asyncio.to_thread(entered.wait, TIMEOUT)  # its batch is in the encoder
            assert await asyncio.to_thread(server.shutdown, TIMEOUT)
            with pytest.raises(aiohttp.ClientError):
                await in_flight
    run(scenario())
    assert server.drained is False and service.abandoned == 1
    assert not service.scheduler._worker.is_alive()


def test_a_server_that_does_not_start_is_stopped_before_its_error():
    """ServerThread.start: a serve coroutine that fails, or never listens within the timeout, leaves no thread
    serving behind the error (a record run would otherwise hang on it)."""
    from glmvit.cli.serve_app import ServerThread

    async def never_listens(service, host, port, shutdown_timeout, on_ready, stop):
        await stop.wait()
        return True

    async def fails(service, host, port, shutdown_timeout, on_ready, stop):
        raise OSError("address in use")

    slow = ServerThread(None, serve=never_listens)
    with pytest.raises(TimeoutError, match="did not start listening within 0.2 s"):
        slow.start(timeout=0.2)
    assert not slow._thread.is_alive() and slow.drained is True
    broken = ServerThread(None, serve=fails)
    with pytest.raises(OSError, match="address in use"):
        broken.start(timeout=5)
    assert not broken._thread.is_alive()


def test_a_server_started_with_a_timeout_is_entered_once_and_drained_on_exit():
    """``with ServerThread(...).start(timeout=…):`` (how the record run waits longer for API servers) enters the
    server already started instead of starting its thread a second time, and the block's end drains it."""
    calls = []

    async def serve(service, host, port, shutdown_timeout, ready, stop):
        calls.append(port)
        ready(f"http://{host}:{port}")
        await stop.wait()
        return True

    server = ServerThread(None, port=1234, serve=serve)  # type: ignore[arg-type]
    with server.start(timeout=10.0) as entered:
        assert entered is server and server.url == "http://127.0.0.1:1234"
    assert calls == [1234] and server.drained is True and not server._thread.is_alive()


def test_a_stopped_server_is_not_entered():
    """``with server:`` after ``start(); shutdown()`` raises instead of entering a server that no longer listens."""

    async def serve(service, host, port, shutdown_timeout, ready, stop):
        ready(f"http://{host}:{port}")
        await stop.wait()
        return True

    server = ServerThread(None, port=1234, serve=serve)  # type: ignore[arg-type]
    server.start(timeout=10.0)
    assert server.shutdown(timeout=10.0)
    with pytest.raises(RuntimeError, match="already stopped, is draining, or failed to start"):
        with server:
            pass


def test_a_server_that_failed_to_start_is_not_entered():
    """``with server:`` after a ``start()`` that raised raises instead of entering the dead server."""

    async def serve(service, host, port, shutdown_timeout, ready, stop):
        raise OSError("address in use")

    server = ServerThread(None, port=1234, serve=serve)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="address in use"):
        server.start(timeout=10.0)
    with pytest.raises(RuntimeError, match="already stopped, is draining, or failed to start"):
        with server:
            pass


def test_a_server_that_ends_before_it_listens_fails_its_start_at_once():
    """A serve function that returns without calling ``ready`` (API servers that did not start) wakes ``start`` at
    once with an error, rather than after its whole timeout with a misleading one."""
    import time

    async def serve(service, host, port, shutdown_timeout, ready, stop):
        return False

    server = ServerThread(None, port=1234, serve=serve)  # type: ignore[arg-type]
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="ended before it listened"):
        server.start(timeout=60.0)
    assert time.monotonic() - began < 10.0 and not server._thread.is_alive()


def test_a_draining_server_is_not_entered():
    """``with server:`` after a ``shutdown`` that timed out (the thread still drains) raises instead of entering."""
    import threading

    release = threading.Event()

    async def serve(service, host, port, shutdown_timeout, ready, stop):
        ready(f"http://{host}:{port}")
        await stop.wait()
        while not release.is_set():  # a drain that takes a while
            await asyncio.sleep(0.01)
        return True

    server = ServerThread(None, port=1234, serve=serve)  # type: ignore[arg-type]
    server.start(timeout=10.0)
    assert not server.shutdown(timeout=0.05)  # still draining
    try:
        with pytest.raises(RuntimeError, match="is draining"):
            with server:
                pass
    finally:
        release.set()
        assert server.shutdown(timeout=10.0)


def test_a_burst_of_connections_waits_in_the_kernel_not_a_second_in_syn_retries(tiny_model):
    """While the event loop is busy, the kernel completes handshakes into the listening socket's queue, up to its
    backlog; past it, a client's SYN is dropped and retried a second later. asyncio's own backlog is 100, less than a
    load generator's burst at rate inf: the server listens with ``BACKLOG``, so 300 connections opened while the loop
    is blocked all complete within half a second."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from glmvit.cli.serve_app import BACKLOG

    assert BACKLOG >= 300
    service = service_for(tiny_model)
    with ServerThread(service) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        loop = server._loop
        assert loop is not None
        loop.call_soon_threadsafe(time.sleep, 2.0)  # the loop accepts nothing for two seconds

        def connect(_):
            began = time.monotonic()
            with socket.create_connection((host, int(port)), timeout=5):
                return time.monotonic() - began

        time.sleep(0.1)
        with ThreadPoolExecutor(64) as pool:
            seconds = list(pool.map(connect, range(300)))
    assert max(seconds) < 0.5, sorted(seconds)[-5:]


def test_the_open_files_limit_is_raised_to_the_hard_one_before_connections_are_counted(monkeypatch):
    """A burst of 1000 requests needs a file per connection: the soft ``ulimit -n`` (often 1024) is raised up to
    the hard limit before the server sizes its connection cap, and never past the hard limit."""
    import resource

    from glmvit.cli import serve_app

    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_, pair):
        limits["soft"], limits["hard"] = pair

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert serve_app.connection_limit(1000) == 1000 and limits == {"soft": 1000 + serve_app.FD_RESERVE, "hard": 4096}
    limits["soft"] = 1024
    assert serve_app.connection_limit(8000) == 4096 - serve_app.FD_RESERVE and limits["soft"] == 4096  # hard: the cap

    def refuse(*_):
        raise ValueError("not permitted")

    limits["soft"] = 1024
    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert serve_app.connection_limit(1000) == 1024 - serve_app.FD_RESERVE  # a sandbox that refuses: sized to it
