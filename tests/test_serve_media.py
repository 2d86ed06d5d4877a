"""glmvit serve with media as vLLM's clients send it: JSON content parts of data: URLs (JPEG, PNG, WebP, GIF, MP4),
decoded in worker processes within per-request bounds; load held within byte and token bounds; where a request's
time went; a drain that answers an idle keep-alive connection. The real aiohttp server on 127.0.0.1, over HTTP."""
import asyncio
import base64
import io
import json
import os
import threading
import time

import aiohttp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load
from test_serve import (
    ONE_BUDGET,
    TIMEOUT,
    TINY,
    error_of,
    gated,
    one_past_two_queued,
    pixel_body,
    post,
    random_request,
    run,
    service_for,
    strict_prometheus,
    wait_until,
)

from glmvit.cli.decode_pool import DecodePool
from glmvit.cli.media_files import data_url, encode_clip, encode_image, mp4_available
from glmvit.cli.serve_app import MEDIA_MODULES, EncoderService, HttpLimits, ServerThread
from glmvit.cli.serve_media import MediaLimits
from glmvit.graphs import EncoderGraphRunner
from glmvit.scheduler import BatchScheduler
from glmvit.workloads import random_batch

pytestmark = pytest.mark.timeout(300)
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def pool():
    """Two decode processes shared by this module's servers (each start imports torch: seconds)."""
    decode = DecodePool(2, 8, 60.0, MEDIA_MODULES).start()
    yield decode
    decode.close(30)


def media_service(model, pool, media=None, limits=None, **scheduler_args):
    runner = EncoderGraphRunner(model, ONE_BUDGET, mode="emulate").capture()
    return EncoderService(BatchScheduler(runner, **scheduler_args), {"description": "tiny test tower"},
                          {"command": "test"}, limits or HttpLimits(), threads=2, decode=pool,
                          media=media or MediaLimits())


def noise(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def webp(frame):
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="WEBP", lossless=True)
    return out.getvalue()


def png_of_zeros(side):
    out = io.BytesIO()
    Image.new("RGB", (side, side)).save(out, format="PNG")
    return out.getvalue()


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url):
    return {"type": "video_url", "video_url": {"url": url}}


def media_files():
    """(filename, bytes, data URL) of a JPEG, a PNG, a WebP, a still GIF, an MP4 clip and an animated GIF."""
    jpeg, png, still = encode_image(noise((56, 84, 3), 1)), encode_image(noise((28, 56, 3), 2), "png"), webp(noise(
        (56, 56, 3), 3))
    gif = io.BytesIO()
    Image.fromarray(noise((42, 28, 3), 4)).save(gif, format="GIF")
    clip_gif = encode_clip(noise((4, 28, 28, 3), 5), "gif")
    files = [("a.jpg", jpeg, data_url(jpeg, "jpeg")), ("b.png", png, data_url(png, "png")),
             ("c.webp", still, "data:image/webp;base64," + base64.b64encode(still).decode()),
             ("d.gif", gif.getvalue(), data_url(gif.getvalue(), "gif"))]
    if mp4_available():
        clip = encode_clip(noise((8, 56, 56, 3), 6))
        files.append(("e.mp4", clip, data_url(clip, "mp4")))
    files.append(("f.gif", clip_gif, data_url(clip_gif, "gif")))
    return files


def test_json_content_parts_are_encoded_as_the_same_files_uploaded(tiny_model, pool):
    """Each media part one item, in order, text parts ignored; bitwise what the same files give as multipart
    uploads (which give encode --out's answer: tests/test_serve.py); a chat's messages give the same."""
    files = media_files()
    parts = []
    for k, (name, _, url) in enumerate(files):
        parts.append(video_part(url) if name in ("e.mp4", "f.gif") else image_part(url))
        if k % 2:
            parts.append({"type": "text", "text": "what is this?"})
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": parts[:3]}, {"role": "user", "content": parts[3:]}]}
    with ServerThread(media_service(tiny_model, pool)) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                form = aiohttp.FormData()
                for name, data, _ in files:
                    form.add_field("file", data, filename=name)
                uploaded = await post(session, server.url, form, headers={})
                content = await post(session, server.url, json.dumps({"content": parts}).encode(), JSON)
                messages = await post(session, server.url, json.dumps(chat).encode(), JSON)
                return uploaded, content, messages
        uploaded, content, messages = run(send())
    assert uploaded[0] == content[0] == messages[0] == 200, (uploaded[2][:300], content[2][:300], messages[2][:300])
    want, got, chat_got = load(uploaded[2]), load(content[2]), load(messages[2])
    assert sorted(want) == sorted(got) == sorted(chat_got) == [f"item_{i}" for i in range(len(files))]
    for key in want:
        assert torch.equal(got[key], want[key]) and torch.equal(chat_got[key], want[key]), key
    header = json.loads(content[2][8 : 8 + int.from_bytes(content[2][:8], "little")])["__metadata__"]
    kinds = [json.loads(header[f"item_{i}"])["kind"] for i in range(len(files))]
    assert kinds == ["video" if name in ("e.mp4", "f.gif") else "image" for name, _, _ in files]
    assert "Server-Timing" in content[1]


