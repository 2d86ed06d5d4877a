"""The answer's body written in place (glmvit.cli.answer_body): what safetensors reads back is what
``safetensors.torch.save`` over host copies gave (names, dtypes, shapes, every bit, the metadata), its data lie in
item order after a header padded as safetensors pads it, and the server answers with it."""
import dataclasses
import json
import socket
import struct
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors import safe_open
from safetensors.torch import load, save
from test_serve import ONE_BUDGET, TIMEOUT, TINY, pixel_body, post, random_request, run, service_for, wait_until

from glmvit.cli import serve_app
from glmvit.cli.answer_body import answer_body
from glmvit.cli.serve_app import PHASES, ServerThread
from glmvit.cli.serve_link import AnswerFile
from glmvit.graphs import EncoderGraphRunner
from glmvit.workloads import random_batch

METADATA = {"item_0": json.dumps({"source": "café.jpg", "tokens": 4}), "provenance": json.dumps({"command": "t"}),
            "quote": 'a "b"\n\\c'}


def saved_as_before(outputs, dtype, metadata):
    """The answer as the server made it before: contiguous host copies in ``dtype``, then safetensors' save."""
    return save({f"item_{i}": t.to(dtype).contiguous() for i, t in enumerate(outputs)}, metadata=metadata)


def header_of(body) -> dict:
    return json.loads(bytes(body[8 : 8 + int.from_bytes(body[:8], "little")]))


def outputs_of(dtype, items=12):
    """``items`` embeddings of several shapes in ``dtype``, one of them a strided view, values of every sign and
    size (a subnormal, an infinity and a NaN among them)."""
    generator = torch.Generator().manual_seed(0)
    outputs = [torch.randn(int(n), 8, generator=generator).to(dtype) * 10 ** (i % 5 - 2)
               for i, n in enumerate(torch.randint(1, 9, (items,), generator=generator))]
    outputs[1] = torch.randn(8, 6, generator=generator).to(dtype).t()  # not contiguous
    outputs[2][0, :3] = torch.tensor([1e-40, float("inf"), float("nan")]).to(dtype)
    return outputs


@pytest.mark.parametrize("inputs, answer", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("metadata", [METADATA, None], ids=["metadata", "none"])
def test_the_body_reads_back_bitwise_as_the_saved_host_copies(inputs, answer, metadata, tmp_path):
    outputs = outputs_of(inputs)
    body = answer_body(outputs, answer, metadata)
    before = saved_as_before(outputs, answer, metadata)
    got, expected = load(bytes(body)), load(before)
    assert sorted(got) == sorted(expected) == sorted(f"item_{i}" for i in range(len(outputs)))
    for name, want in expected.items():
        assert got[name].dtype == want.dtype == answer and got[name].shape == want.shape, name
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name  # every bit, NaN included
    assert header_of(body).get("__metadata__") == header_of(before).get("__metadata__") == metadata
    (tmp_path / "answer.safetensors").write_bytes(body)
    with safe_open(tmp_path / "answer.safetensors", "pt") as opened:  # the library's own reader of the metadata
        assert opened.metadata() == metadata


def test_the_data_lie_in_item_order_after_a_header_padded_to_eight_bytes():
    """item_10 follows item_9 (safetensors' save orders the names as text: item_10 before item_2)."""
    outputs = outputs_of(torch.float32)
    body = answer_body(outputs, torch.float32, METADATA)
    length = int.from_bytes(body[:8], "little")
    assert length % 8 == 0 and body[8] == ord("{")
    spans = [header_of(body)[f"item_{i}"]["data_offsets"] for i in range(len(outputs))]
    assert [begin for begin, _ in spans] == [0] + [end for _, end in spans[:-1]]
    assert len(body) == 8 + length + spans[-1][1]


def test_an_answer_of_no_items_and_a_dtype_safetensors_has_no_name_for():
    assert load(bytes(answer_body([], torch.float32, METADATA))) == {}
    with pytest.raises(ValueError, match="an answer's dtype must be one of float32, bfloat16, float16, float64, "
                                         "not int64"):
        answer_body([torch.zeros(2, 2)], torch.int64)


def test_the_server_answers_twelve_items_in_item_order_with_their_embeddings(tiny_model):
    grids = [[1, 2, 2 * (1 + i % 3)] for i in range(12)]
    pixels, grid = random_batch(grids, TINY, seed=7)
    expected = EncoderGraphRunner(tiny_model, ONE_BUDGET, mode="emulate").capture().run(pixels, grid)
    with ServerThread(service_for(tiny_model)) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                return await post(session, server.url, pixel_body(pixels, grid))
        status, _, body = run(send())
    assert status == 200, body
    header = header_of(body)
    assert [header[f"item_{i}"]["data_offsets"][0] for i in range(12)] == sorted(
        header[f"item_{i}"]["data_offsets"][0] for i in range(12))
    got = load(body)
    for i, want in enumerate(expected):  # to float32 rounding: tests/test_scheduler.py says why
        torch.testing.assert_close(got[f"item_{i}"], want, atol=1e-5, rtol=1e-5, msg=f"item {i}")
    assert json.loads(header["__metadata__"]["item_11"])["grid_thw"] == grids[11]


@pytest.mark.gpu
@pytest.mark.parametrize("answer", [torch.float32, torch.bfloat16])
def test_cuda_outputs_cross_into_the_body_on_a_side_stream_not_behind_the_default_one(answer):
    """Each output is copied from the device straight into its slice, on the thread's own stream: the body is
    complete while work queued on the default stream (the encoder's replays) is still running."""
    outputs = [t.cuda() for t in outputs_of(torch.bfloat16)]
    torch.cuda.synchronize()  # finished, as the scheduler hands outputs out
    torch.cuda._sleep(2_000_000_000)  # about a second of a busy default stream
    body = answer_body(outputs, answer, METADATA)
    assert not torch.cuda.current_stream().query(), "the copies waited for the default stream"
    expected = load(saved_as_before([t.cpu() for t in outputs], answer, METADATA))
    got = load(bytes(body))
    for name, want in expected.items():
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
    torch.cuda.synchronize()


# ---- the answer written in slices (serve_app.write_answer) --------------------------------------------------------
def answering(service, make_body):
    """``service``'s backend answers every request with ``make_body()`` as its body (its own answer's other fields
    kept); the sizes of the bodies it gave, in order (never the bodies: the server alone holds them)."""
    encode, given = service.backend.encode, []

    async def encode_with(*args, **kwargs):
        result = await encode(*args, **kwargs)
        body = make_body()
        given.append(len(body))
        return dataclasses.replace(result, body=body)

    service.backend.encode = encode_with
    return given


def counting_writes(monkeypatch):
    """The size and type of every slice StreamResponse.write is given, in order."""
    writes = []
    write = web.StreamResponse.write

    async def counted(self, data):
        writes.append((len(data), type(data)))
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counted)
    return writes


