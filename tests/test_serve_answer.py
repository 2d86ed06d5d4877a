"""The answer's body written in place (glmvit.cli.answer_body): what safetensors reads back is what
``safetensors.torch.save`` over host copies gave (names, dtypes, shapes, every bit, the metadata), its data lie in
item order after a header padded as safetensors pads it, and the server answers with it."""
import json

import aiohttp
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save
from test_serve import ONE_BUDGET, TINY, pixel_body, post, run, service_for

from glmvit.cli.answer_body import answer_body
from glmvit.cli.serve_app import ServerThread
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
