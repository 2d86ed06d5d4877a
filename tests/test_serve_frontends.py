"""glmvit serve with several API server processes (``--api-servers``) in front of one engine: the real aiohttp
servers (spawned processes sharing one port) on 127.0.0.1, the engine's scheduler in this process, compared answer
for answer with the one-process server; overload, bad input, a client that leaves, and a SIGINT drain of the
command itself. One engine and its two API servers are shared by the module (each process's start imports torch)."""
import asyncio
import functools
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
from safetensors.torch import load
from test_serve import (
    ONE_BUDGET,
    ROOT,
    TIMEOUT,
    TINY,
    error_of,
    pixel_body,
    post,
    random_request,
    run,
    strict_prometheus,
    wait_until,
)

from glmvit.cli import serve
from glmvit.cli.bench_serve import build_parser as bench_parser
from glmvit.cli.bench_serve import build_workload, check_args, serve_argv
from glmvit.cli.decode_pool import DecodePool
from glmvit.cli.media_files import data_url, encode_clip, encode_image
from glmvit.cli.serve import build_parser as serve_parser
from glmvit.cli.serve import serve_function
from glmvit.cli.serve_app import MEDIA_MODULES, EncoderService, HttpLimits, ServerThread, run_server
from glmvit.cli.serve_frontends import run_frontends, split_workers
from glmvit.cli.serve_media import MediaError
from glmvit.graphs import EncoderGraphRunner
from glmvit.scheduler import BatchScheduler, QueueFull, RequestTooLarge, SchedulerClosed
from glmvit.workloads import random_batch

pytestmark = pytest.mark.timeout(600)
JSON = {"Content-Type": "application/json"}
INFO, PROVENANCE = {"description": "tiny test tower"}, {"command": "test"}
TINY_DTYPE = torch.float32  # the tiny test tower's dtype (?dtype=model)


def service(model, decode, **scheduler_args):
    runner = EncoderGraphRunner(model, ONE_BUDGET, mode="emulate").capture()
    return EncoderService(BatchScheduler(runner, **scheduler_args), INFO, PROVENANCE, HttpLimits(), threads=2,
                          decode=decode, own_decode=True)


def one_server_args(api_servers):
    """``glmvit serve``'s flags for ``api_servers`` processes with two decode workers and two threads."""
    return serve.parse_args(["--device", "cpu", "--api-servers", str(api_servers), "--decode-workers", "2",
                             "--threads", "2"])[1]


def test_the_flags_pick_the_one_process_server_or_the_api_servers():
    """One decision, the same for ``glmvit serve`` and the record run's servers: --api-servers 1 is run_server;
    N > 1 is run_frontends with N processes and the flags' decode workers, queue, timeout and threads."""
    assert serve_function(one_server_args(1)) is run_server
    many = serve_function(one_server_args(3))
    assert isinstance(many, functools.partial) and many.func is run_frontends
    assert {k: many.keywords[k] for k in ("count", "decode_workers", "threads")} == {
        "count": 3, "decode_workers": 2, "threads": 2}


class Servers:
    """The one-process server (``one``) and an engine behind two API servers (``many``, its encoder gated: clear
    ``gate`` to hold the batch it runs, ``entered`` says one came in)."""

    def __init__(self, model):
        self.one_service = service(model, DecodePool(1, 8, 60.0, MEDIA_MODULES).start())
        # the engine's own pool is never started: its API servers decode
        self.engine = service(model, DecodePool(1, 8, 60.0, MEDIA_MODULES), max_requests=2)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        encode = self.engine.scheduler._encode

        def gated(pixels, grids):
            self.entered.set()
            assert self.gate.wait(TIMEOUT)
            return encode(pixels, grids)

        self.engine.scheduler._encode = gated
        self.one = ServerThread(self.one_service, serve=serve_function(one_server_args(1))).start()
        self.many = ServerThread(self.engine, serve=serve_function(one_server_args(2))).start(timeout=300)

    def close(self):
        self.gate.set()
        assert self.many.shutdown(TIMEOUT) and self.many.drained
        self.one.shutdown(TIMEOUT)


@pytest.fixture(scope="module")
def servers(tiny_model):
    both = Servers(tiny_model)
    yield both
    both.close()


def media_bodies():
    """A JSON body of data: URLs (a picture, a clip) and a multipart body of the same files."""
    rng = np.random.default_rng(5)
    image = encode_image(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), "png")
    clip = encode_clip(rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8), "gif")
    json_body = json.dumps({"content": [
        {"type": "image_url", "image_url": {"url": data_url(image, "png")}},
        {"type": "text", "text": "and"},
        {"type": "video_url", "video_url": {"url": data_url(clip, "gif")}}]}).encode()
    form = aiohttp.FormData()
    form.add_field("file", image, filename="a.png")
    form.add_field("file", clip, filename="b.gif")
    return json_body, form


