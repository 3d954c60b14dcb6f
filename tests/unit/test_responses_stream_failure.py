"""A streamed Responses answer that fails after text was streamed: its `response.failed` event carries the
output written so far (the open message item, incomplete), and with `store` the failed response is kept, as a
non-streamed failure is. The real route function (responses_api.response_answer) on a real GenerateService of the
tiny Qwen2 model whose engine raises from its fourth step on (a device error, as an asynchronous CUDA fault surfaces,
that persists: a failure of one step alone is contained, the sequence run again alone, StepLoop.contain)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from tests.decoder_models import CHATML, build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=3)


def _state_with_failing_model(path, fail_at: int):
    from tokenizers import Tokenizer

    from surge.config import ServerConfig
    from surge.engines.decoder import DecoderEngine
    from surge.models.chat_template import ChatTemplate
    from surge.runtime.generate_service import GenerateService, GenerationConfig
    from surge.runtime.registry import ModelRegistry
    from surge.server.state import AppState

    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=128)
    step, calls = engine.step, []

    def flaky(scheduled):
        calls.append(1)
        if fail_at and len(calls) >= fail_at:
            raise RuntimeError("a device error")
        return step(scheduled)

    engine.step = flaky
    config = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, cache_entries=0)
    service = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")),
                              ChatTemplate(CHATML, {}),
                              config, request_timeout_s=60, metrics_registry=CollectorRegistry())
    service.mark_ready()
    registry = ModelRegistry()
    registry.add(service)
    return AppState(ServerConfig(), registry), service


async def _never_leaves():
    await asyncio.Event().wait()


def _events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        for block in chunk.split(b"\n\n"):
            for line in block.split(b"\n"):
                if line.startswith(b"data: "):
                    out.append(orjson.loads(line[6:]))
    return out


def test_a_stream_failing_after_text_reports_and_stores_what_was_written(model_dir):
    from surge.server.http.responses_api import ResponseRequest, _store, response_answer

    state, service = _state_with_failing_model(model_dir, fail_at=4)
    req = ResponseRequest(model="m", input="The augmented assignment", max_output_tokens=20, temperature=0,
                          stream=True, store=True)

    async def main():
        stream = await response_answer(state, req, _never_leaves)
        chunks = [c async for c in stream.events()]
        events = _events(chunks)
        rid = events[0]["response"]["id"]
        return events, await _store(state).get(rid)

    try:
        events, record = asyncio.run(main())
    finally:
        asyncio.run(service.close())
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.failed" and "error" in kinds, kinds
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed, "the engine failed before any text: the test shows nothing"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"]
    texts = [part["text"] for item in failed["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [streamed], (texts, streamed)
    assert failed["output"][-1]["status"] == "incomplete"
    # stored as it was reported (a streamed failure was not stored at all: the record stayed absent)
    assert record is not None and record["response"]["status"] == "failed"
    assert record["response"]["output"] == failed["output"]


def test_a_background_response_failing_on_an_unexpected_error_stores_no_internal_detail(model_dir):
    """A background response whose generation raises something that is not a SurgeError is stored as failed
    with the routes' generic 500 message, as a foreground request is answered: the exception's text (paths,
    tensor shapes, a device's words) is for the log, not for whoever reads the response back."""
    from surge.server.http.responses_api import ResponseRequest, _store, response_answer

    state, service = _state_with_failing_model(model_dir, fail_at=0)
    secret = "/srv/private/weights.safetensors shape [896, 4864]"

    step = service.engine.step

    def raises(scheduled):
        raise KeyError(secret)

    service.engine.step = raises
    req = ResponseRequest(model="m", input="The augmented assignment", max_output_tokens=8, temperature=0,
                          background=True, store=True)

    async def main():
        created = await response_answer(state, req, _never_leaves)
        rid = created.body["id"]
        for _ in range(400):
            record = await _store(state).get(rid)
            if record and record["response"]["status"] not in ("queued", "in_progress"):
                return record
            await asyncio.sleep(0.025)
        raise AssertionError("the background response never ended")

    try:
        record = asyncio.run(main())
    finally:
        service.engine.step = step
        asyncio.run(service.close())
    response = record["response"]
    assert response["status"] == "failed", response
    assert response["error"]["message"], response
    assert "private" not in orjson.dumps(response).decode(), response["error"]
