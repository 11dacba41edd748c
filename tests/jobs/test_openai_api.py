"""The OpenAI Batch REST API, judged by the official `openai` SDK: uvicorn serves it on a free port of this
process, jobs run in process (SQLite, a folder as the bucket, the session's real model)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletion

from ingest.openai_api import create_app
from storage.api_keys import create_key, list_keys, revoke_key
from storage.job_settings import LOCAL
from tests.fixtures_services import free_port_block
from tokenmill.commands.api import api_service
from workers.inprocess import LocalExecutor

MODEL, ALIAS = "smollm2-135m", "gpt-4o-mini"
MAX_UPLOAD = 64 << 10
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def chat_line(custom_id: str, model: str = MODEL, content: str = "Name a color.", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@contextlib.contextmanager
def running_api(sessions, bucket: str, llm_engine, dispatch=None, **limits):
    """(base URL, tenant acme's key, tenant other's key, the service) of an API running on a free port; its
    batches run in process, or go to `dispatch` (job id ->) when given."""
    executor = LocalExecutor(sessions, {}, engine=llm_engine, expiry_check_s=0.5)  # deadlines noticed within 0.5 s
    service = api_service(sessions, bucket, dispatch or executor.dispatch, LOCAL, MODEL, [ALIAS],
                          **{"max_upload_bytes": MAX_UPLOAD, "shard_size": 2, **limits})
    port = free_port_block(1)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    with sessions.begin() as session:
        keys = create_key(session, "acme"), create_key(session, "other")
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", *keys, service
    finally:
        server.should_exit = True
        thread.join(10)
        executor.close()


@pytest.fixture
def api(sessions, tmp_path, llm_engine):
    """(base URL, tenant acme's key, tenant other's key) of a running API."""
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine) as (base_url, key, other_key, _):
        yield base_url, key, other_key


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def wait_for(sdk: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60,
             predicate=None) -> Batch:
    """The batch once its status is one of `statuses` or, given, `predicate` holds for it."""
    deadline = time.monotonic() + timeout_s
    while (batch := sdk.batches.retrieve(batch_id)).status not in statuses and not (predicate and predicate(batch)):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
    return batch


def submit(sdk: openai.OpenAI, lines: list[dict]) -> Batch:
    upload = sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"team": "tests"})


def test_files_batches_poll_content_with_the_sdk(api) -> None:
    base_url, key, _ = api
    sdk = client(base_url, key)
    lines = [chat_line("job-model", temperature=0, max_tokens=4), chat_line("alias", ALIAS, max_tokens=4, seed=1),
             chat_line("n-two", n=2, max_tokens=3, seed=2), chat_line("bad", max_tokens=4, temperature=-1)]
    upload = sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    assert isinstance(upload, FileObject) and upload.purpose == "batch" and upload.bytes == len(jsonl(lines))
    assert sdk.files.retrieve(upload.id).filename == "input.jsonl"
    assert sdk.files.content(upload.id).content == jsonl(lines)

    created = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"team": "tests"})
    assert created.status in {"validating", "in_progress"} and created.metadata == {"team": "tests"}
    batch = wait_for(sdk, created.id, TERMINAL)
    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.completed_at >= batch.finalizing_at >= batch.in_progress_at >= batch.created_at
    assert batch.usage.input_tokens > 0 and batch.usage.output_tokens > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens

    outputs = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in outputs) == ["alias", "job-model", "n-two"]
    assert sdk.files.retrieve(batch.output_file_id).expires_at is None  # no output_expires_after given
    for line in outputs:
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.choices[0].message.role == "assistant" and line["error"] is None
    assert {len(ChatCompletion.model_validate(line["response"]["body"]).choices) for line in outputs} == {1, 2}
    assert {line["custom_id"]: line["response"]["body"]["model"] for line in outputs} == {  # the name it asked for
        "job-model": MODEL, "alias": ALIAS, "n-two": MODEL}
    errors = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["error"], e["response"]["status_code"], e["response"]["body"]["error"]["code"])
            for e in errors] == [("bad", None, 400, "invalid_parameter")]
    assert sdk.files.retrieve(batch.error_file_id).purpose == "batch_output"

    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)
    listed = sdk.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
    assert sdk.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(upload.id)


def test_list_pages_with_after(api) -> None:
    base_url, key, _ = api
    sdk = client(base_url, key)
    ids = [submit(sdk, [chat_line(f"r{i}", max_tokens=1)]).id for i in range(3)]
    first = sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    rest = sdk.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == ids[:1] and not rest.has_more
    assert [b.id for b in sdk.batches.list(limit=2)] == ids[::-1]
    for batch_id in ids:
        wait_for(sdk, batch_id, TERMINAL)


def test_a_revoked_key_is_401(api, sessions) -> None:
    base_url, key, _ = api
    with sessions.begin() as session:
        [acme] = list_keys(session, "acme")
        assert revoke_key(session, acme.id)
    with pytest.raises(openai.AuthenticationError):
        client(base_url, key).batches.list()


def test_a_wrong_key_is_401_and_another_tenants_batch_404(api) -> None:
    base_url, key, other_key = api
    sdk, other = client(base_url, key), client(base_url, other_key)
    batch = submit(sdk, [chat_line("only", max_tokens=1)])
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "tm-not-a-key").batches.list()
    with pytest.raises(urllib.error.HTTPError) as no_key:  # the SDK will not send a request without one
        urllib.request.urlopen(f"{base_url}/batches", timeout=10)
    assert no_key.value.code == 401 and json.load(no_key.value)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.input_file_id)
    assert other.batches.list().data == []
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_large:
        sdk.files.create(file=("big.jsonl", b"x" * (MAX_UPLOAD + 1)), purpose="batch")
    assert too_large.value.status_code == 413
    wait_for(sdk, batch.id, TERMINAL)


def test_a_malformed_input_file_fails_the_batch_with_its_reason(api) -> None:
    base_url, key, _ = api
    sdk = client(base_url, key)
    batch = submit(sdk, [chat_line("twice", max_tokens=1), chat_line("twice", max_tokens=1)])
    batch = wait_for(sdk, batch.id, TERMINAL)
    assert batch.status == "failed" and batch.failed_at is not None
    [error] = batch.errors.data
    assert "duplicate custom_id 'twice'" in error.message and error.line == 2
    assert batch.output_file_id is None


def test_cancel_during_a_run_keeps_finished_work_and_ends_cancelled(api) -> None:
    base_url, key, _ = api
    sdk = client(base_url, key)
    lines = [chat_line(f"short-{i}", max_tokens=2, min_tokens=2, seed=i) for i in range(2)]  # the first shard
    lines += [chat_line(f"long-{i}", max_tokens=1024, min_tokens=1024, seed=i) for i in range(6)]
    batch = submit(sdk, lines)
    batch = wait_for(sdk, batch.id, TERMINAL, predicate=lambda b: b.request_counts.completed >= 2)
    assert batch.status == "in_progress"
    assert sdk.batches.cancel(batch.id).status in {"cancelling", "cancelled"}
    batch = wait_for(sdk, batch.id, TERMINAL)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at
    assert 2 <= batch.request_counts.completed < batch.request_counts.total == 8
    assert batch.output_file_id is not None  # the rows finished before the cancel stay downloadable
    finished = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert {"short-0", "short-1"} <= {line["custom_id"] for line in finished}
    assert all(ChatCompletion.model_validate(line["response"]["body"]).usage.completion_tokens in (2, 1024)
               for line in finished)
    assert len(finished) == batch.request_counts.completed and batch.request_counts.failed == 8 - len(finished)
    unrun = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert {line["error"]["code"] for line in unrun} == {"batch_cancelled"}  # each row once, across the two files
    assert sorted(line["custom_id"] for line in finished + unrun) == sorted(line["custom_id"]
                                                                            for line in lines)