def test_answers_are_the_one_process_servers_bitwise(servers):
    """JSON data: URLs, multipart files and safetensors pixel rows, in float32 and the model's dtype: each answer,
    its body and its headers' names, is the one-process server's; and the answers spread over both API servers."""
    pixels = pixel_body(*random_request(4))

    async def ask(url):
        out = []
        for dtype in ("", "?dtype=model"):
            json_body, form = media_bodies()
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/encode" + dtype, data=json_body, headers=JSON) as response:
                    out.append((response.status, sorted(response.headers), await response.read()))
                async with session.post(url + "/v1/encode" + dtype, data=form) as response:
                    out.append((response.status, sorted(response.headers), await response.read()))
                async with session.post(url + "/v1/encode" + dtype, data=pixels,
                                        headers={"Content-Type": "application/x-safetensors"}) as response:
                    out.append((response.status, sorted(response.headers), await response.read()))
        return out

    one, many = run(ask(servers.one.url)), run(ask(servers.many.url))
    assert [s for s, _, _ in many] == [200] * 6
    for (_, names_one, body_one), (_, names_many, body_many) in zip(one, many, strict=True):
        assert names_many == names_one and body_many == body_one
    assert len(load(many[0][2])) == 2 and load(many[3][2])["item_0"].dtype == TINY_DTYPE

    async def frontends():  # a fresh connection each: the API servers accept on the same sockets
        seen = set()
        for _ in range(40):
            async with aiohttp.ClientSession() as session:
                async with session.get(servers.many.url + "/metrics?format=json") as response:
                    seen.add((await response.json())["http"]["frontend"])
            if len(seen) == 2:
                break
        return seen
    assert run(frontends()) == {"0", "1"}


def test_a_nan_pixel_row_is_a_400_naming_the_item(servers):
    pixels, grid = random_batch([[1, 4, 4], [1, 2, 2]], TINY)
    pixels[-1, 0] = float("nan")

    async def send():
        async with aiohttp.ClientSession() as session:
            return await post(session, servers.many.url, pixel_body(pixels, grid))
    status, error = error_of(run(send()))
    assert status == 400 and "item(s) [1]" in error and "NaN" in error


def test_the_queue_bound_is_a_429_and_the_queued_are_answered(servers):
    """The engine's scheduler holds two requests (one in the encoder, held; one queued): a third is refused with
    the scheduler's reason, from whichever API server took it."""
    small = pixel_body(*random_batch([[1, 2, 2]], TINY))
    servers.gate.clear()
    servers.entered.clear()

    async def overfill():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, servers.many.url, small))
            await asyncio.to_thread(servers.entered.wait, TIMEOUT)
            second = asyncio.create_task(post(session, servers.many.url, small))
            await asyncio.to_thread(wait_until, lambda: servers.engine.scheduler.stats()["outstanding_requests"] == 2,
                                    "two requests in the engine")
            refused = await post(session, servers.many.url, small)
            servers.gate.set()
            return refused, await asyncio.gather(first, second)
    (status, headers, body), done = run(overfill())
    assert status == 429 and headers["Retry-After"] == "1" and "queue is full" in json.loads(body)["error"]
    assert [s for s, _, _ in done] == [200, 200]


def test_a_client_that_leaves_has_its_request_withdrawn(servers):
    """A request queued in the engine whose client gives up is dropped unencoded, as in the one-process server."""
    small = pixel_body(*random_batch([[1, 2, 2]], TINY))
    before = servers.engine.scheduler.stats()
    servers.gate.clear()
    servers.entered.clear()

    async def leave():
        async with aiohttp.ClientSession() as session:
            held = asyncio.create_task(post(session, servers.many.url, small))
            await asyncio.to_thread(servers.entered.wait, TIMEOUT)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as impatient:
                with pytest.raises(asyncio.TimeoutError):
                    await post(impatient, servers.many.url, small)
            await asyncio.to_thread(wait_until, lambda: servers.engine.scheduler.stats()["withdrawn"]
                                    == before["withdrawn"] + 1, "the request to be withdrawn")
            servers.gate.set()
            return await held
    assert run(leave())[0] == 200
    after = servers.engine.scheduler.stats()
    assert after["submitted"] - before["submitted"] == 2 and after["completed"] - before["completed"] == 1


def test_health_info_and_metrics_from_an_api_server(servers):
    async def read():
        async with aiohttp.ClientSession() as session:
            out = []
            for path in ("/health", "/v1/info", "/metrics"):
                async with session.get(servers.many.url + path) as response:
                    out.append((response.status, await response.text()))
            return out
    (s1, health), (s2, info), (s3, text) = run(read())
    assert (s1, s2, s3) == (200, 200, 200)
    assert json.loads(health)["mode"] == "graph-emulated" and json.loads(health)["scheduler"]["max_requests"] == 2
    info = json.loads(info)
    assert info["vision_config"]["out_hidden_size"] == TINY.out_hidden_size and info["fingerprint"]["modules"]
    families = strict_prometheus(text)
    (sample,) = families["glmvit_http_clients_left_total"]  # any API server's: the label names the one that answered
    assert sample.startswith('glmvit_http_clients_left_total{frontend="')
    assert families["glmvit_scheduler_submitted_total"] == {  # the engine's, unlabelled
        "glmvit_scheduler_submitted_total": servers.engine.scheduler.stats()["submitted"]}


def test_statuses_of_errors_are_decided_in_one_place():
    from glmvit.cli.serve_backend import Refused, status_of

    errors = (QueueFull("full"), SchedulerClosed("closed"), RequestTooLarge("large"), ValueError("item 1"),
              MediaError("content[0]: bad", 413), Refused("no room", 507), KeyError("x"))
    assert [status_of(err) for err in errors] == [429, 503, 413, 400, 400, 507, 500]


