"""#57 item 6: a tenant's queue limits as OpenAI reports them. A batch over `--max-enqueued-tokens` (its prompt
tokens per model, of batches not yet ended) or `--max-batches-in-progress` is made (201) and `failed` at once with
the limit in `errors.data`, so the SDK sends it once and never retries; it never runs. A message batch over them is
Anthropic's 429 `rate_limit_error`, not retried. Finished batches stop counting, another model's batches count
apart, and two concurrent creates cannot both pass a limit that fits one (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from sqlalchemy import select, update

from ingest.config import MAX_ENQUEUED_TOKENS, max_enqueued_tokens
from ingest.openai_api import app as api_app
from ingest.openai_api.validation import estimated_tokens
from storage.formats.jsonl import parse_value
from storage.models import ApiBatch, Job
from tests.jobs.conftest import migrated_sessions
from tests.jobs.test_openai_api import MODEL, TERMINAL, chat_line, client, jsonl, running_api, wait_for

ENDPOINT = "/v1/chat/completions"
LINE_TOKENS = 104  # a chat line of 400 ASCII characters: 400 / 4, and 4 for its message


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'limits.db'}" if request.param == "sqlite" else \
        request.getfixturevalue("pg_databases")()
    factory = migrated_sessions(url)
    yield factory
    factory.kw["bind"].dispose()


@pytest.fixture
def parked(sessions, tmp_path):
    """(base URL, acme's key, other's key, service, the job ids handed to the workers): batches never run."""
    dispatched: list[str] = []
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=dispatched.append,
                     max_enqueued_tokens=LINE_TOKENS + 50) as running:
        yield *running, dispatched


def counting_client(base_url: str, key: str, sent: list) -> openai.OpenAI:
    """The SDK with its default retries (2); every request it sends, retries included, lands in `sent`."""
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=30,
                         http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}))


def create(sdk: openai.OpenAI, lines: list[dict]):
    source = sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")


def long_line(custom_id: str) -> dict:
    return chat_line(custom_id, content="x" * 400, max_tokens=4)


def test_the_estimate_and_the_setting() -> None:
    assert estimated_tokens(parse_value(0, long_line("a"))) == LINE_TOKENS


def test_the_setting_reads_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TOKENMILL_MAX_ENQUEUED_TOKENS", raising=False)
    assert max_enqueued_tokens() == MAX_ENQUEUED_TOKENS == 2_000_000
    monkeypatch.setenv("TOKENMILL_MAX_ENQUEUED_TOKENS", "0")
    assert max_enqueued_tokens() == 0
    monkeypatch.setenv("TOKENMILL_MAX_ENQUEUED_TOKENS", "-5")
    with pytest.raises(ValueError, match="TOKENMILL_MAX_ENQUEUED_TOKENS"):
        max_enqueued_tokens()


def test_a_batch_over_the_enqueued_tokens_is_made_failed_and_sent_once(parked, sessions) -> None:
    base_url, key, other_key, service, dispatched = parked
    sent: list = []
    sdk = counting_client(base_url, key, sent)
    first = create(sdk, [long_line("a")])
    assert first.status == "validating" and first.errors is None and dispatched == [first.id]
    source = sdk.files.create(file=("input.jsonl", jsonl([long_line("b")])), purpose="batch")
    sent.clear()
    over = sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
    assert [f"{r.method} {r.url.path}" for r in sent] == ["POST /v1/batches"]  # a 201: nothing to retry
    assert over.status == "failed" and over.failed_at is not None and over.request_counts.completed == 0
    (error,) = over.errors.data
    assert error.code == "token_limit_exceeded" and error.param is None and error.line is None
    assert error.message.startswith(f"Enqueued token limit reached for {MODEL} in organization acme. Limit: 154 "
                                    f"enqueued tokens. Please try again once some in_progress batches")
    assert sdk.batches.retrieve(over.id).errors.data[0].code == "token_limit_exceeded"
    assert dispatched == [first.id]  # the failed batch never goes to the workers
    with sessions() as db:
        assert db.get(Job, over.id).status == "failed" and not db.get(Job, over.id).shards

    assert create(counting_client(base_url, other_key, []), [long_line("c")]).status == "validating"  # per tenant
    with sessions.begin() as db:  # the first batch's model is another one: it counts apart
        db.execute(update(Job).where(Job.id == first.id).values(model="another-model"))
    assert create(sdk, [long_line("d")]).status == "validating"
    service.max_enqueued_tokens = 0  # no limit
    assert create(sdk, [long_line(f"e{i}") for i in range(50)]).status == "validating"


def test_a_batch_over_the_batches_in_progress_is_made_failed(parked) -> None:
    base_url, key, _, service, dispatched = parked
    service.max_batches_in_progress = 1
    sent: list = []
    sdk = counting_client(base_url, key, sent)
    create(sdk, [chat_line("a")])
    sent.clear()
    over = create(sdk, [chat_line("b")])
    assert over.status == "failed" and over.failed_at is not None and len(dispatched) == 1
    (error,) = over.errors.data
    assert error.code == "batch_limit_exceeded" and "--max-batches-in-progress" in error.message
    assert [f"{r.method} {r.url.path}" for r in sent] == ["POST /v1/files", "POST /v1/batches"]


def test_concurrent_creates_cannot_both_pass_a_limit_that_fits_one(parked, sessions, monkeypatch) -> None:
    base_url, key, _, _, dispatched = parked
    sdk = client(base_url, key)
    sources = [sdk.files.create(file=("in.jsonl", jsonl([long_line(f"r{i}")])), purpose="batch").id
               for i in range(2)]
    original = api_app.check_lines

    def slow(*args, **kwargs):  # both inputs read before either batch is written
        time.sleep(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(api_app, "check_lines", slow)
    with ThreadPoolExecutor(2) as pool:
        made = list(pool.map(lambda source: sdk.batches.create(input_file_id=source, endpoint=ENDPOINT,
                                                                completion_window="24h"), sources))
    assert sorted(batch.status for batch in made) == ["failed", "validating"], made
    assert [batch.errors.data[0].code for batch in made if batch.status == "failed"] == ["token_limit_exceeded"]
    assert dispatched == [batch.id for batch in made if batch.status == "validating"]
    with sessions() as db:
        assert sorted(db.scalars(select(ApiBatch.enqueued_tokens))) == [LINE_TOKENS, LINE_TOKENS]


def test_a_message_batch_over_the_limit_is_a_429_sent_once(parked) -> None:
    base_url, key, _, _, dispatched = parked
    sent: list = []
    sdk = anthropic.Anthropic(api_key=key, base_url=base_url.removesuffix("/v1"), timeout=30,
                              http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [sent.append]}))
    params = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 400}]}
    first = sdk.messages.batches.create(requests=[{"custom_id": "a", "params": params}])
    sent.clear()
    with pytest.raises(anthropic.RateLimitError) as limited:
        sdk.messages.batches.create(requests=[{"custom_id": "b", "params": params}])
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert "Enqueued token limit reached" in limited.value.body["error"]["message"]
    assert limited.value.response.headers["x-should-retry"] == "false" and len(sent) == 1
    assert [batch.id for batch in sdk.messages.batches.list()] == [first.id] and len(dispatched) == 1


def test_a_batch_under_the_limit_runs_and_finished_ones_stop_counting(tmp_path, llm_engine) -> None:
    factory = migrated_sessions(f"sqlite:///{tmp_path / 'run.db'}")
    try:
        with running_api(factory, str(tmp_path / "bucket"), llm_engine,
                         max_enqueued_tokens=LINE_TOKENS + 50) as (base_url, key, _, _):
            sdk = client(base_url, key)
            for custom_id in ("first", "second"):  # the second fits only once the first has ended
                done = wait_for(sdk, create(sdk, [long_line(custom_id)]).id, TERMINAL, timeout_s=120)
                assert done.status == "completed" and done.errors is None, done
                assert done.request_counts.completed == 1
    finally:
        factory.kw["bind"].dispose()
