"""Anthropic's Message Batches API, judged by the official `anthropic` SDK against the API that `tokenmill api`
serves (uvicorn on a free port of this process, jobs run in process on the session's real model), beside the
OpenAI Batch API of the same server (`running_api`)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
from anthropic.types import Message
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

from engine import SamplingParams
from engine.chat import chat_token_ids
from ingest.anthropic_api.messages import individual_response
from ingest.anthropic_api.routes import job_id_of
from storage.models import Job
from tests.jobs.test_openai_api import ALIAS, MODEL, running_api

COLOR = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
ESSAY = [{"role": "user", "content": "Write a very long essay on the history of Rome, in twenty parts."}]


def request(custom_id: str, messages=COUNT, max_tokens: int = 4, **params) -> dict:
    return {"custom_id": custom_id, "params": {"model": MODEL, "max_tokens": max_tokens, "messages": messages,
                                               **params}}


@contextlib.contextmanager
def anthropic_api(sessions, tmp_path, llm_engine, **limits):
    """(Anthropic base URL, tenant acme's key, tenant other's key, the service), with `ALIAS` served too."""
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine, **limits) as (base_url, key, other_key, service):
        yield base_url.removesuffix("/v1"), key, other_key, service


@pytest.fixture
def api(sessions, tmp_path, llm_engine):
    with anthropic_api(sessions, tmp_path, llm_engine) as running:
        yield running


class Sent:
    """Every HTTP request a client sends, retries included."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def __call__(self, request) -> None:  # an httpx Request
        self.requests.append(f"{request.method} {request.url.path}")


def client(base_url: str, key: str, sent: Sent | None = None) -> anthropic.Anthropic:
    """The SDK with its default retries (2): a request that ends in a 4xx must be sent once."""
    hooks = {"request": [sent]} if sent else {}
    return anthropic.Anthropic(api_key=key, base_url=base_url, timeout=30,
                               http_client=anthropic.DefaultHttpxClient(event_hooks=hooks, timeout=30))


def wait_ended(sdk: anthropic.Anthropic, batch_id: str, timeout_s: float = 60) -> MessageBatch:
    deadline = time.monotonic() + timeout_s
    while (batch := sdk.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, f"batch still {batch.processing_status}"
        time.sleep(0.1)
    return batch


def results(sdk: anthropic.Anthropic, batch_id: str) -> dict[str, MessageBatchIndividualResponse]:
    lines = list(sdk.messages.batches.results(batch_id))
    by_id = {line.custom_id: line for line in lines}
    assert len(by_id) == len(lines)  # every custom_id once
    return by_id


def engine_text(llm_engine, messages: list[dict], max_tokens: int) -> str:
    """What the engine says to the same chat, greedy, outside any job (run when no batch is running)."""
    [output] = llm_engine.stream([("reference", chat_token_ids(llm_engine.tokenizer, messages),
                                   SamplingParams(max_tokens=max_tokens, temperature=0), 0, None, None)])
    return output.outputs[0].text


def test_a_batch_runs_to_ended_with_the_engines_messages_and_per_request_errors(api, llm_engine) -> None:
    base_url, key, _, _ = api
    sent = Sent()
    sdk = client(base_url, key, sent)
    created = sdk.messages.batches.create(requests=[
        request("color", COLOR, 16, system=[{"type": "text", "text": "You are terse."}], temperature=0),
        request("length", COUNT, 3, temperature=0, top_k=5, top_p=0.9),
        request("alias", COUNT, 3, model=ALIAS, temperature=0),
        request("too-long", [{"role": "user", "content": "word " * 9000}], 8),
        request("unknown-model", COUNT, 2, model="claude-unknown"),
    ])
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None and created.ended_at is None
    assert created.request_counts.processing == 5 and created.expires_at > created.created_at
    batch = wait_ended(sdk, created.id)
    assert (batch.request_counts.succeeded, batch.request_counts.errored, batch.request_counts.processing) == (3, 2, 0)
    assert batch.ended_at >= batch.created_at and batch.cancel_initiated_at is None
    assert batch.results_url == f"{base_url}/v1/messages/batches/{batch.id}/results"

    by_id = results(sdk, batch.id)
    assert sorted(by_id) == ["alias", "color", "length", "too-long", "unknown-model"]
    color = by_id["color"].result
    assert color.type == "succeeded" and isinstance(color.message, Message)
    assert color.message.role == "assistant" and color.message.model == MODEL and color.message.id.startswith("msg_")
    assert color.message.stop_reason == "end_turn" and color.message.stop_sequence is None
    assert color.message.usage.input_tokens > 0 and 0 < color.message.usage.output_tokens <= 16
    length, alias = by_id["length"].result.message, by_id["alias"].result.message
    assert length.stop_reason == alias.stop_reason == "max_tokens" and length.usage.output_tokens == 3
    assert alias.model == ALIAS  # the name the request asked for
    too_long, unknown = by_id["too-long"].result, by_id["unknown-model"].result
    assert too_long.type == "errored" and too_long.error.error.type == "invalid_request_error"
    assert "max_model_len" in too_long.error.error.message
    assert unknown.type == "errored" and unknown.error.error.type == "not_found_error"

    system = [{"role": "system", "content": "You are terse."}]
    texts = {"color": engine_text(llm_engine, system + [{"role": "user", "content": "Name a color."}], 16),
             "alias": engine_text(llm_engine, COUNT, 3)}
    assert {custom_id: by_id[custom_id].result.message.content[0].text for custom_id in texts} == texts

    listed = sdk.messages.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
    assert sdk.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)
    assert not [path for path in sent.requests if path.endswith("/results")][1:]  # one results request