def test_decode_workers_are_shared_among_api_servers_at_least_one_each():
    assert split_workers(12, 4) == [3, 3, 3, 3] and split_workers(5, 2) == [3, 2] and split_workers(1, 3) == [1, 1, 1]


def test_bench_serve_spawns_the_server_with_its_api_servers():
    argv = ["--spawn", "--workload", "img1x224", "--num-prompts", "2", "--api-servers", "4"]
    parser = bench_parser()
    args = parser.parse_args(argv)
    check_args(parser, args, argv)
    argv = serve_argv(args, "graph", build_workload(args))
    assert argv[argv.index("--api-servers") + 1] == "4"


def test_the_api_servers_default_is_resolved_after_parsing_not_when_the_parser_is_built(monkeypatch):
    """``--help`` and a parse read the same on every host; whoever runs a server resolves the count once
    (``serve.parse_args``) and names it: ``bench-serve --spawn`` passes it to its child and its record."""
    monkeypatch.setattr(serve, "default_api_servers", lambda: 3)
    parser = serve_parser()
    assert parser.parse_args([]).api_servers is None and "here 3" not in parser.format_help()
    assert serve.parse_args(["--device", "cpu"])[1].api_servers == 3
    assert serve.parse_args(["--device", "cpu", "--api-servers", "1"])[1].api_servers == 1
    with pytest.raises(ValueError, match="--api-servers is unresolved"):
        serve_function(parser.parse_args([]))
    argv = ["--spawn", "--workload", "img1x224", "--num-prompts", "2"]
    parser = bench_parser()
    args = parser.parse_args(argv)
    check_args(parser, args, argv)
    child = serve_argv(args, "graph", build_workload(args))
    assert args.api_servers == 3 and child[child.index("--api-servers") + 1] == "3"


CHILD = """
import os, sys, threading
import glmvit.cli.serve as serve, glmvit.cli.serve_link as link
drain = threading.Event()
begin = link.EngineLink.drain
def drain_all(self):
    drain.set()
    begin(self)
link.EngineLink.drain = drain_all
make = serve.make_scheduler
def make_scheduler(*a, **k):  # the encoder holds its batch until the drain has begun: SIGINT lands mid-request
    scheduler, runner = make(*a, **k)
    encode = scheduler._encode
    def held(pixels, grids):
        print("encoding", flush=True)
        assert drain.wait(60)
        return encode(pixels, grids)
    scheduler._encode = held
    return scheduler, runner
serve.make_scheduler = make_scheduler
sys.exit(serve.main(sys.argv[1:]))
"""


def glmvit_shm():
    return {name for name in os.listdir("/dev/shm") if name.startswith("glmvit-frames-")} \
        if os.path.isdir("/dev/shm") else set()


