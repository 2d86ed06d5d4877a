"""``glmvit serve --rows host``: the decode workers make each request's pixel rows (in the model's dtype) and hand
them over in shared memory; the engine only copies them to its device. The rows are bitwise those the engine makes
from the frames (``--rows device``), rows of another dtype are refused, not cast, and without a shared folder the
frames go as before. The real aiohttp server on 127.0.0.1, over HTTP: one process, and an engine behind two API
server processes."""
import json
import os
import time

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import load
from test_serve import ONE_BUDGET, TIMEOUT, post, run
from test_serve_media import image_part, media_files, video_part

from glmvit.cli import bench_serve, serve, serve_backend, serve_media
from glmvit.cli.decode_pool import DecodePool
from glmvit.cli.media_files import mp4_available
from glmvit.cli.pixel_rows import PixelRows
from glmvit.cli.serve_app import MEDIA_MODULES, EncoderService, HttpLimits, ServerThread
from glmvit.cli.serve_frontends import FrontendSpec, frontend_specs
from glmvit.cli.serve_media import MediaLimits, prepare_item, prepare_media
from glmvit.graphs import EncoderGraphRunner
from glmvit.scheduler import BatchScheduler

pytestmark = pytest.mark.timeout(600)
JSON = {"Content-Type": "application/json"}
KINDS = {"e.mp4": "video", "f.gif": "video"}  # media_files' clips; the rest are pictures


def uploads():
    """media_files() as (name, bytes): a JPEG, a PNG, a WebP, a still GIF, an MP4 clip (with PyAV) and a GIF clip."""
    return [(name, data) for name, data, _ in media_files()]


def same_bits(a, b):
    """Bitwise equal: the same dtype and shape, the same bytes (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def pool():
    """Two decode processes shared by this module's one-process servers (each start imports torch: seconds)."""
    decode = DecodePool(2, 8, 60.0, MEDIA_MODULES).start()
    yield decode
    decode.close(30)


# ---- the worker's rows --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_made_in_the_worker_are_the_engines_rows_bitwise(tmp_path, dtype):
    """Every kind of item (pictures, an MP4 and a GIF clip): the rows the worker writes are those the engine makes
    from the frames, in the dtype asked for; the file holds the rows themselves, and is gone once they are taken."""
    name = str(dtype).removeprefix("torch.")
    frames = prepare_media("files", uploads(), MediaLimits(), 4, folder=str(tmp_path))
    made = prepare_media("files", uploads(), MediaLimits(), 4, folder=str(tmp_path), rows=name)
    assert frames.made is None and frames.frames.dtype == "uint8"
    assert made.made == name and made.frames.dtype == name and made.frames.path is not None
    count = int(made.grid_thw.prod(axis=1).sum())
    assert made.frames.shape == (count, 1176)
    assert os.path.getsize(made.frames.path) == count * 1176 * dtype.itemsize
    assert made.shapes == frames.shapes and made.kinds == frames.kinds and made.records == frames.records
    assert same_bits(made.rows("cpu", dtype), frames.rows("cpu", dtype))
    assert os.listdir(tmp_path) == []