def test_a_stop_sequence_ends_the_message_with_its_reason(api) -> None:
    base_url, key, _, _ = api
    sdk = client(base_url, key)
    batch = sdk.messages.batches.create(requests=[request("stop", COUNT, 16, temperature=0, stop_sequences=["4"])])
    message = results(sdk, wait_ended(sdk, batch.id).id)["stop"].result.message
    assert message.content[0].text == "1, 2, 3, "  # without the stop sequence, as Anthropic's
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "4")


def test_a_recorded_stop_string_is_the_messages_stop_sequence() -> None:
    line = {"id": "batch_req_ab", "custom_id": "c", "error": None, "response": {"status_code": 200, "body": {
        "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": "4",
                                   "message": {"role": "assistant", "content": "1, 2, 3, "}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}}}}
    message = MessageBatchIndividualResponse.model_validate(individual_response(line)).result.message
    assert (message.stop_reason, message.stop_sequence, message.id) == ("stop_sequence", "4", "msg_ab")
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens, message.usage.output_tokens) == (5, 4, 8)


def test_cancel_mid_run_ends_with_every_request_once(api, sessions) -> None:
    base_url, key, _, _ = api
    sdk = client(base_url, key)
    batch = sdk.messages.batches.create(requests=[request(f"short-{i}", COUNT, 2) for i in range(2)] +  # shard 0
                                        [request(f"long-{i}", ESSAY, 1024) for i in range(6)])
    job_id = job_id_of(batch.id)
    deadline = time.monotonic() + 60
    while True:
        with sessions() as db:
            if db.get(Job, job_id).requests_completed >= 2:
                break
        assert time.monotonic() < deadline, "the first shard did not finish"
        time.sleep(0.05)
    canceling = sdk.messages.batches.cancel(batch.id)
    assert canceling.processing_status in {"canceling", "ended"} and canceling.cancel_initiated_at is not None
    ended = wait_ended(sdk, batch.id)
    counts = ended.request_counts
    assert counts.processing == counts.errored == counts.expired == 0 and counts.succeeded >= 2 and counts.canceled
    assert counts.succeeded + counts.canceled == 8
    by_id = results(sdk, batch.id)
    assert sorted(by_id) == sorted([f"short-{i}" for i in range(2)] + [f"long-{i}" for i in range(6)])
    assert {by_id[f"short-{i}"].result.type for i in range(2)} == {"succeeded"}
    assert sum(line.result.type == "canceled" for line in by_id.values()) == counts.canceled
    assert sdk.messages.batches.cancel(batch.id).processing_status == "ended"  # an ended batch stays as it is