def test_sigint_drains_the_api_servers_answers_what_they_hold_and_exits_0():
    """``serve --api-servers 2`` under SIGINT mid-request: the request (media, decoded by an API server) is
    answered, every process exits, the command exits 0, and no shared-memory folder of its is left."""
    before = glmvit_shm()
    child = subprocess.Popen([sys.executable, "-c", CHILD, "--device", "cpu", "--port", "0", "--budgets", "32",
                              "--no-measure-floor", "--quiet", "--api-servers", "2", "--decode-workers", "2"],
                             cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert "listening on http://127.0.0.1:" in line and "2 API server processes" in line, line + child.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        json_body, _ = media_bodies()
        pids = descendants(child.pid)  # the engine, its API servers and their decoders

        async def scenario():
            async with aiohttp.ClientSession() as session:
                in_flight = asyncio.create_task(post(session, url, json_body, JSON))
                assert await asyncio.to_thread(child.stdout.readline) == "encoding\n"
                child.send_signal(signal.SIGINT)
                return await in_flight
        status, _, body = run(scenario())
        assert child.wait(TIMEOUT) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(TIMEOUT)
    out, err = child.stdout.read(), child.stderr.read()
    assert status == 200 and len(load(body)) == 2 and "stopped" in out, err
    assert err.count("request(s) in the server will finish") == 2  # each API server drained
    left = {name for name in glmvit_shm() - before if int(name.split("-")[2]) in pids}  # not other servers'
    assert not left, f"left in /dev/shm: {left}"


def descendants(pid):
    """``pid`` and the processes it started, and theirs (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def test_an_api_server_that_dies_is_logged_and_the_other_serves_on(tiny_model, caplog):
    """SIGKILL to one of two API servers: the engine says so and serves through the other; its drain then exits
    non-zero (an API server did not end cleanly)."""
    import multiprocessing

    engine = service(tiny_model, DecodePool(1, 8, 60.0, MEDIA_MODULES))
    body = pixel_body(*random_request(2))
    serve = functools.partial(run_frontends, count=2, decode_workers=2, threads=2)
    others = {p.pid for p in multiprocessing.active_children()}  # the module's servers' among them
    with caplog.at_level("WARNING", logger="glmvit.cli.serve_app"):
        server = ServerThread(engine, serve=serve).start(timeout=300)
        try:
            (victim,) = [p for p in multiprocessing.active_children() if p.name == "glmvit-api-1"
                         and p.pid not in others]
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: "API server 1 ended (exit code -9); 1 left" in caplog.text, "the death to be logged")

            async def ask():
                out = []
                for _ in range(6):  # a fresh connection each: every one reaches the API server left
                    async with aiohttp.ClientSession() as session:
                        out.append((await post(session, server.url, body))[0])
                return out
            assert run(ask()) == [200] * 6
        finally:
            assert server.shutdown(TIMEOUT)
    assert server.drained is False and "API server exit codes: 0, -9" in caplog.text


def test_an_answer_crosses_in_a_shared_file(tmp_path):
    """The engine serialises an answer into a file it maps; the API server reads the same bytes back, then the
    file is gone."""
    from glmvit.cli.answer_body import answer_body
    from glmvit.cli.serve_link import AnswerFile

    outputs = [torch.arange(12.0).reshape(3, 4), torch.ones(2, 4)]
    answer = AnswerFile(str(tmp_path))
    rows = answer.rows(answer_body(outputs, torch.float32, {"k": "v"}, answer))
    assert rows.path is not None and list(tmp_path.iterdir()) == [Path(rows.path)]
    body = bytes(rows.tensor().numpy().data)
    assert body == bytes(answer_body(outputs, torch.float32, {"k": "v"})) and not list(tmp_path.iterdir())


# ---- the pipe, its two ends in this process (an engine's EngineLink on a loop of its own thread) --------------
class FakeEngineBackend:
    """A LocalBackend's face: answers of ``size`` bytes written into ``allocate``, after ``delay`` seconds (or
    ``error`` raised)."""

    mode = "fake"

    def __init__(self, size=1 << 16, delay=0.0, error=None):
        self.size, self.delay, self.error = size, delay, error

    async def encode(self, source, dtype, gone=lambda: False, allocate=bytearray):
        from glmvit.cli.serve_backend import Encoded

        if self.delay:
            await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        body = allocate(self.size)
        body[:4] = b"abcd"
        return Encoded(body, 1, 0.0, 0.0, 0.0, [1], 0.0, 0.0, 0.0)

    def stats(self):
        return {"limits": {}}

    def runner_stats(self):
        return None


class PipeEngine:
    """An EngineLink serving ``backend`` on an event loop in a thread, answers under ``folder``."""

    def __init__(self, backend, folder):
        from glmvit.cli.serve_link import EngineLink

        self.loop = asyncio.new_event_loop()
        self.link = EngineLink(backend, folder, lambda: {})
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        async def on_loop():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(TIMEOUT)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)


@pytest.fixture
def pipe_pair():
    import multiprocessing

    engine_end, api_end = multiprocessing.Pipe()
    yield engine_end, api_end
    engine_end.close()
    api_end.close()


def small_prepared(nbytes=64):
    from glmvit.cli.serve_backend import Prepared

    return Prepared(torch.zeros(nbytes // 16, 4), torch.tensor([[1, 2, 2]]), [{}])


def test_without_shared_memory_no_rows_cross_the_pipe_the_request_is_507(pipe_pair):
    """Rows that found no room in shared memory (no folder) fail their request, 507; nothing reaches the engine
    (megabytes through the pipe, sent on both event loops, deadlock them)."""
    from glmvit.cli.serve_backend import NO_ROOM, Refused
    from glmvit.cli.serve_link import RemoteBackend

    engine_end, api_end = pipe_pair

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: None)
        backend.start(lambda: None)
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(backend.encode(small_prepared(1 << 20), "float32"), 2)
        return refused.value
    err = run(ask())
    assert err.status == NO_ROOM == 507 and "shared memory" in str(err) and not engine_end.poll()


def test_an_answer_without_room_in_shared_memory_fails_507(tmp_path):
    from glmvit.cli.serve_backend import NO_ROOM, Refused
    from glmvit.cli.serve_link import AnswerFile

    for folder in (None, str(tmp_path / "missing")):
        with pytest.raises(Refused) as refused:
            AnswerFile(folder)(1 << 20)
        assert refused.value.status == NO_ROOM


def test_several_api_servers_refuse_to_start_without_a_shared_folder(monkeypatch, capsys):
    import types

    from glmvit.cli import serve, serve_frontends
    from glmvit.cli.serve_backend import LocalBackend

    def started(*args):
        raise AssertionError("it went on to start")
    monkeypatch.setattr(serve_frontends, "shared_dir", lambda: None)
    monkeypatch.setattr(serve_frontends, "listen", started)
    engine = types.SimpleNamespace(backend=LocalBackend.__new__(LocalBackend))
    with pytest.raises(RuntimeError, match="--api-servers 2 needs a shared-memory folder"):
        run(run_frontends(engine, count=2))
    monkeypatch.setattr(serve, "no_room", lambda: "/dev/shm has 12 MiB free")
    monkeypatch.setattr(serve, "build_service", started)
    with pytest.raises(SystemExit) as exited:
        serve.main(["--device", "cpu", "--api-servers", "2"])
    assert exited.value.code == 2
    assert "--api-servers 2 needs a shared-memory folder: /dev/shm has 12 MiB free" in capsys.readouterr().err


class Unpicklable(RuntimeError):
    """An exception whose pickle does not load (its __init__ takes two arguments)."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def remote_encode(api_end, folder, source=None, timeout=5.0):
    """A RemoteBackend over ``api_end`` (rows written under ``folder``) encodes ``source``: its Encoded, or the
    exception it raised."""
    from glmvit.cli.serve_link import RemoteBackend

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: folder)
        backend.start(lambda: None)
        try:
            return await asyncio.wait_for(backend.encode(source or small_prepared(), "float32"), timeout)
        except Exception as err:  # noqa: BLE001 - what the test looks at
            return err
    return run(ask())