def test_bad_json_bodies_are_400s_naming_the_part(tiny_model, pool, tmp_path):
    jpeg = encode_image(noise((28, 28, 3), 1))
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "ok.jpg").write_bytes(jpeg)
    (tmp_path / "secret.jpg").write_bytes(jpeg)
    (allowed / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    text = {"type": "text", "text": "hi"}
    cases = {
        "not a data URL": ({"content": [text, text, image_part("abc")]}, 400,
                           "content[2].image_url.url: not a data URL"),
        "http": ({"content": [image_part("https://example.com/a.jpg")]}, 400,
                 "content[0].image_url.url: http(s) URLs are not fetched"),
        "file off": ({"content": [image_part(f"file://{allowed}/ok.jpg")]}, 400, "file:// URLs are off"),
        "bad base64": ({"content": [image_part("data:image/jpeg;base64,@@@")]}, 400, "not valid base64"),
        "type": ({"content": [image_part("data:text/html;base64,aGk=")]}, 400, "media type 'text/html'"),
        "not base64": ({"content": [image_part("data:image/jpeg,abc")]}, 400, "must be base64"),
        "missing url": ({"content": [{"type": "image_url", "image_url": {}}]}, 400, "content[0].image_url.url: field "
                        "required"),
        "unknown part": ({"content": [{"type": "audio_url"}]}, 400, "content[0]: input tag 'audio_url'"),
        "chat part": ({"messages": [{"role": "user", "content": [text, image_part("x")]}]}, 400,
                      "messages[0].content[1].image_url.url: not a data URL"),
        "no media": ({"content": [text]}, 400, "no image_url or video_url parts"),
        "both": ({"content": [], "messages": []}, 400, "exactly one of content"),
        "kind": ({"content": [video_part(data_url(jpeg, "jpeg"))]}, 400, "content[0].video_url: the video_url holds an "
                 "image: send it as image_url"),
        "garbage": ({"content": [image_part(data_url(b"\xff\xd8 not a jpeg", "jpeg"))]}, 400,
                    "content[0].image_url: "),
    }
    with ServerThread(media_service(tiny_model, pool)) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                out = {k: await post(session, server.url, json.dumps(body).encode(), JSON)
                       for k, (body, _, _) in cases.items()}
                out["not json"] = await post(session, server.url, b"{nope", JSON)
                return out
        answers = run(send())
    cases["not json"] = (None, 400, "the body is not JSON")
    for k, (_, status, words) in cases.items():
        got, body = answers[k][0], json.loads(answers[k][2])["error"]
        assert got == status and words in body and "\n" not in body and "glmvit-serve-" not in body, (k, got, body)
    with ServerThread(media_service(tiny_model, pool, MediaLimits(allowed_media_dir=str(allowed)))) as server:
        async def send_files():
            async with aiohttp.ClientSession() as session:
                return [await post(session, server.url, json.dumps({"content": [image_part(url)]}).encode(), JSON)
                        for url in (f"file://{allowed}/ok.jpg", f"file://{allowed}/../secret.jpg",
                                    f"file://{allowed}/link.jpg", f"file://{allowed}/none.jpg",
                                    f"file://{allowed}/ok%00.jpg")]
        inside, outside, link, missing, nul = run(send_files())
    assert inside[0] == 200 and len(load(inside[2])) == 1
    for answer in (outside, link):
        assert answer[0] == 403 and "not under the allowed media directory" in json.loads(answer[2])["error"]
    assert missing[0] == 400 and "no such file" in json.loads(missing[2])["error"]
    assert error_of(nul) == (400, "content[0].image_url.url: the path holds a NUL byte")


def test_a_json_body_is_parsed_in_its_first_items_decode_task_never_in_the_server(tiny_model, pool, monkeypatch):
    """A JSON request of k items is k tasks in the decode pool: the first is handed the body and parses it there
    (a one-item request takes one turn, not a parse's turn and then its item's), the later ones only their items.
    The server's process never parses a body (parsing here is made to fail: the workers are processes of their
    own, which the patch does not reach)."""
    from glmvit.cli import decode_pool, serve_media

    def refused(*_):
        raise AssertionError("a JSON body was parsed in the server's process")

    monkeypatch.setattr(serve_media, "parse_request", refused)
    monkeypatch.setattr(serve_media.EncodeRequest, "model_validate_json", refused)
    tasks: list[tuple] = []
    submit = decode_pool.DecodeRequest.submit
    monkeypatch.setattr(decode_pool.DecodeRequest, "submit", lambda self, fn, *args: (
        tasks.append(args), submit(self, fn, *args))[1])
    urls = [url for name, _, url in media_files() if name in ("a.jpg", "b.png", "f.gif")]
    one = json.dumps({"content": [image_part(urls[0])]}).encode()
    three = json.dumps({"content": [image_part(urls[0]), {"type": "text", "text": "and"}, image_part(urls[1]),
                                    video_part(urls[2])]}).encode()
    with ServerThread(media_service(tiny_model, pool)) as server:
        answers = [run(post_json(server.url, body)) for body in (one, three)]
    assert [a[0] for a in answers] == [200, 200] and [len(load(a[2])) for a in answers] == [1, 3]
    assert len(tasks) == 1 + 3, [len(args) for args in tasks]
    for body, request in ((one, tasks[:1]), (three, tasks[1:])):
        assert [body in args for args in request] == [True] + [False] * (len(request) - 1)
        assert not any(isinstance(a, bytes) and len(a) > 1000 for args in request[1:] for a in args)


def test_the_first_items_task_refuses_a_bad_body_before_it_decodes_and_hands_back_the_items_after_it(tmp_path):
    """prepare_first_item: the body's errors, one line naming the part (a request of too many items a 413), come
    before any item is decoded; a good body gives its first item as prepare_item does and the items after it as
    media_items lists them."""
    from glmvit.cli.serve_media import MediaError, media_items, prepare_first_item, prepare_item

    jpeg_url, png_url = (url for name, _, url in media_files() if name in ("a.jpg", "b.png"))
    undecodable = image_part(data_url(b"\xff\xd8 not a jpeg", "jpeg"))
    cases = [(b"{nope", 400, "the body is not JSON"),
             (json.dumps({"content": [undecodable, {"type": "image_url", "image_url": {}}]}).encode(), 400,
              "content[1].image_url.url: field required"),
             (json.dumps({"content": [undecodable] * 3}).encode(), 413, "3 items in one request: at most 2")]
    for body, status, words in cases:
        with pytest.raises(MediaError) as refused:
            prepare_first_item(body, MediaLimits(), 2, 4, str(tmp_path))
        assert refused.value.status == status and str(refused.value).startswith(words), str(refused.value)
    body = json.dumps({"content": [image_part(jpeg_url), {"type": "text", "text": "then"}, image_part(png_url)]})
    first, rest = prepare_first_item(body.encode(), MediaLimits(), 2, 4, str(tmp_path))
    items = media_items("json", body.encode())
    alone = prepare_item(0, items[0], MediaLimits(), MediaLimits().max_request_pixels, 4, str(tmp_path))
    assert rest == items[1:] and [first.records, first.pixels] == [alone.records, alone.pixels]
    assert torch.equal(first.rows("cpu", torch.float32), alone.rows("cpu", torch.float32))
    assert first.timing["decode"] > 0 and os.listdir(tmp_path) == []


def test_pixels_are_bounded_per_picture_from_the_header_and_per_request(tiny_model, pool):
    big = png_of_zeros(512)  # 262,144 pixels in 1 KB
    small = encode_image(noise((56, 56, 3), 1))
    limits = MediaLimits(max_frame_pixels=256 * 256, max_request_pixels=2 * 56 * 56 + 100)
    with ServerThread(media_service(tiny_model, pool, limits)) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                one = await post(session, server.url, json.dumps({"content": [
                    image_part(data_url(small, "jpeg")), image_part(data_url(big, "png"))]}).encode(), JSON)
                three = await post(session, server.url, json.dumps({"content": [
                    image_part(data_url(small, "jpeg"))] * 3}).encode(), JSON)
                two = await post(session, server.url, json.dumps({"content": [
                    image_part(data_url(small, "jpeg"))] * 2}).encode(), JSON)
                form = aiohttp.FormData()
                form.add_field("file", big, filename="big.png")
                upload = await post(session, server.url, form, headers={})
                return one, three, two, upload
        one, three, two, upload = run(send())
    status, error = one[0], json.loads(one[2])["error"]
    assert status == 413 and error.startswith("content[1].image_url: ") and "more than max_frame_pixels=65,536" in error
    status, error = three[0], json.loads(three[2])["error"]
    assert status == 413 and error.startswith("content[2].image_url: ") and "max_request_pixels=6,372" in error
    assert two[0] == 200
    assert upload[0] == 413 and json.loads(upload[2])["error"].startswith("file 0 (big.png): ")
    with ServerThread(media_service(tiny_model, pool, limits=HttpLimits(max_items=4))) as server:
        body = json.dumps({"content": [image_part(data_url(big, "png"))] * 5}).encode()  # none is decoded
        status, error = error_of(run(post_json(server.url, body)))
    assert (status, error) == (413, "5 items in one request: at most 4")


async def post_json(url, body):
    async with aiohttp.ClientSession() as session:
        return await post(session, url, body, JSON)


def big_and_small() -> tuple[bytes, bytes]:
    """JSON bodies: four 4096² pictures of zeros (seconds to decode and resize), and one small noisy picture."""
    big = json.dumps({"content": [image_part(data_url(png_of_zeros(4096), "png"))] * 4}).encode()
    small = json.dumps({"content": [image_part(data_url(encode_image(noise((56, 56, 3), 1)), "jpeg"))]}).encode()
    return big, small


async def timed_post(session, url: str, body: bytes, done: dict[str, float], name: str):
    """POST ``body`` as JSON; note in ``done[name]`` when its answer was read."""
    answer = await post(session, url, body, JSON)
    done[name] = time.perf_counter()
    return answer


def test_a_slow_decode_times_out_alone_and_delays_no_other_request(tiny_model):
    """Four 4096² pictures (seconds to decode and resize) time out and their worker is replaced; a small request
    sent while they decode is answered first, by the other worker; the next request is served as usual."""
    decode = DecodePool(2, 8, 1.0, MEDIA_MODULES).start()
    wait_until(lambda: decode.ready == 2, "two decode workers started")
    service = media_service(tiny_model, decode, MediaLimits(max_frame_pixels=4096 * 4096, max_request_pixels=2**26))
    big, small = big_and_small()
    try:
        with ServerThread(service) as server:
            async def send():
                async with aiohttp.ClientSession() as session:
                    await asyncio.gather(post(session, server.url, small, JSON), post(session, server.url, small, JSON))
                    done: dict[str, float] = {}
                    slow = asyncio.create_task(timed_post(session, server.url, big, done, "big"))
                    await asyncio.to_thread(wait_until, lambda: decode.busy == 1, "the big request decoding")
                    quick = await timed_post(session, server.url, small, done, "small")
                    return await slow, quick, done, await post(session, server.url, small, JSON)
            slow, quick, done, after = run(send())
            metrics = service.metrics_json()["decode"]
    finally:
        decode.close(30)
    assert quick[0] == 200 and done["small"] < done["big"], quick[2]
    assert slow[0] == 413 and "decoding took more than 1 s" in json.loads(slow[2])["error"], slow[2]
    assert after[0] == 200
    assert metrics["timeouts"] == 1 and metrics["replaced"] == 1
    wait_until(lambda: decode.ready == 2, "the worker replaced")


def test_a_small_request_is_answered_before_two_earlier_big_requests_finish_decoding(tiny_model):
    """One decode worker; two requests of three 4096² pictures (a fourth refused by the pixel budget: 413) sent
    first, then one small picture: requests take turns item by item, so the small one is answered while the big
    ones still decode (first-in, first-out, it waited for both). A refused request leaves no frames behind."""
    decode = DecodePool(1, 8, 60.0, MEDIA_MODULES).start()
    wait_until(lambda: decode.ready == 1, "the decode worker started")
    service = media_service(tiny_model, decode, MediaLimits(max_request_pixels=3 * 4096 * 4096))
    big, small = big_and_small()
    try:
        with ServerThread(service) as server:
            async def send():
                async with aiohttp.ClientSession() as session:
                    await post(session, server.url, small, JSON)  # the worker's first task is behind it
                    done: dict[str, float] = {}
                    bigs = [asyncio.create_task(timed_post(session, server.url, big, done, name))
                            for name in ("big0", "big1")]
                    await asyncio.to_thread(wait_until, lambda: decode.busy == 2, "both big requests decoding")
                    quick = await timed_post(session, server.url, small, done, "small")
                    return [await b for b in bigs], quick, done
            bigs, quick, done = run(send())
            left = os.listdir(service._pixels[0]) if service._pixels and service._pixels[0] else []
    finally:
        decode.close(30)
    assert quick[0] == 200 and done["small"] < min(done["big0"], done["big1"]), (done, quick[1])
    for answer in bigs:
        assert answer[0] == 413 and json.loads(answer[2])["error"].startswith("content[3].image_url: decoding it "
                                                                              "would pass"), answer[2]
    assert left == []


def test_a_burst_past_the_old_request_count_is_held_and_refused_only_past_the_bytes_bound(tiny_model, pool):
    """300 requests at once (more than the 256 the server once held) are all answered; a byte bound refuses with
    a 429 that says so; both bounds are reported in /v1/info and /metrics."""
    request = random_batch([[1, 2, 2]], TINY)
    body = pixel_body(*request)
    service = media_service(tiny_model, pool, start=False)
    with ServerThread(service) as server:
        async def burst():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                tasks = [asyncio.create_task(post(session, server.url, body)) for _ in range(300)]
                await asyncio.to_thread(wait_until, lambda: service.scheduler.stats()["outstanding_requests"] == 300,
                                        "300 queued requests")
                service.scheduler.start()
                answers = await asyncio.gather(*tasks)
                async with session.get(server.url + "/v1/info") as response:
                    info = await response.json()
                async with session.get(server.url + "/metrics") as response:
                    text = await response.text()
                return answers, info, text
        answers, info, text = run(burst())
    assert [a[0] for a in answers] == [200] * 300
    assert info["scheduler"]["max_tokens"] > 0 and info["scheduler"]["max_bytes"] > 0
    assert info["limits"]["max_held_bytes"] > 0
    families = strict_prometheus(text)
    for name in ("glmvit_scheduler_max_tokens", "glmvit_scheduler_max_bytes", "glmvit_scheduler_outstanding_bytes",
                 "glmvit_http_held_bytes", "glmvit_http_held_bytes_limit"):
        assert name in families, name
    row_bytes = request[0].numel() * tiny_model.dtype.itemsize
    service = media_service(tiny_model, pool, start=False, max_bytes=2 * row_bytes)
    refused, queued = one_past_two_queued(service, body)
    assert refused[0] == 429 and f"{2 * row_bytes:,} bytes); retry later" in json.loads(refused[2])["error"], refused[2]
    assert [a[0] for a in queued] == [200, 200]


def test_metrics_split_a_requests_time_into_its_phases(tiny_model, pool):
    jpeg = encode_image(noise((56, 56, 3), 1))
    service = media_service(tiny_model, pool)
    with ServerThread(service) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                media = await post(session, server.url, json.dumps({"content": [image_part(data_url(jpeg, "jpeg"))]})
                                   .encode(), JSON)
                pixels = await post(session, server.url, pixel_body(*random_request(1)))
                async with session.get(server.url + "/metrics") as response:
                    return media, pixels, await response.text()
        media, pixels, text = run(send())
    phases = ("read", "decode", "preprocess", "queue", "host_to_device", "encode", "serialise", "write")
    for answer in (media, pixels):
        assert answer[0] == 200
        timing = dict(p.split(";dur=") for p in answer[1]["Server-Timing"].split(", "))
        assert list(timing) == [p for p in phases if p != "write"] and all(float(v) >= 0 for v in timing.values())
    families = strict_prometheus(text)
    spent = families["glmvit_http_request_phase_seconds_total"]
    assert set(spent) == {f'glmvit_http_request_phase_seconds_total{{phase="{p}"}}' for p in phases}
    assert all(v >= 0 for v in spent.values()) and spent['glmvit_http_request_phase_seconds_total{phase="decode"}'] > 0
    assert families["glmvit_http_timed_requests_total"] == {"glmvit_http_timed_requests_total": 2}


def test_after_the_drain_begins_an_idle_keep_alive_connection_gets_a_503(tiny_model):
    """While a request is in flight the drain keeps open connections open and answers a request on one 503 (and
    closes it), as SIGTERM's drain promises; the request in flight finishes."""
    service = service_for(tiny_model)
    entered, release = gated(service)
    release.set()
    server = ServerThread(service).start()
    body = pixel_body(*random_request(2))

    async def scenario():
        async with aiohttp.ClientSession() as idle, aiohttp.ClientSession() as busy:
            assert (await post(idle, server.url, body))[0] == 200  # its connection now idle, kept alive
            release.clear()
            entered.clear()
            in_flight = asyncio.create_task(post(busy, server.url, body))
            await asyncio.to_thread(entered.wait, 60)
            stopper = asyncio.create_task(asyncio.to_thread(server.shutdown, 60))
            await asyncio.to_thread(wait_until, lambda: service.draining, "the drain to begin")
            late = await post(idle, server.url, body)
            release.set()
            return late, await in_flight, await stopper
    late, in_flight, stopped = run(scenario())
    assert late[0] == 503 and "shutting down" in json.loads(late[2])["error"] and late[1]["Connection"] == "close"
    assert in_flight[0] == 200 and stopped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pixel_rows_cross_in_shared_memory_or_as_bytes_bitwise(dtype):
    from glmvit.cli.pixel_rows import PixelRows, remove_shared_dir, shared_dir

    rows = torch.randn(37, 1176, generator=torch.Generator().manual_seed(0)).to(dtype)
    folder = shared_dir()
    try:
        shared, plain = PixelRows.of(rows, folder), PixelRows.of(rows, None)
        assert plain.path is None and plain.data is not None
        if folder is not None:  # /dev/shm with room: a file, gone once taken
            assert shared.path is not None and shared.data is None
        for handed in (shared, plain):
            got = handed.tensor()
            assert got.dtype == dtype and torch.equal(got, rows)
        assert folder is None or os.listdir(folder) == []
        PixelRows.of(rows, folder).discard()
        assert folder is None or os.listdir(folder) == []
    finally:
        remove_shared_dir(folder)


SIGTERM_CHILD = """
import threading, time, sys
import glmvit.cli.serve as serve, glmvit.cli.serve_app as app
services = []
begin = app.EncoderService.begin_drain
def begin_drain(self):
    services.append(self)
    begin(self)
app.EncoderService.begin_drain = begin_drain
make = serve.make_scheduler
def make_scheduler(*a, **k):  # the second batch is held until the drain has answered a 503
    scheduler, runner = make(*a, **k)
    encode, calls = scheduler._encode, []
    def held(pixels, grids):
        calls.append(1)
        if len(calls) == 2:
            print("encoding", flush=True)
            deadline = time.monotonic() + 60
            while not (services and services[0].responses[503]) and time.monotonic() < deadline:
                time.sleep(0.01)
        return encode(pixels, grids)
    scheduler._encode = held
    return scheduler, runner
serve.make_scheduler = make_scheduler
sys.exit(serve.main(sys.argv[1:]))
"""


def listening(url):
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    try:
        socket.create_connection((where.hostname, where.port), timeout=5).close()
        return True
    except OSError:
        return False


def test_after_sigterm_an_idle_keep_alive_connection_gets_a_503_while_a_request_finishes():
    """The real process: SIGTERM while one request is being encoded; a request on another client's idle
    keep-alive connection is answered 503 (and its connection closed), the one in flight 200, and it exits 0."""
    import signal
    import subprocess
    import sys

    from test_serve import ROOT

    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, "--device", "cpu", "--port", "0", "--budgets",
                              "32", "--no-measure-floor", "--quiet", "--decode-workers", "1", "--api-servers", "1"],
                             cwd=ROOT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    body = pixel_body(*random_request(3))
    try:
        line = child.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + child.stderr.read()
        url = line.split("listening on ")[1].split()[0]

        async def scenario():
            async with aiohttp.ClientSession() as idle, aiohttp.ClientSession() as busy:
                assert (await post(idle, url, body))[0] == 200  # the first batch; its connection stays open
                in_flight = asyncio.create_task(post(busy, url, body))
                assert await asyncio.to_thread(child.stdout.readline) == "encoding\n"
                child.send_signal(signal.SIGTERM)
                await asyncio.to_thread(wait_until, lambda: not listening(url), "the drain to close the listener")
                return await post(idle, url, body), await in_flight
        late, in_flight = run(scenario())
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(60)
    assert late[0] == 503 and late[1]["Connection"] == "close", late
    assert in_flight[0] == 200


