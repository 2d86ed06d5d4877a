"""What a refused request body costs the server: a compressed body is refused before a byte of it is read, and a
body past ``max_body_bytes`` is never read past the limit nor kept once it is answered (even with the cycle
collector off). The real aiohttp server on 127.0.0.1, driven over HTTP; every wait is bounded."""
import gc
import gzip
import json
import tracemalloc

import aiohttp
import pytest
from test_serve import SAFETENSORS, pixel_body, random_request, raw_exchange, run, service_for

from glmvit.cli.serve_app import HttpLimits, ServerThread

pytestmark = pytest.mark.timeout(120)
LIMIT = 1 << 20


def test_a_compressed_body_is_415_before_it_is_read(tiny_model):
    bomb = gzip.compress(b"\0" * (8 << 20))  # 8 MiB inflated, 8 KiB sent: past the limit only once inflated
    head = (b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb))
    service = service_for(tiny_model, limits=HttpLimits(max_body_bytes=LIMIT))
    with ServerThread(service) as server:
        status, error = raw_exchange(server.url, head, [bomb])
        plain = raw_exchange(server.url, head.replace(b"gzip", b"identity"), [pixel_body(*random_request(2))])
    assert (status, error) == (415, "Content-Encoding 'gzip': send the body uncompressed (identity)")
    assert plain[0] == 400 and "Content-Length" not in plain[1]  # identity is read as any body (this one is bad)


@pytest.mark.parametrize("coding", [b"br", b"zstd", b"deflate", b"compress"])
def test_every_content_encoding_is_415_whether_or_not_aiohttp_has_its_codec(coding, tiny_model):
    """br and zstd without their packages were refused by aiohttp's parser as a 400 suggesting to install them."""
    body = pixel_body(*random_request(2))
    head = (b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
            b"Content-Encoding: %s\r\nContent-Length: %d\r\n\r\n" % (coding, len(body)))
    with ServerThread(service_for(tiny_model, limits=HttpLimits(max_body_bytes=LIMIT))) as server:
        status, error = raw_exchange(server.url, head, [body])
    assert status == 415 and "send the body uncompressed (identity)" in error and "install" not in error


async def _chunked(total, chunk=1 << 16):
    for _ in range(total // chunk):
        yield b"\0" * chunk


@pytest.mark.parametrize("kind", ["pixels", "multipart"])
def test_refused_bodies_are_freed_at_once_and_never_read_past_the_limit(kind, tiny_model):
    service = service_for(tiny_model, limits=HttpLimits(max_body_bytes=LIMIT))
    sends = 6

    async def send_all(url):
        answers = []
        async with aiohttp.ClientSession() as session:
            for _ in range(sends):
                if kind == "pixels":
                    data, headers = _chunked(4 * LIMIT), SAFETENSORS
                else:
                    data, headers = aiohttp.FormData(), None
                    data.add_field("file", _chunked(4 * LIMIT), filename="big.png")
                try:
                    async with session.post(url + "/v1/encode", data=data, headers=headers) as response:
                        answers.append((response.status, json.loads(await response.read())["error"]))
                except aiohttp.ClientError:  # the server answered and closed while the client still sent
                    answers.append((413, "closed"))
        return answers

    gc.collect()
    gc.disable()  # what is freed must be freed by reference counting: the cycle collector may not run for long
    tracemalloc.start()
    try:
        with ServerThread(service) as server:
            answers = run(send_all(server.url))
            start_size, _ = tracemalloc.get_traced_memory()
            answers += run(send_all(server.url))
            end_size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    kept = end_size - start_size
    # a refused body kept would be at least LIMIT bytes each (what the server read before refusing): half of that
    # for them all leaves room for the client's and the connection pools' own buffers, traced in this process too
    assert kept < sends * LIMIT / 2, f"{sends} refused bodies kept {kept:,} bytes"
    assert all(status == 413 for status, _ in answers), answers
    assert any("more than 1,048,576 bytes" in error for _, error in answers), answers