@pytest.mark.parametrize("error, status, line", [
    (Unpicklable("boom\nsecond line", 7), 500, "internal error: Unpicklable: boom"),
    (QueueFull("queue full"), 429, "queue full"), (SchedulerClosed("closed"), 503, "closed"),
    (RequestTooLarge("too large"), 413, "too large"), (ValueError("item 1: bad\nmore"), 400, "item 1: bad")])
def test_an_engine_error_crosses_as_its_name_line_and_status(tmp_path, pipe_pair, error, status, line):
    """The engine sends an error's class name, first line and status, never the exception (one that does not
    unpickle left its request unanswered)."""
    from glmvit.cli.serve_backend import Refused

    engine_end, api_end = pipe_pair
    engine = PipeEngine(FakeEngineBackend(error=error), str(tmp_path))
    try:
        engine.call(engine.link.attach, "0", engine_end)
        err = remote_encode(api_end, str(tmp_path))
    finally:
        engine.close()
    assert isinstance(err, Refused) and (err.status, str(err)) == (status, line)


def test_a_message_the_api_server_cannot_handle_fails_only_its_request(tmp_path, pipe_pair):
    """A malformed answer fails its own request (500); the next message is read and answered as usual."""
    from glmvit.cli.serve_backend import Refused
    from glmvit.cli.serve_link import RemoteBackend

    engine_end, api_end = pipe_pair

    def engine():
        first, second = engine_end.recv(), engine_end.recv()
        for message in (first, second):
            message[2].discard()
        engine_end.send(("done", first[1]))  # malformed
        engine_end.send(("error", second[1], "QueueFull", "queue full", 429))

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: str(tmp_path))
        backend.start(lambda: None)
        peer = asyncio.create_task(asyncio.to_thread(engine))
        answers = await asyncio.wait_for(asyncio.gather(
            backend.encode(small_prepared(), "float32"), backend.encode(small_prepared(), "float32"),
            return_exceptions=True), 5)
        await peer
        return answers, backend.gone
    answers, gone = run(ask())
    # The two requests race to the pipe, so which one the engine reads first is not fixed: one answer each.
    assert all(isinstance(answer, Refused) for answer in answers) and not gone
    broken, refused = sorted(answers, key=lambda answer: -answer.status)
    assert broken.status == 500 and str(broken).startswith("internal error:")
    assert (refused.status, str(refused)) == (429, "queue full")


def engine_at(backend, folder, engine_end):
    engine = PipeEngine(backend, folder)
    engine.call(engine.link.attach, "0", engine_end)
    return engine