def test_a_video_is_made_a_temporal_patch_at_a_time_a_picture_whole(tmp_path, monkeypatch):
    """The worker holds one temporal patch's rows at most (each written as it is made): a clip's frames go to
    rows_from_frames two at a time, a picture's its one frame."""
    calls = []
    real = serve_media.rows_from_frames

    def counted(frames, kind, dtype=torch.float32, levels=None):
        calls.append((kind, frames.shape[0]))
        return real(frames, kind, dtype, levels)

    monkeypatch.setattr(serve_media, "rows_from_frames", counted)
    files = [f for f in uploads() if f[0] in ("a.jpg", "e.mp4", "f.gif")]
    made = prepare_media("files", files, MediaLimits(), 4, folder=str(tmp_path), rows="bfloat16")
    assert made.made == "bfloat16"
    frames_per_item = [shape[0] for shape in made.shapes]
    want = [(kind, 1 if kind == "image" else 2) for kind, frames in zip(made.kinds, frames_per_item, strict=True)
            for _ in range(1 if kind == "image" else frames // 2)]
    assert calls == want and sum(n for kind, n in calls if kind == "video") == sum(frames_per_item[1:])
    made.frames.discard()


def test_the_workers_rows_count_in_its_preprocess_time(tmp_path, monkeypatch):
    """Server-Timing's preprocess is the worker's resize and, with host rows, their making (each made slow here)."""
    real = serve_media.rows_from_frames

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(serve_media, "rows_from_frames", slow)
    frames = prepare_media("files", uploads()[:1], MediaLimits(), 4, folder=str(tmp_path))
    made = prepare_media("files", uploads()[:1], MediaLimits(), 4, folder=str(tmp_path), rows="bfloat16")
    assert made.timing["preprocess"] - frames.timing["preprocess"] >= 0.04
    frames.frames.discard()
    made.frames.discard()


def test_a_decode_worker_makes_the_rows_in_its_own_process(pool, tmp_path):
    """prepare_item as the server runs it, in a decode process: the rows come back made (``made``), bitwise the
    frames' rows the same task gives without ``rows``."""
    items = serve_media.media_items("files", uploads())
    for k, item in enumerate(items):
        left = MediaLimits().max_request_pixels
        made = pool.submit(prepare_item, k, item, MediaLimits(), left, 4, str(tmp_path), "bfloat16").result(TIMEOUT)
        frames = pool.submit(prepare_item, k, item, MediaLimits(), left, 4, str(tmp_path)).result(TIMEOUT)
        assert made.made == "bfloat16" and frames.made is None, item[0]
        assert made.timing["preprocess"] > 0 and made.pixels == frames.pixels
        assert same_bits(made.rows("cpu", torch.bfloat16), frames.rows("cpu", torch.bfloat16)), item[0]
    assert os.listdir(tmp_path) == []


def test_rows_made_in_another_dtype_are_refused_in_one_line_never_cast(tmp_path):
    made = prepare_media("files", uploads()[:1], MediaLimits(), 4, folder=str(tmp_path), rows="bfloat16")
    with pytest.raises(ValueError) as err:
        made.rows("cpu", torch.float32)
    message = str(err.value)
    assert "\n" not in message and "made the pixel rows in bfloat16, the model takes float32" in message
    assert os.listdir(tmp_path) == []  # the refused rows' file is removed


def test_without_a_shared_folder_or_room_in_it_the_worker_hands_over_frames(tmp_path):
    """Rows through the pipe would cost more than they save: without a folder the worker hands over the uint8
    frames, as it does where the rows' write fails (here: a folder that is not there); the rows from them are the
    same, silently."""
    want = prepare_media("files", uploads(), MediaLimits(), 4, folder=str(tmp_path)).rows("cpu", torch.bfloat16)
    for folder in (None, str(tmp_path / "gone")):
        media = prepare_media("files", uploads(), MediaLimits(), 4, folder=folder, rows="bfloat16")
        assert media.made is None and media.frames.dtype == "uint8" and media.frames.data is not None, folder
        assert same_bits(media.rows("cpu", torch.bfloat16), want), folder
    assert os.listdir(tmp_path) == []


def test_streamed_rows_are_one_tensor_and_a_bad_chunk_leaves_no_file(tmp_path):
    chunks = [torch.randn(3, 8).to(torch.bfloat16), torch.randn(5, 8).to(torch.bfloat16)]
    rows = PixelRows.streamed(iter(chunks), str(tmp_path))
    assert rows is not None and rows.shape == (8, 8) and rows.dtype == "bfloat16"
    assert same_bits(rows.tensor(), torch.cat(chunks)) and os.listdir(tmp_path) == []
    assert PixelRows.streamed(iter([]), str(tmp_path)) is None and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="width 8"):
        PixelRows.streamed(iter([chunks[0], torch.zeros(2, 4, dtype=torch.bfloat16)]), str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_the_rows_dtype_is_the_models_and_host_rows_only(tiny_model):
    """What the server tells a decode task: the model dtype's name with rows="host", None with "device"; any other
    setting is refused when the service is made."""
    runner = EncoderGraphRunner(tiny_model, ONE_BUDGET, mode="emulate").capture()
    decode = DecodePool(1, 1, 1.0, MEDIA_MODULES)  # never started
    for rows, want in (("host", str(tiny_model.dtype).removeprefix("torch.")), ("device", None)):
        service = EncoderService(BatchScheduler(runner), {}, {}, decode=decode, rows=rows)
        assert service._rows_dtype() == want
        service.close(5)
    scheduler = BatchScheduler(runner)
    with pytest.raises(ValueError, match="rows must be one of device, host"):
        EncoderService(scheduler, {}, {}, decode=decode, rows="gpu")
    scheduler.close()


# ---- over HTTP --------------------------------------------------------------------------------------------------
def rows_service(model, pool, rows, own_decode=False):
    runner = EncoderGraphRunner(model, ONE_BUDGET, mode="emulate").capture()
    return EncoderService(BatchScheduler(runner), {"description": "tiny test tower"}, {"command": "test"},
                          HttpLimits(), threads=2, decode=pool, rows=rows, own_decode=own_decode)


def json_body():
    """A JSON request of a picture and a clip (an MP4 where PyAV is, else a GIF), one item each."""
    files = {name: url for name, _, url in media_files()}
    clip = "e.mp4" if mp4_available() else "f.gif"
    return json.dumps({"content": [image_part(files["a.jpg"]), video_part(files[clip])]}).encode()


@pytest.fixture
def handed(monkeypatch):
    """What the engine's rows step was handed, per request: each item's ``made``."""
    seen = []
    real = serve_backend.device_rows

    def spy(media, device, dtype):
        seen.append([m.made for m in media.items])
        return real(media, device, dtype)

    monkeypatch.setattr(serve_backend, "device_rows", spy)
    return seen


async def ask(url):
    """The JSON body in float32 and the model's dtype, then /health and /v1/info."""
    async with aiohttp.ClientSession() as session:
        answers = [await post(session, url, json_body(), JSON, params=params)
                   for params in ({}, {"dtype": "model"})]
        said = []
        for path in ("/health", "/v1/info"):
            async with session.get(url + path) as response:
                said.append(await response.json())
    return answers, said


def timing(headers):
    return dict(part.split(";dur=") for part in headers["Server-Timing"].split(", "))


def test_one_process_answers_with_host_rows_are_the_device_rows_answers(tiny_model, pool, handed):
    """The same requests to a server of each setting: the same answers, bit for bit; the host server's engine was
    handed rows made in a worker (the device server's, frames); /health and /v1/info say where rows are made;
    Server-Timing still splits the request (the worker's rows in preprocess)."""
    out = {}
    for rows in ("device", "host"):
        with ServerThread(rows_service(tiny_model, pool, rows)) as server:
            out[rows] = run(ask(server.url))
    model = str(tiny_model.dtype).removeprefix("torch.")
    assert handed == [[None, None]] * 2 + [[model, model]] * 2
    for k in range(2):
        (status_d, headers_d, body_d), (status_h, headers_h, body_h) = out["device"][0][k], out["host"][0][k]
        assert status_d == status_h == 200, (body_d[:200], body_h[:200])
        assert body_h == body_d and len(load(body_h)) == 2
        assert set(timing(headers_h)) == set(timing(headers_d)) >= {"decode", "preprocess", "queue", "encode"}
    for rows in ("device", "host"):
        health, info = out[rows][1]
        assert health["rows"] == rows and info["rows"] == rows


def test_api_servers_with_host_rows_answer_as_one_process(tiny_model, pool, handed):
    """``--api-servers 2 --rows host``: the API servers' decode workers make the rows (their engine is handed them
    made), and the answers are the one-process device server's."""
    with ServerThread(rows_service(tiny_model, pool, "device")) as server:
        want = run(ask(server.url))[0]
    args = serve.parse_args(["--device", "cpu", "--api-servers", "2", "--decode-workers", "2", "--threads", "2",
                             "--rows", "host"])[1]
    assert args.rows == "host"
    engine = rows_service(tiny_model, DecodePool(1, 8, 60.0, MEDIA_MODULES), args.rows, own_decode=True)
    with ServerThread(engine, serve=serve.serve_function(args)).start(timeout=300) as server:
        got, (health, info) = run(ask(server.url))
    assert [[s for s, _, _ in want], [s for s, _, _ in got]] == [[200, 200]] * 2
    assert [b for _, _, b in got] == [b for _, _, b in want]
    model = str(tiny_model.dtype).removeprefix("torch.")
    assert handed[-2:] == [[model, model]] * 2 and health["rows"] == info["rows"] == "host"


def test_each_api_server_is_told_where_rows_are_made(tiny_model):
    runner = EncoderGraphRunner(tiny_model, ONE_BUDGET, mode="emulate").capture()
    decode = DecodePool(1, 1, 1.0, MEDIA_MODULES)
    service = EncoderService(BatchScheduler(runner), {}, {}, decode=decode, rows="host")
    specs = frontend_specs(service, "127.0.0.1", 0, 2, 2, 8, 30.0, 2, 5.0, "/dev/shm/x")
    assert [s.rows for s in specs] == ["host", "host"] and all(isinstance(s, FrontendSpec) for s in specs)
    service.close(5)


# ---- bench-serve and the record ----------------------------------------------------------------------------------
def test_bench_serve_spawns_its_server_with_rows_and_its_record_names_them():
    """--rows is the spawned server's flag: passed to it, dropped from a client's argv (the record run sends its
    clients at a URL), refused without --spawn, and resolved to the server's default when left out."""
    def spawned(*extra):
        argv = ["--spawn", "--workload", "img1x224", "--num-prompts", "2", *extra]
        parser = bench_serve.build_parser()
        args = parser.parse_args(argv)
        bench_serve.check_args(parser, args, argv)
        return args, bench_serve.serve_argv(args, "graph", bench_serve.build_workload(args))

    args, argv = spawned("--rows", "host")
    assert argv[argv.index("--rows") + 1] == "host" and serve.parse_args(argv[4:])[1].rows == "host"
    args, argv = spawned()
    assert args.rows == "device" and argv[argv.index("--rows") + 1] == "device"
    assert bench_serve.client_argv(["--workload", "x", "--rows", "host", "--rows=device", "--seed", "1"]) == [
        "--workload", "x", "--seed", "1"]
    parser = bench_serve.build_parser()
    for target in (["--url", "http://127.0.0.1:9"], ["--in-process"]):
        argv = [*target, "--workload", "img1x224", "--rows", "host"]
        with pytest.raises(SystemExit):
            bench_serve.check_args(parser, parser.parse_args(argv), argv)


def test_bench_serve_spawns_its_server_with_uniform_lengths_and_a_client_at_a_url_drops_them():
    """--uniform-lengths reaches the spawned server (and names itself in the record's settings); a client sent at a
    URL (the record run's) drops it; given with --url it is refused: the running server has its own."""
    argv = ["--spawn", "--workload", "img1x224", "--num-prompts", "2", "--uniform-lengths", "1024,256"]
    parser = bench_serve.build_parser()
    args = parser.parse_args(argv)
    bench_serve.check_args(parser, args, argv)
    child = bench_serve.serve_argv(args, "graph", bench_serve.build_workload(args))
    assert child[child.index("--uniform-lengths") + 1] == "256,1024"
    assert serve.parse_args(child[4:])[1].uniform_lengths == (256, 1024)
    assert bench_serve.client_argv(["--workload", "x", "--uniform-lengths", "256", "--seed", "1"]) == [
        "--workload", "x", "--seed", "1"]
    argv = ["--url", "http://127.0.0.1:9", "--workload", "img1x224", "--uniform-lengths", "256"]
    with pytest.raises(SystemExit):
        bench_serve.check_args(parser, parser.parse_args(argv), argv)


@pytest.mark.parametrize(("flags", "measured", "choice", "lengths"), [
    ([], True, "auto", (256,)), ([], False, "auto", ()), (["--uniform-graphs", "off"], True, "off", ()),
    (["--attn-backend", "triton"], True, "auto", ()), (["--modes", "eager"], True, "auto", ()),
    (["--uniform-lengths", "1024"], True, "given", (1024,))])
def test_bench_serve_captures_uniform_graphs_for_its_workload_s_lengths_as_bench_does(monkeypatch, flags, measured,
                                                                                      choice, lengths):
    """By default the server bench-serve starts, or its in-process scheduler, gets uniform graphs for the
    workload's segment lengths (8-frame 224² clips: 256-row frame pairs) where the rule was measured (CUDA in half
    precision, stood in for by patching glmvit.uniform.uniform_graphs_pay), the lengths bench would capture; none
    with --uniform-graphs off, an attention backend named or eager alone (it replays no graph); --uniform-lengths
    names its own, and with --uniform-graphs too is refused, as either is with --url; a client sent at a URL drops
    --uniform-graphs in both spellings."""
    from glmvit import uniform

    monkeypatch.setattr(uniform, "uniform_graphs_pay", lambda device, dtype: measured)
    for target in (["--spawn"], ["--in-process"]):
        argv = [*target, "--workload", "video8x224", "--num-prompts", "3", "--device", "cpu", *flags]
        parser = bench_serve.build_parser()
        args = parser.parse_args(argv)
        bench_serve.check_args(parser, args, argv)
        workload = bench_serve.build_workload(args)
        assert bench_serve.resolve_uniform(args, workload) == choice and tuple(args.uniform_lengths) == lengths
        child = bench_serve.serve_argv(args, "graph", workload)
        assert ("--uniform-lengths" in child) == bool(lengths)
    for argv in (["--spawn", "--workload", "video8x224", "--uniform-lengths", "256", "--uniform-graphs", "off"],
                 ["--url", "http://127.0.0.1:9", "--workload", "video8x224", "--uniform-graphs", "off"]):
        with pytest.raises(SystemExit):
            bench_serve.check_args(parser, parser.parse_args(argv), argv)
    for sent in (["--uniform-graphs", "off"], ["--uniform-graphs=off"]):
        assert bench_serve.client_argv(["--workload", "x", *sent, "--seed", "1"]) == ["--workload", "x", "--seed", "1"]


def test_the_rows_host_job_is_the_default_serve_jobs_load_with_host_rows():
    """The A/B that decides --rows' default: serve_video8x224's load, graph-compiled, its server given --rows host;
    the merged record names it and the README table marks it."""
    from glmvit.cli import recorder
    from tools.readme_results import SERVE_RECORDS, serve_label

    jobs = {j.name: j for j in recorder.jobs()}
    job, base = jobs["serve_video8x224_rows_host"], jobs["serve_video8x224"]
    assert job.argv == (*base.argv, "--rows", "host") and job.modes == ("graph-compiled",)
    assert job.name in SERVE_RECORDS
    part = json.loads((recorder.REPO / "data" / "bench" / "serve_video8x224.json").read_text())
    merged = recorder.merge_serve([part], job, {"api_servers": 4, "decode_workers": 12, "rows": "host"})
    settings = merged.settings if isinstance(merged.settings, dict) else merged.settings.model_dump()
    assert settings["batching"]["rows"] == "host" and "--rows host" in settings["servers"]
    assert serve_label(settings) == ", *rows on host*"
    assert serve_label({"batching": {"api_servers": 1, "rows": "device"}}) == ", *one process*"
    assert serve_label({"target": "in-process", "batching": {}}) == ", *in process*"


def test_the_ragged_job_is_the_in_process_load_without_uniform_graphs():
    """The A/B of the uniform graphs where the encoder is what is measured: serve_video8x224_in_process's load with
    --uniform-graphs off; the README marks it. The in-process job captures them for the clips' one segment length
    (a 224² frame pair: 16 × 16 patches) by default."""
    from glmvit.cli import recorder
    from glmvit.workloads import PRESETS
    from tools.readme_results import SERVE_RECORDS, serve_label

    jobs = {j.name: j for j in recorder.jobs()}
    job, base = jobs["serve_video8x224_in_process_ragged"], jobs["serve_video8x224_in_process"]
    assert job.argv[:-2] == (*base.argv[:-2], "--uniform-graphs", "off") and job.modes == base.modes
    assert "--uniform-graphs" not in base.argv and "--uniform-lengths" not in base.argv
    (bucket,) = PRESETS["video8x224"].bucket_config
    assert (bucket[0] // 14) * (bucket[1] // 14) == 256  # the workload's one segment length
    assert job.name in SERVE_RECORDS and base.name in SERVE_RECORDS
    assert serve_label({"target": "in-process", "batching": {"uniform_graphs": "off", "uniform_lengths": []}}) == \
        ", *in process*, *no uniform graphs*"
    assert serve_label({"target": "in-process", "batching": {"uniform_graphs": "auto", "uniform_lengths": [256]}}) \
        == ", *in process*"
    assert serve_label({"batching": {"uniform_graphs": "given", "uniform_lengths": [256]}}) == ", *uniform 256*"
    assert serve_label({"batching": {"uniform_graphs": "auto", "uniform_lengths": [256]}}) == ""


def test_host_rows_cost_the_engine_no_kernel(tmp_path, monkeypatch):
    """The engine's rows step on rows made in a worker maps and copies them: rows_from_frames never runs there."""
    made = prepare_media("files", uploads()[:2], MediaLimits(), 4, folder=str(tmp_path), rows="float32")
    monkeypatch.setattr(serve_media, "rows_from_frames", lambda *a, **k: pytest.fail("rows made again"))
    rows = serve_backend.device_rows(serve_media.RequestMedia([made]), torch.device("cpu"), torch.float32)
    assert rows.shape == (int(np.prod(made.grid_thw, axis=1).sum()), 1176) and os.listdir(tmp_path) == []


def test_rows_host_refuses_to_start_without_a_shared_folder(monkeypatch, capsys):
    """--rows host with no room on /dev/shm would hand frames for every request while saying "host": refused at the
    start, in one line, before the model is built."""
    monkeypatch.setattr(serve, "no_room", lambda: "/dev/shm has 12 MiB free")
    monkeypatch.setattr(serve, "build_service", lambda *a, **k: pytest.fail("it went on to build the service"))
    with pytest.raises(SystemExit) as exited:
        serve.main(["--device", "cpu", "--api-servers", "1", "--rows", "host"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--rows host needs a shared-memory folder: /dev/shm has 12 MiB free (see --help)")


class _SlowMedia(serve_media.RequestMedia):
    """A request's media whose rows take ``seconds`` to make and say when they were made (into ``log``)."""

    def __init__(self, name, log, seconds=0.05):
        super().__init__(items=[])
        self.name, self.log, self.seconds = name, log, seconds

    @property
    def grid_thw(self):
        return np.array([[1, 2, 2]])

    @property
    def records(self):
        return [{"name": self.name}]

    def rows(self, device, dtype):
        self.log.append(("rows", self.name))
        time.sleep(self.seconds)
        return torch.full((4, 1176), float(len(self.log)), dtype=dtype)

    def discard(self):
        pass


class _Scheduler:
    """What LocalBackend asks of a scheduler: its model's device and dtype, submit (logged, answered at once)."""

    def __init__(self, log):
        self.log, self.model = log, torch.nn.Linear(1, 1)
        self.model.device, self.model.dtype = torch.device("cpu"), torch.float32

    def submit(self, pixels, grid, check):
        from concurrent.futures import Future
        from types import SimpleNamespace

        self.log.append(("admit", int(pixels[0, 0].item())))
        done = Future()
        done.set_result(SimpleNamespace(outputs=[pixels[:1]], request_id=len(self.log), queue_s=0.0, total_s=0.0,
                                        stage_s=0.0, batches=[]))
        return done


def test_a_request_is_admitted_as_its_rows_are_made_never_behind_other_requests_rows():
    """Rows and admission are one pool job a request: with one pool thread and three requests at once, each is
    admitted right after its own rows, not after every request's rows (the order two jobs a request would give:
    the admissions queued behind the rows submitted meanwhile, the fill of a busy server)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    log: list = []
    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as answers:
        backend = serve_backend.LocalBackend(_Scheduler(log), pool, answers, lambda out, rec, dtype, alloc: b"ok")

        async def three():
            return await asyncio.gather(*(backend.encode(_SlowMedia(name, log), "model") for name in "abc"))

        encoded = asyncio.run(three())
        pixels = serve_backend.Prepared(torch.ones(4, 1176), torch.tensor([[1, 2, 2]]), [{}])
        sent = asyncio.run(backend.encode(pixels, "model"))
    assert [kind for kind, _ in log] == ["rows", "admit"] * 3 + ["admit"], log
    assert [e.body for e in encoded] == [b"ok"] * 3 and all(e.rows_s >= 0.05 for e in encoded)
    assert sent.rows_s == 0.0 and sent.admit_s >= 0.0  # pixel rows sent as such: no rows made, Encoded's contract