def test_a_server_killed_by_sigkill_leaves_its_frames_folder_only_to_the_next_start():
    """SIGKILL left the server's (empty) folder on /dev/shm and its decode worker's scratch directory for good:
    the worker, finding its server gone, now removes its scratch, and the folder, which no live process holds any
    more, is swept by the next server's start (:func:`~glmvit.cli.pixel_rows.sweep_shared_dirs`)."""
    import glob
    import subprocess
    import sys
    import tempfile

    from test_serve import ROOT

    from glmvit.cli.decode_pool import SCRATCH_PREFIX
    from glmvit.cli.pixel_rows import MIN_FREE, PREFIX, SHM, sweep_shared_dirs

    if not os.path.isdir(SHM) or os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize < MIN_FREE:
        pytest.skip("no /dev/shm with room for the frames here: they go through the pipe")
    child = subprocess.Popen([sys.executable, "-m", "glmvit", "serve", "--device", "cpu", "--port", "0", "--budgets",
                              "32", "--no-measure-floor", "--quiet", "--decode-workers", "1", "--api-servers", "1"],
                             cwd=ROOT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + child.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        body = json.dumps({"content": [image_part(data_url(png_of_zeros(32), "png"))]}).encode()
        assert run(post_json(url, body))[0] == 200
        frames = glob.glob(os.path.join(SHM, f"{PREFIX}{child.pid}-*"))
        scratch = glob.glob(os.path.join(tempfile.gettempdir(), f"{SCRATCH_PREFIX}{child.pid}-*"))
        assert len(frames) == 1 and len(scratch) == 1, (frames, scratch)
    finally:
        child.kill()
        child.wait(60)
    wait_until(lambda: not os.path.exists(scratch[0]), "the orphaned worker to remove its scratch directory")
    assert os.listdir(frames[0]) == [] and frames[0] in sweep_shared_dirs() and not os.path.exists(frames[0])


def test_decoded_frames_are_handed_over_in_the_shared_folder_given(tmp_path):
    """prepare_media writes the frames under the folder the server names (its temporary directory for the files
    must not take that name's place: the frames then went through the pipe as bytes)."""
    from glmvit.cli.serve_media import prepare_media

    picture = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    url = data_url(encode_image(picture, "png"), "png")
    body = json.dumps({"content": [{"type": "image_url", "image_url": {"url": url}}]})
    media = prepare_media("json", body.encode(), MediaLimits(), 4, folder=str(tmp_path))
    assert media.frames.path is not None and os.path.dirname(media.frames.path) == str(tmp_path)
    rows = media.rows("cpu", torch.float32)
    assert rows.shape[0] == int(np.prod(media.grid_thw, axis=1).sum()) and os.listdir(tmp_path) == []


def test_a_request_hands_over_its_resized_frames_as_uint8(tmp_path):
    """The worker stops after the resize: what crosses is each item's uint8 frames, one byte a value (a video's
    float32 rows hold four bytes for each), and the server's rows from them are encode's rows bitwise."""
    from glmvit.cli.encode import load
    from glmvit.cli.serve_media import prepare_media

    files = [f for f in media_files() if f[0] in ("a.jpg", "e.mp4", "f.gif")]
    media = prepare_media("files", [(name, data) for name, data, _ in files], MediaLimits(), 4, folder=str(tmp_path))
    assert media.frames.dtype == "uint8" and media.kinds == ["image"] + ["video"] * (len(files) - 1)
    nbytes = os.path.getsize(media.frames.path)
    assert nbytes == sum(int(np.prod(s)) for s in media.shapes) and all(s[3] == 3 for s in media.shapes)
    grids = media.grid_thw.tolist()
    for (t, h, w), (f, height, width, _), kind in zip(grids, media.shapes, media.kinds, strict=True):
        assert (height, width) == (h * 14, w * 14) and f == (1 if kind == "image" else 2 * t)
    video_values = sum(int(np.prod(s)) for s, k in zip(media.shapes, media.kinds, strict=True) if k == "video")
    video_rows = sum(t * h * w for (t, h, w), k in zip(grids, media.kinds, strict=True) if k == "video")
    assert video_rows * 1176 * 4 == 4 * video_values  # float32 rows: four times the bytes handed over
    expected = []
    for k, (name, data, _) in enumerate(files):
        path = tmp_path / f"{k}{os.path.splitext(name)[1]}"
        path.write_bytes(data)
        expected.append(load(path, media.kinds[k]).pixel_values)
    for dtype in (torch.float32, torch.bfloat16):
        if dtype != torch.float32:
            media = prepare_media("files", [(n, d) for n, d, _ in files], MediaLimits(), 4, folder=str(tmp_path))
        assert torch.equal(media.rows("cpu", dtype), torch.cat(expected).to(dtype))


def test_a_killed_decode_workers_temporary_files_are_removed():
    """A worker killed past its time (or from outside) cannot remove what its task wrote to a temporary
    directory (a request's media): the pool removes it."""
    import tempfile

    from glmvit.cli.decode_pool import DecodeTimeout

    decode = DecodePool(1, 0, 2.0).start()
    try:
        left = decode.submit(tempfile.mkdtemp).result(120)  # a task's temporary directory, as prepare_media makes
        assert os.path.isdir(left)
        with pytest.raises(DecodeTimeout):
            decode.submit(time.sleep, 30).result(120)
        assert not os.path.exists(left)
    finally:
        decode.close(30)


def test_a_picture_past_pils_own_pixel_bound_is_a_413():
    """A header past PIL's decompression-bomb bound is refused by PIL before the frame bound is checked: too
    large (413), as the frame bound's refusal is, not bad input (400)."""
    import struct
    import zlib

    from glmvit.cli.serve_media import MediaError, prepare_media

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    with pytest.raises(MediaError, match="too many pixels") as refused:
        prepare_media("files", [("big.png", png)], MediaLimits(), 4)
    assert refused.value.status == 413


def test_a_sliver_is_a_400_naming_the_item_and_the_size_it_was_sent_at():
    """A picture under 28 px on a side is scaled up before its aspect ratio is checked; the error named the
    scaled size (a 3000×10 upload was refused as '28×8400'), which the client never sent."""
    from glmvit.cli.serve_media import MediaError, prepare_media

    out = io.BytesIO()
    Image.new("RGB", (3000, 10)).save(out, format="PNG")  # width 3000, height 10
    fine = data_url(png_of_zeros(32), "png")
    body = json.dumps({"content": [image_part(fine), image_part(data_url(out.getvalue(), "png"))]}).encode()
    limit = r"aspect ratio of 10×3,000 \(height×width\) exceeds 200:1$"
    for kind, payload, label in [("json", body, r"content\[1\]\.image_url"),
                                 ("files", [("ok.png", png_of_zeros(32)), ("sliver.png", out.getvalue())],
                                  r"file 1 \(sliver\.png\)")]:
        with pytest.raises(MediaError, match=f"^{label}: {limit}") as refused:
            prepare_media(kind, payload, MediaLimits(), 4)
        assert refused.value.status == 400


@pytest.mark.skipif(not mp4_available(), reason="PyAV cannot write MP4 here")
def test_a_video_past_the_requests_pixel_budget_is_a_413_naming_the_part_once():
    """encode's load turned the video decoder's bound (DecodeLimitError) into a plain ValueError naming the file
    twice: the server answered 400 'content[0].video_url: content[0].video_url: decoding frames ...'."""
    from glmvit.cli.serve_media import MediaError, prepare_media

    url = data_url(encode_clip(noise((8, 56, 56, 3), 6)), "mp4")
    body = json.dumps({"content": [video_part(url)]}).encode()
    with pytest.raises(MediaError, match=r"^content\[0\]\.video_url: decoding frames") as refused:
        prepare_media("json", body, MediaLimits(max_request_pixels=2000), 4)
    assert refused.value.status == 413 and str(refused.value).count("content[0]") == 1


def test_a_corrupt_exif_block_warns_nothing_in_the_decode_worker(recwarn):
    """The CLI silences PIL's corrupt-EXIF warnings; a decode worker (a process of its own) did not, so each such
    upload printed two lines of a Python warning to the server's log."""
    from glmvit.cli.serve_media import prepare_media

    out = io.BytesIO()
    Image.fromarray(noise((32, 32, 3), 7)).save(out, format="JPEG", exif=b"Exif\0\0MM\0*\0\0\0\x08\xff\xff")
    media = prepare_media("files", [("exif.jpg", out.getvalue())], MediaLimits(), 4)
    assert media.records and not [w for w in recwarn.list if "EXIF" in str(w.message)]


def test_a_gif_clip_holds_its_frames_rounded_to_the_fixed_palette_exactly():
    """bench-serve's GIF clips: each channel rounded to level ⌊6·v/256⌋ of the palette, then stored losslessly
    (decoded by PIL, the oracle here, frame by frame)."""
    from glmvit.cli.media_files import GIF_PALETTE

    frames = noise((3, 30, 40, 3), 7)
    clip = Image.open(io.BytesIO(encode_clip(frames, "gif")))
    assert clip.n_frames == 3
    levels = np.unique(GIF_PALETTE)
    for k in range(3):
        clip.seek(k)
        want = levels[(frames[k].astype(np.int64) * 6) // 256]
        np.testing.assert_array_equal(np.asarray(clip.convert("RGB")), want)


def test_decode_workers_compute_on_one_thread_each(pool):
    """The pool's parallelism is its processes: each worker's OpenMP and torch pools hold one thread, where by
    default each would start one per CPU."""
    assert pool.submit(torch.get_num_threads).result(120) == 1
    assert pool.submit(os.getenv, "OMP_NUM_THREADS").result(120) == "1"


def test_media_rows_are_admitted_without_a_read_back_and_pixel_rows_with_their_nan_check(tiny_model, pool,
                                                                                        monkeypatch):
    """Rows made from media are looked up from the processor's finite levels: admission skips the NaN/Inf pass,
    which reads a result back from the model's device (a wait behind every replay queued there). Pixel rows a
    client sends are still checked, and a NaN in them is still a 400 naming the item."""
    import glmvit.model

    checked = []
    real = glmvit.model.nonfinite_items
    monkeypatch.setattr(glmvit.model, "nonfinite_items", lambda pixels, grids: checked.append(len(grids))
                        or real(pixels, grids))
    jpeg = encode_image(noise((56, 84, 3), 1))
    pixels, grid = random_request(3)
    bad = pixels.clone()
    bad[0, 0] = float("nan")
    with ServerThread(media_service(tiny_model, pool)) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                media = await post(session, server.url, json.dumps({"content": [image_part(data_url(jpeg, "jpeg"))]})
                                   .encode(), JSON)
                fine = await post(session, server.url, pixel_body(pixels, grid))
                nan = await post(session, server.url, pixel_body(bad, grid))
                return media, fine, nan
        media, fine, nan = run(send())
    assert media[0] == fine[0] == 200 and nan[0] == 400, (media[2][:200], nan[2][:200])
    assert "item(s) [0]" in error_of(nan)[1] and checked == [len(grid), len(grid)]


def test_a_file_url_video_is_probed_once_a_request_and_afresh_by_the_next(tmp_path, monkeypatch):
    """One request probes a file:// video once (its check, its cost and its sampling share the answer); the next
    request reads it again: a file rewritten in place at its old size, its modification time set back, gets frames
    sampled by its new frame count (an answer kept by the file's path, size and times gave the old count's
    frames: a 200 with wrong embeddings)."""
    from test_video_files import gifs_of_one_size, rewrite_in_place

    import glmvit.video
    from glmvit.cli.serve_media import prepare_media
    from glmvit.processing import process_video

    four, six = gifs_of_one_size((8, 24))  # 0.8 s and 2.4 s long
    path = tmp_path / "clip.gif"
    path.write_bytes(four)
    walks = []
    real = glmvit.video._probe
    monkeypatch.setattr(glmvit.video, "_probe", lambda p, m: walks.append(p) or real(p, m))
    body = json.dumps({"content": [video_part(f"file://{path}")]}).encode()
    limits = MediaLimits(allowed_media_dir=str(tmp_path))
    sampled = []
    for gif in (four, six):
        if gif is six:
            rewrite_in_place(path, six)
        sampled.append(prepare_media("json", body, limits, 4).records[0]["frame_indices"])
        assert len(walks) == len(sampled)
    want = []
    for name, gif in (("four.gif", four), ("six.gif", six)):  # the same bytes in files of their own
        (tmp_path / name).write_bytes(gif)
        want.append(process_video(tmp_path / name).frame_indices[0])
    assert sampled == want and want[0] != want[1]


@pytest.mark.parametrize("counts", [(8, 24), (24, 8)])
def test_a_file_url_rewritten_between_its_check_and_its_decoding_gives_the_bytes_read(tmp_path, monkeypatch, counts):
    """A file:// item is read once: a file rewritten in place after its check gives the answer (frames, grid and
    sha256) of the bytes the request read, never the old file's probe applied to the new file's frames, nor the
    new file's digest on the old file's frames (both were 200s, one with embeddings of neither file)."""
    import hashlib

    from test_video_files import gifs_of_one_size, rewrite_in_place

    import glmvit.cli.serve_media as serve_media
    from glmvit.cli.serve_media import prepare_media

    first, second = gifs_of_one_size(counts)
    path = tmp_path / "clip.gif"
    path.write_bytes(first)
    real = serve_media.load_frames

    def rewritten_first(*args, **kwargs):
        rewrite_in_place(path, second)
        return real(*args, **kwargs)

    monkeypatch.setattr(serve_media, "load_frames", rewritten_first)
    limits = MediaLimits(allowed_media_dir=str(tmp_path))
    got = prepare_media("json", json.dumps({"content": [video_part(f"file://{path}")]}).encode(), limits, 4)
    monkeypatch.setattr(serve_media, "load_frames", real)
    want = prepare_media("json", json.dumps({"content": [video_part(data_url(first, "gif"))]}).encode(), limits, 4)
    assert got.records[0]["sha256"] == hashlib.sha256(first).hexdigest()
    assert got.records[0]["frame_indices"] == want.records[0]["frame_indices"]
    assert (got.grid_thw == want.grid_thw).all() and torch.equal(got.frames.tensor(), want.frames.tensor())


def test_a_file_url_that_changes_while_it_is_copied_is_refused(tmp_path, monkeypatch):
    """A file whose size or change time moves while the request reads it is a 400 naming the part (retry), never
    decoded from a torn copy."""
    import glmvit.cli.serve_media as serve_media
    from glmvit.cli.serve_media import MediaError, prepare_media

    path = tmp_path / "a.png"
    path.write_bytes(encode_image(noise((56, 84, 3), 1), "png"))
    real = serve_media.shutil.copyfileobj

    def torn(source, target, length=0):
        real(source, target, length)
        with path.open("ab") as fp:
            fp.write(b"\0" * 16)

    monkeypatch.setattr(serve_media.shutil, "copyfileobj", torn)
    with pytest.raises(MediaError, match=r"content\[0\]\.image_url: the file changed while it was read"):
        prepare_media("json", json.dumps({"content": [image_part(f"file://{path}")]}).encode(),
                      MediaLimits(allowed_media_dir=str(tmp_path)), 4)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_file_url_naming_a_directory_or_fifo_is_a_400(tmp_path, kind):
    """A file:// URL under the allowed directory that names a directory or a FIFO is a 400 naming the part (a
    directory escaped as an OSError that ended the decode worker: a 500)."""
    from glmvit.cli.serve_media import MediaError, prepare_media

    path = tmp_path / "x.jpg"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(MediaError, match=r"^content\[0\]\.image_url: not a regular file$") as err:
        prepare_media("json", json.dumps({"content": [image_part(f"file://{path}")]}).encode(),
                      MediaLimits(allowed_media_dir=str(tmp_path)), 4)
    assert err.value.status == 400


def test_a_client_that_leaves_before_its_frames_become_rows_leaves_no_shared_file(tiny_model, pool):
    """The client leaves once its media is decoded, while the job that makes its rows waits for a thread of the
    service's pool (busy with other work): that job never runs, and the frames' shared file is removed all the same
    (it stayed in /dev/shm, the server's memory, until the server stopped)."""
    service = media_service(tiny_model, pool)
    if service._pixel_dir() is None:
        pytest.skip("no /dev/shm with room: frames cross as bytes")
    jpeg = encode_image(noise((56, 56, 3), 1))
    release = threading.Event()
    with ServerThread(service) as server:
        async def leave():
            for _ in range(2):  # every thread of the service's pool busy
                service.pool.submit(release.wait, TIMEOUT)
            async with aiohttp.ClientSession() as session:
                sent = asyncio.create_task(post(session, server.url, json.dumps(
                    {"content": [image_part(data_url(jpeg, "jpeg"))]}).encode(), JSON))
                await asyncio.to_thread(wait_until, lambda: service.pool._work_queue.qsize() == 1,
                                        "the rows' job to wait for a thread")
                sent.cancel()
            await asyncio.to_thread(wait_until, lambda: service.clients_left == 1, "the client to be counted")
            release.set()
            await asyncio.to_thread(wait_until, lambda: service.in_server == 0 and service.pool._work_queue.empty(),
                                    "the request to end")
        run(leave())
        folder = service._pixels[0]
        assert folder is not None and os.listdir(folder) == []


def test_an_items_time_splits_into_its_decoding_and_its_resize(monkeypatch):
    """``decode``: the header's check and the media's decoding into pixels; ``preprocess``: the rest, the resize.
    Each is measured where it happens: a slow decoder shows in decode, a slow resize in preprocess."""
    from PIL import Image as PILImage

    from glmvit.cli import serve_media

    resize = PILImage.Image.resize

    def slow_resize(self, *args, **kwargs):
        time.sleep(0.03)
        return resize(self, *args, **kwargs)

    clip = encode_clip(np.random.default_rng(0).integers(0, 256, (8, 200, 200, 3), dtype=np.uint8),
                       "mp4" if mp4_available() else "gif")
    body = json.dumps({"content": [{"type": "video_url", "video_url": {
        "url": data_url(clip, "mp4" if mp4_available() else "gif")}}]}).encode()
    monkeypatch.setattr(PILImage.Image, "resize", slow_resize)  # 8 frames resized 200² → 196²: ≥ 0.24 s
    split = serve_media.prepare_media("json", body, MediaLimits(), 4).timing
    assert split["preprocess"] >= 0.24 and split["decode"] < 0.2, split
    monkeypatch.setattr(PILImage.Image, "resize", resize)
    from glmvit import video as video_files

    for name in ("_decode_pyav", "_decode_animation"):  # whichever reader the clip takes: frames that come late
        reader = getattr(video_files, name)

        def late(*args, reader=reader, **kwargs):
            for frame in reader(*args, **kwargs):
                time.sleep(0.03)
                yield frame

        monkeypatch.setattr(video_files, name, late)
    split = serve_media.prepare_media("json", body, MediaLimits(), 4).timing
    assert split["decode"] >= 0.24 and split["preprocess"] < 0.2, split