def within(condition, seconds=2.0):
    """Whether ``condition()`` holds now or comes to within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def emptied(folder):
    return within(lambda: not os.listdir(folder))


def test_an_answer_that_comes_as_its_client_leaves_is_removed(tmp_path, pipe_pair):
    """The engine's answer and the client's leaving land in the same pass of the API server's loop: the answer's
    file is removed, not left in shared memory."""
    from glmvit.cli.serve_link import RemoteBackend

    engine_end, api_end = pipe_pair
    engine = engine_at(FakeEngineBackend(), str(tmp_path), engine_end)

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: str(tmp_path))
        backend.start(lambda: None)
        task = asyncio.create_task(backend.encode(small_prepared(), "float32"))
        loop = asyncio.get_running_loop()

        def readable():  # the answer is read, then the client leaves before the request's task resumes
            backend._readable()
            if not backend._waiting:
                task.cancel()
        loop.remove_reader(api_end.fileno())
        loop.add_reader(api_end.fileno(), readable)
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        run(ask())
        assert emptied(tmp_path), os.listdir(tmp_path)
    finally:
        engine.close()


def test_rows_written_as_their_client_leaves_are_removed(tmp_path, pipe_pair, monkeypatch):
    """A safetensors body's rows still being written to shared memory when its client leaves: removed once
    written, never sent."""
    from glmvit.cli.serve_link import RemoteBackend, SharedPrepared

    engine_end, api_end = pipe_pair
    entered, gate, real = threading.Event(), threading.Event(), SharedPrepared.of

    def slow(prepared, folder):
        entered.set()
        assert gate.wait(TIMEOUT)
        return real(prepared, folder)
    monkeypatch.setattr(SharedPrepared, "of", staticmethod(slow))

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: str(tmp_path))
        backend.start(lambda: None)
        task = asyncio.create_task(backend.encode(small_prepared(1 << 16), "float32"))
        assert await asyncio.to_thread(entered.wait, TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
    run(ask())
    assert emptied(tmp_path), os.listdir(tmp_path)
    assert not engine_end.poll()


class GatedPack(FakeEngineBackend):
    """Its answer serialised on a thread that allocates only once ``gate`` is set (``entered``: it waits)."""

    def __init__(self):
        super().__init__()
        self.entered, self.gate, self.allocated = threading.Event(), threading.Event(), threading.Event()

    async def encode(self, source, dtype, gone=lambda: False, allocate=bytearray):
        from glmvit.cli.serve_backend import Encoded

        def pack():
            self.entered.set()
            assert self.gate.wait(TIMEOUT)
            body = allocate(self.size)
            self.allocated.set()
            return body
        body = await asyncio.get_running_loop().run_in_executor(None, pack)
        return Encoded(body, 1, 0.0, 0.0, 0.0, [1], 0.0, 0.0, 0.0)


def test_a_withdraw_while_the_answer_is_allocated_leaves_no_file(tmp_path, pipe_pair):
    from glmvit.cli.serve_link import SharedPrepared

    engine_end, api_end = pipe_pair
    backend = GatedPack()
    engine = engine_at(backend, str(tmp_path), engine_end)
    try:
        api_end.send(("encode", 0, SharedPrepared.of(small_prepared(), str(tmp_path)), "float32"))
        assert backend.entered.wait(TIMEOUT)
        api_end.send(("withdraw", 0))
        assert within(lambda: not engine.call(lambda: dict(engine.link.fronts[0].tasks)))
        backend.gate.set()
        assert backend.allocated.wait(TIMEOUT)
        assert emptied(tmp_path), os.listdir(tmp_path)
    finally:
        backend.gate.set()
        engine.close()


def test_a_request_withdrawn_before_its_task_starts_leaves_nothing(tmp_path, pipe_pair):
    """An encode and its withdraw read in the same pass: its task, cancelled before it ran, is forgotten and its
    rows removed."""
    from glmvit.cli.serve_link import SharedPrepared

    engine_end, api_end = pipe_pair
    api_end.send(("encode", 0, SharedPrepared.of(small_prepared(), str(tmp_path)), "float32"))
    api_end.send(("withdraw", 0))
    engine = engine_at(FakeEngineBackend(delay=0.05), str(tmp_path), engine_end)
    try:
        assert emptied(tmp_path)
        assert within(lambda: not engine.call(lambda: dict(engine.link.fronts[0].tasks)))
    finally:
        engine.close()


def api_service(backend):
    """An API server's application over ``backend`` (no HTTP server: its handlers called as they are)."""
    from glmvit.cli.serve_link import ModelFacts

    return EncoderService(None, INFO, PROVENANCE, HttpLimits(), threads=1,
                          decode=DecodePool(1, 8, 60.0, MEDIA_MODULES), own_decode=False, backend=backend,
                          model=ModelFacts(TINY, TINY_DTYPE), frontend="0")


async def health_and_metrics(service):
    import types

    request = types.SimpleNamespace(query={})
    out = []
    for handler in (service.health, service.describe, service.metrics):
        response = await handler(request)
        out.append((response.status, response.text))
    (health_status, health), (info_status, info), (metrics_status, text) = out
    assert (health_status, info_status, metrics_status) == (200, 200, 200)
    return json.loads(health), json.loads(info), strict_prometheus(text)


def test_health_info_and_metrics_with_an_engine_gone_or_silent(pipe_pair, monkeypatch):
    """/health, /v1/info and /metrics answer within about a second whatever the engine does: its last counters,
    and its state; an engine gone reads as the one-process server draining."""
    from glmvit.cli import serve_link
    from glmvit.cli.serve_link import RemoteBackend

    engine_end, api_end = pipe_pair
    monkeypatch.setattr(serve_link, "REFRESH_TIMEOUT_S", 0.2, raising=False)
    backend = RemoteBackend(api_end, "fake", lambda: None)
    service = api_service(backend)

    async def scenario():
        backend.start(lambda: None)
        silent = await health_and_metrics(service)  # nobody answers: unresponsive, no counters yet
        engine_end.close()
        gone = await health_and_metrics(service)
        return silent, gone
    try:
        (health, info, families), (gone, _, _) = run(scenario())
    finally:
        service.close(1.0)
    assert (health["status"], health["engine"]) == ("ok", "unresponsive") and info["engine"] == "unresponsive"
    assert "glmvit_scheduler_submitted_total" not in families and "glmvit_http_connections" in families
    assert (gone["status"], gone["engine"]) == ("draining", "gone")


def test_requests_in_flight_when_the_engine_goes_are_answered_503(tmp_path, pipe_pair):
    from glmvit.cli.serve_backend import status_of
    from glmvit.cli.serve_link import RemoteBackend

    engine_end, api_end = pipe_pair

    async def ask():
        backend = RemoteBackend(api_end, "fake", lambda: str(tmp_path))
        backend.start(lambda: None)
        asyncio.get_running_loop().call_later(0.2, engine_end.close)
        try:
            await asyncio.wait_for(backend.encode(small_prepared(), "float32"), 5)
        except Exception as err:  # noqa: BLE001 - what the test looks at
            return err
    err = run(ask())
    assert status_of(err) == 503 and "engine is gone" in str(err)