def big_safetensors(nbytes: int) -> bytes:
    """A safetensors file of about ``nbytes`` bytes of random float32 values (its length no multiple of a slice)."""
    values = torch.randn(nbytes // 4 // 64 + 3, 64, generator=torch.Generator().manual_seed(1))
    return save({"item_0": values}, metadata={"k": "v"})


def test_an_answer_of_several_slices_arrives_bitwise_and_its_write_is_timed(tiny_model, monkeypatch):
    """A body of 3.4 slices goes out as four memoryview slices of ANSWER_SLICE bytes at most; the client gets every
    byte of it, safetensors reads it back, and the write is timed in /metrics (Server-Timing has the phases before
    it: its headers go first)."""
    body = big_safetensors(int(3.4 * serve_app.ANSWER_SLICE))
    service = service_for(tiny_model)
    given = answering(service, lambda: bytearray(body))
    writes = counting_writes(monkeypatch)
    with ServerThread(service) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                return await post(session, server.url, pixel_body(*random_request(2)))
        status, headers, got = run(send())
    assert status == 200 and headers["Content-Type"] == "application/x-safetensors", got[:300]
    assert int(headers["Content-Length"]) == len(body) and got == body and given == [len(body)]
    assert torch.equal(load(got)["item_0"], load(body)["item_0"])
    sizes = [n for n, _ in writes]
    assert sizes == [serve_app.ANSWER_SLICE] * 3 + [len(body) - 3 * serve_app.ANSWER_SLICE], sizes
    assert all(kind is memoryview for _, kind in writes)  # views of the body, never copies
    timing = headers["Server-Timing"]
    assert [entry.split(";")[0] for entry in timing.split(", ")] == [p for p in PHASES if p != "write"], timing
    http = service.metrics_json()["http"]
    assert http["timed_requests"] == 1 and http["phase_s"]["write"] > 0 and http["responses"] == {"200": 1}


def test_a_real_answer_of_many_small_slices_is_the_body_the_backend_made(tiny_model, monkeypatch):
    """The tiny tower's answer, sliced every 1,000 bytes (no divisor of its length): what arrives is the body the
    backend serialised, bitwise."""
    monkeypatch.setattr(serve_app, "ANSWER_SLICE", 1000)
    service = service_for(tiny_model)
    made = answering_as_made(service)
    writes = counting_writes(monkeypatch)
    pixels, grid = random_batch([[1, 2, 2 * (1 + i % 3)] for i in range(12)], TINY, seed=7)
    with ServerThread(service) as server:
        async def send():
            async with aiohttp.ClientSession() as session:
                return await post(session, server.url, pixel_body(pixels, grid))
        status, _, got = run(send())
    assert status == 200 and len(made) == 1 and got == made[0] and len(got) > 5000
    assert len(writes) == -(-len(got) // 1000) and sorted(load(got)) == sorted(f"item_{i}" for i in range(12))


def answering_as_made(service):
    """A copy of every body ``service``'s backend made, in order (the bodies themselves are answered)."""
    encode, made = service.backend.encode, []

    async def encode_with(*args, **kwargs):
        result = await encode(*args, **kwargs)
        made.append(bytes(result.body))
        return result

    service.backend.encode = encode_with
    return made


def mapped(path) -> bool:
    """Whether this process maps the file at ``path`` (unlinked or not)."""
    return str(path) in Path("/proc/self/maps").read_text()


def shared_answer(folder, nbytes):
    """A body as an API server of several holds its engine's answer (serve_link.RemoteBackend): a mapping of a
    file in a shared folder, unlinked, as a memoryview; the file's path and the bytes."""
    content = big_safetensors(nbytes)
    answer = AnswerFile(str(folder))
    raw = answer(len(content))
    raw[:] = content
    rows = answer.rows(raw)
    del raw
    return rows.path, content, lambda: rows.tensor().numpy().data


def raw_answer(url, body, receive_buffer=1 << 14):
    """A raw keep-alive request of ``body`` whose answer is read up to its headers only (the receive buffer small,
    so the server cannot write much more): the socket, the answer's headers and what came of its body."""
    where = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(TIMEOUT)
    sock.connect((where.hostname, where.port))
    sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-safetensors\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 12)
        assert chunk, data
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    return sock, head.decode(), rest


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_shared_answer_is_unmapped_once_written_or_once_its_client_leaves_mid_answer(tiny_model, tmp_path):
    """An answer in a mapped file (the API server's of several) is written from the mapping and unmapped when it has
    been written; a client that leaves mid-answer (a reset) is counted apart, never as an error or an answer, its
    mapping let go as well, and the server answers on."""
    size = 24 << 20  # more than the socket buffers hold: the server is mid-answer when the client leaves
    first, content, first_body = shared_answer(tmp_path, size)
    second, _, second_body = shared_answer(tmp_path, size)
    bodies = iter([first_body, second_body])
    service = service_for(tiny_model)
    answering(service, lambda: next(bodies, lambda: content)())  # the third request: plain bytes
    request = pixel_body(*random_request(4))
    with ServerThread(service) as server:
        sock, head, rest = raw_answer(server.url, request)
        assert head.startswith("HTTP/1.1 200") and "Connection: close" not in head, head
        got = bytearray(rest)
        while len(got) < len(content):
            got += sock.recv(1 << 20)
        sock.close()
        wait_until(lambda: not mapped(first), "the answered body to be unmapped")
        sock, head, _ = raw_answer(server.url, request)
        assert mapped(second) and service.handling == 1  # mid-answer
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset
        wait_until(lambda: service.clients_left == 1 and service.handling == 0, "the client that left counted")
        wait_until(lambda: not mapped(second), "the body of the client that left to be unmapped")
        async def send():
            async with aiohttp.ClientSession() as session:
                return await post(session, server.url, request)
        after = run(send())
    assert bytes(got) == content and after[0] == 200
    http = service.metrics_json()["http"]
    assert http["responses"] == {"200": 2} and http["clients_left"] == 1 and http["timed_requests"] == 2


def test_a_drain_that_begins_mid_answer_closes_the_connection_after_it(tiny_model):
    """The headers went out on a keep-alive connection; the drain begins while the body is written: the whole
    answer still comes, then the server closes the connection (the client's next request goes elsewhere)."""
    body = big_safetensors(24 << 20)
    service = service_for(tiny_model)
    answering(service, lambda: body)
    with ServerThread(service) as server:
        sock, head, rest = raw_answer(server.url, pixel_body(*random_request(5)))
        with sock:
            assert head.startswith("HTTP/1.1 200") and "Connection: close" not in head, head
            service.begin_drain()
            got = bytearray(rest)
            while len(got) < len(body):
                chunk = sock.recv(1 << 20)
                assert chunk, f"closed after {len(got)} of {len(body)} bytes"
                got += chunk
            sock.settimeout(10)
            after = sock.recv(1)  # b"": closed; a timeout if it stayed open
    assert bytes(got) == body and after == b""
    assert service.responses[200] == 1 and service.clients_left == 0