def test_tenants_apis_and_bad_input_are_kept_apart_without_retries(sessions, tmp_path, llm_engine) -> None:
    with anthropic_api(sessions, tmp_path, llm_engine, max_batches_in_progress=1) as (base_url, key, other_key, _):
        sent = Sent()
        sdk, other = client(base_url, key, sent), client(base_url, other_key)
        batch = sdk.messages.batches.create(requests=[request("only", ESSAY, 1024)])  # runs until cancelled
        try:
            check_apart(base_url, key, sdk, other, batch.id, sent)
        finally:
            sdk.messages.batches.cancel(batch.id)
            wait_ended(sdk, batch.id)


def check_apart(base_url: str, key: str, sdk: anthropic.Anthropic, other: anthropic.Anthropic, batch_id: str,
                sent: Sent) -> None:
    batch = sdk.messages.batches.retrieve(batch_id)
    for call in (other.messages.batches.retrieve, other.messages.batches.cancel, other.messages.batches.delete,
                 other.messages.batches.results):
        with pytest.raises(anthropic.NotFoundError) as missing:
            call(batch.id)
        assert missing.value.body["error"]["type"] == "not_found_error"
    assert other.messages.batches.list().data == []
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.list(after_id=batch.id)
    with pytest.raises(anthropic.BadRequestError) as running:  # deleted only once ended, as Anthropic's
        sdk.messages.batches.delete(batch.id)
    assert running.value.response.headers["x-should-retry"] == "false"

    openai_sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
    assert openai_sdk.batches.list().data == [] and openai_sdk.files.list().data == []  # each API its own
    with pytest.raises(openai.NotFoundError):
        openai_sdk.batches.retrieve(job_id_of(batch.id))

    bad = {"missing max_tokens": [{"custom_id": "a", "params": {"model": MODEL, "messages": COUNT}}],
           "custom_id": [request("not an id!")], "twice": [request("a"), request("a")],
           "tools": [request("a", tools=[{"name": "t", "input_schema": {"type": "object"}}])],
           "image": [request("a", [{"role": "user", "content": [{"type": "image", "source": {}}]}])],
           "temperature": [request("a", temperature=1.5)], "none": []}
    sent.requests.clear()
    for why, requests in bad.items():
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk.messages.batches.create(requests=requests)
        assert refused.value.status_code == 400 and refused.value.body["type"] == "error", why
        assert refused.value.body["error"]["type"] == "invalid_request_error", why
    with pytest.raises(anthropic.RateLimitError) as limited:  # one batch in progress, the limit here
        sdk.messages.batches.create(requests=[request("one-too-many", COUNT, 1)])
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert limited.value.response.headers["x-should-retry"] == "false"  # it clears only when a batch ends
    assert sent.requests == ["POST /v1/messages/batches"] * (len(bad) + 1)  # each sent once: no retries

    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client(base_url, "tm-not-a-key").messages.batches.list()
    assert wrong.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(f"{base_url}/v1/messages/batches", timeout=10)
    assert no_key.value.code == 401 and json.load(no_key.value)["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.get("/v1/messages/nowhere", cast_to=object)
    assert unknown.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": "Invalid URL (GET /v1/messages/nowhere)"}}


def test_list_pages_with_after_id_and_before_id(api) -> None:
    base_url, key, _, _ = api
    sdk = client(base_url, key)
    ids = [sdk.messages.batches.create(requests=[request(f"r{i}", COUNT, 1)]).id for i in range(3)]
    newest = ids[::-1]
    first = sdk.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == newest[:2] and first.has_more
    assert (first.first_id, first.last_id) == (newest[0], newest[1])
    rest = sdk.messages.batches.list(limit=2, after_id=first.last_id)
    assert [b.id for b in rest.data] == newest[2:] and not rest.has_more
    before = sdk.messages.batches.list(limit=1, before_id=newest[2])
    assert [b.id for b in before.data] == [newest[1]] and before.has_more
    assert [b.id for b in sdk.messages.batches.list(limit=1)] == newest  # the SDK follows the pages
    assert [b.id for b in sdk.messages.batches.list(limit=1, before_id=newest[2])] == [newest[1], newest[0]]
    for batch_id in ids:
        wait_ended(sdk, batch_id)