def test_api_servers_share_the_whole_servers_http_bounds(monkeypatch):
    """N API servers hold what one process would: each is started with max_requests, max_held_bytes and the
    decode queue divided by N (at least 1); connections and the decode workers as before."""
    import multiprocessing
    import types

    from glmvit.cli import serve_frontends
    from glmvit.cli.serve_backend import LocalBackend
    from glmvit.cli.serve_media import MediaLimits

    started = []

    class Process:  # records what it would start, and starts nothing
        def __init__(self, target, args, name):
            started.append(args[0])

        def start(self):
            if len(started) == count:
                raise RuntimeError("recorded")

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False
        exitcode = 0
    context = types.SimpleNamespace(Pipe=multiprocessing.Pipe, Process=Process)
    monkeypatch.setattr(serve_frontends.multiprocessing, "get_context", lambda kind: context)
    backend = LocalBackend.__new__(LocalBackend)
    backend.scheduler = types.SimpleNamespace(mode="fake")
    engine = types.SimpleNamespace(limits=HttpLimits(max_requests=10, max_held_bytes=1000, max_connections=64),
                                   media=MediaLimits(), info={}, provenance={}, extra_health={}, rows="device",
                                   model=types.SimpleNamespace(config=TINY, dtype=torch.float32), backend=backend,
                                   close=lambda timeout: True)
    shares = []
    for count, workers, queue in ((4, 5, 1024), (16, 16, 8)):
        started.clear()
        with pytest.raises(RuntimeError, match="recorded"):
            run(run_frontends(engine, count=count, decode_workers=workers, decode_queue=queue, shutdown_timeout=0))
        shares.append([(s.limits.max_requests, s.limits.max_held_bytes, s.limits.max_connections, s.decode_queue,
                        s.decode_workers) for s in started])
    assert shares[0] == [(2, 250, 64, 256, 2)] + [(2, 250, 64, 256, 1)] * 3
    assert shares[1] == [(1, 62, 64, 1, 1)] * 16


def test_each_api_server_that_ends_is_logged_once_whatever_the_order(monkeypatch, caplog):
    """API server 1 ends, then 0: each is joined and logged once (then none is left: the engine stops)."""
    import multiprocessing
    import types

    from glmvit.cli import serve_frontends
    from glmvit.cli.serve_backend import LocalBackend
    from glmvit.cli.serve_media import MediaLimits

    links, joined = [], []

    class Link:  # the API servers' ends, each ready at once
        def __init__(self, backend, folder, fingerprint, on_change):
            self.fronts, self.on_change = [], on_change
            links.append(self)

        def attach(self, name, conn):
            self.fronts.append(types.SimpleNamespace(name=name, conn=conn, url="http://x", done=False))

        def drain(self):
            pass

        @property
        def live(self):
            return sum(not f.done for f in self.fronts)

    class Process:
        def __init__(self, target, args, name):
            self.name, self.exitcode = name, -9 if name.endswith("1") else 0

        def start(self):
            pass

        def join(self, timeout=None):
            joined.append(self.name)

        def is_alive(self):
            return False
    context = types.SimpleNamespace(Pipe=multiprocessing.Pipe, Process=Process)
    monkeypatch.setattr(serve_frontends.multiprocessing, "get_context", lambda kind: context)
    monkeypatch.setattr(serve_frontends, "EngineLink", Link)
    backend = LocalBackend.__new__(LocalBackend)
    backend.scheduler = types.SimpleNamespace(mode="fake")
    engine = types.SimpleNamespace(limits=HttpLimits(), media=MediaLimits(), info={}, provenance={}, extra_health={},
                                   rows="device",
                                   model=types.SimpleNamespace(config=TINY, dtype=torch.float32), backend=backend,
                                   close=lambda timeout: True)

    async def scenario():
        ready = asyncio.Event()
        serving = asyncio.create_task(run_frontends(engine, count=2, shutdown_timeout=0,
                                                    on_ready=lambda url: ready.set()))
        await asyncio.wait_for(ready.wait(), 5)
        for name in (1, 0):
            links[0].fronts[name].done = True
            links[0].on_change()
            for _ in range(50):
                if f"API server {name} ended" in caplog.text:
                    break
                await asyncio.sleep(0.01)
        return await asyncio.wait_for(serving, 5)
    with caplog.at_level("WARNING", logger="glmvit.cli.serve_app"):
        assert run(scenario()) is False
    assert caplog.text.count("API server 1 ended (exit code -9); 1 left") == 1
    assert caplog.text.count("API server 0 ended (exit code 0); 0 left") == 1
    assert "glmvit-api-0" in joined and "glmvit-api-1" in joined


@pytest.mark.parametrize("where", ["outside", "symlink", "bytes"])
def test_the_engine_opens_only_its_own_shared_files(tmp_path, pipe_pair, caplog, where):
    """Rows named outside the engine's folder, or a symbolic link in it, or bytes through the pipe: the request
    fails (500), logged, and the file named is neither read nor removed."""
    from glmvit.cli.pixel_rows import PixelRows
    from glmvit.cli.serve_link import SharedPrepared

    engine_end, api_end = pipe_pair
    folder, other = tmp_path / "shared", tmp_path / "other"
    folder.mkdir()
    other.mkdir()
    victim = other / "precious"
    victim.write_bytes(bytes(256))
    if where == "symlink":
        (folder / "link").symlink_to(victim)
    rows = {"outside": PixelRows((16, 4), "float32", path=str(victim)),
            "symlink": PixelRows((16, 4), "float32", path=str(folder / "link")),
            "bytes": PixelRows((16, 4), "float32", data=bytes(256))}[where]
    engine = engine_at(FakeEngineBackend(), str(folder), engine_end)
    try:
        with caplog.at_level("WARNING", logger="glmvit.cli.serve_app"):
            api_end.send(("encode", 0, SharedPrepared(rows, np.array([[1, 2, 2]]), [{}]), "float32"))
            assert api_end.poll(TIMEOUT)
            reply = api_end.recv()
    finally:
        engine.close()
    assert reply[0] == "error" and reply[-1] == 500, reply
    assert victim.read_bytes() == bytes(256)
    assert ("not a file of this server's" if where != "symlink" else "failed") in caplog.text


def test_a_port_in_use_fails_the_start_as_the_one_process_servers_does(monkeypatch):
    """The engine binds and listens itself: a port another server already listens on (even one that allows port
    sharing) is EADDRINUSE before any API server starts."""
    import errno
    import socket
    import types

    from glmvit.cli import serve_frontends
    from glmvit.cli.serve_backend import LocalBackend

    def started(*args, **kwargs):
        raise AssertionError("an API server was started")
    context = types.SimpleNamespace(Pipe=started, Process=started)
    monkeypatch.setattr(serve_frontends.multiprocessing, "get_context", lambda kind: context)
    backend = LocalBackend.__new__(LocalBackend)
    backend.scheduler = types.SimpleNamespace(mode="fake")
    engine = types.SimpleNamespace(backend=backend)
    other = socket.socket()
    try:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError) as refused:
            run(run_frontends(engine, "127.0.0.1", other.getsockname()[1], count=2))
    finally:
        other.close()
    assert refused.value.errno == errno.EADDRINUSE


def test_port_0_is_one_port_on_every_address():
    from glmvit.cli.serve_frontends import listen

    for host, copies in (("127.0.0.1", 1), ("localhost", 1), ("", 1), ("", 3)):
        sockets = [s for copy in listen(host, 0, copies=copies) for s in copy]
        try:
            assert len({s.getsockname()[1] for s in sockets}) == 1 and all(s.getsockname()[1] for s in sockets)
        finally:
            for s in sockets:
                s.close()


def test_each_api_server_gets_its_own_copy_and_the_kernel_spreads_a_burst_evenly():
    """One copy per API server, on one port, bound with SO_REUSEPORT: a burst of connections lands on every copy
    about equally (a hash of each connection's addresses picks the copy), whoever is awake. 300 connections over 3
    copies: 100 each expected, a standard deviation of about 8, so at least 50 each is certain in practice. A socket
    shared by every API server gave one of four 1 connection of 400 and another 181."""
    import select
    import socket

    from glmvit.cli.serve_frontends import listen

    copies = listen("127.0.0.1", 0, copies=3, backlog=512)
    sockets = [copy[0] for copy in copies]
    clients: list[socket.socket] = []
    try:
        assert len({s.getsockname()[1] for s in sockets}) == 1 and all(len(copy) == 1 for copy in copies)
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in sockets)
        port = sockets[0].getsockname()[1]
        for _ in range(300):
            clients.append(socket.create_connection(("127.0.0.1", port)))
        accepted = [0] * len(sockets)
        while sum(accepted) < 300 and select.select(sockets, [], [], 5.0)[0]:
            for k, s in enumerate(sockets):
                try:
                    s.accept()[0].close()
                    accepted[k] += 1
                except BlockingIOError:
                    pass
        assert sum(accepted) == 300 and min(accepted) >= 50, accepted
    finally:
        for s in clients + sockets:
            s.close()


def test_copies_refuse_a_port_that_a_port_sharing_server_listens_on():
    """The copies share the port with each other, not with a server already listening on it: even one whose socket
    allows port sharing (SO_REUSEPORT, same user) makes the start fail with EADDRINUSE, and nothing is left bound."""
    import errno
    import socket

    from glmvit.cli.serve_frontends import listen

    other = socket.socket()
    try:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(OSError) as refused:
            listen("127.0.0.1", port, copies=2)
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        other.close()
    copies = listen("127.0.0.1", port, copies=2)  # released: the port is free once its holder closes
    for copy in copies:
        for s in copy:
            s.close()


def test_several_copies_are_refused_where_so_reuseport_does_not_spread_connections(monkeypatch):
    """Only Linux spreads a port's connections over SO_REUSEPORT copies: elsewhere several copies would leave one API
    server with every connection (macOS) or fail on a missing option (Windows), so listen says what to run instead."""
    from glmvit.cli import serve_frontends

    monkeypatch.setattr(serve_frontends.sys, "platform", "darwin")
    with pytest.raises(RuntimeError, match=r"--api-servers 1"):
        serve_frontends.listen("127.0.0.1", 0, copies=2)
    for copy in serve_frontends.listen("127.0.0.1", 0, copies=1):  # one copy needs no port sharing
        for s in copy:
            s.close()
