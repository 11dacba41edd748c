"""The OpenAI Batch API as a drop-in, judged by the official SDK: files.list, expiry and its cleanup, OpenAI's
validation at batch creation (each bad line listed), per-tenant limits, a cancelled batch's finished rows, and
tenant isolation for every id."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletion
from sqlalchemy import event, select
from sqlalchemy.exc import OperationalError

from ingest.openai_api.results import delete_expired_files
from storage import repository as repo
from storage.claims import expire
from storage.formats import BATCH_OUTPUT_KEY, write_jsonl
from storage.models import ApiBatch, Job, utcnow
from storage.objectstore import open_store
from tests.jobs.test_openai_api import ALIAS, MODEL, TERMINAL, chat_line, client, jsonl, running_api, wait_for

ENDPOINT = "/v1/chat/completions"


@pytest.fixture
def parked(sessions, tmp_path):
    """An API whose batches are created but never run (their jobs wait in `validating`): no model loads."""
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=lambda job_id: None) as running:
        yield running


def upload(sdk: openai.OpenAI, lines: list[dict], **options):
    return sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch", **options)


def test_files_list_pages_filters_and_orders(parked) -> None:
    base_url, key, other_key, _ = parked
    sdk = client(base_url, key)
    ids = [upload(sdk, [chat_line(f"r{i}")]).id for i in range(3)]
    assert [f.id for f in sdk.files.list()] == ids[::-1]
    assert [f.id for f in sdk.files.list(order="asc")] == ids
    first = sdk.files.list(limit=2, order="asc")
    assert [f.id for f in first.data] == ids[:2] and first.has_more
    rest = sdk.files.list(limit=2, order="asc", after=ids[1])
    assert [f.id for f in rest.data] == ids[2:] and not rest.has_more
    assert [f.id for f in sdk.files.list(purpose="batch", limit=1)] == ids[::-1]  # the SDK pages on
    assert list(sdk.files.list(purpose="batch_output")) == []
    assert list(client(base_url, other_key).files.list()) == []


def test_uploads_expire_and_the_cleanup_deletes_them(parked, sessions) -> None:
    base_url, key, _, service = parked
    sdk = client(base_url, key)
    short = upload(sdk, [chat_line("a")], expires_after={"anchor": "created_at", "seconds": 3600})
    default = upload(sdk, [chat_line("b")])
    assert short.expires_at == short.created_at + 3600
    assert default.expires_at == default.created_at + 30 * 86400
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        upload(sdk, [chat_line("c")], expires_after={"anchor": "created_at", "seconds": 10})
    bucket = Path(service.bucket_uri.removeprefix("file://")) / "files"
    assert (bucket / f"{short.id}.jsonl").exists()
    assert delete_expired_files(sessions, service.intake.s3, utcnow() + timedelta(hours=2)) == 1
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(short.id)
    assert not (bucket / f"{short.id}.jsonl").exists() and (bucket / f"{default.id}.jsonl").exists()


def test_batch_creation_lists_each_bad_line(parked) -> None:
    base_url, key, _, _ = parked
    sdk = client(base_url, key)
    lines = [chat_line("ok"), {**chat_line("wrong-url"), "url": "/v1/completions"}, chat_line("foreign", "gpt-5"),
             chat_line("alias", ALIAS), chat_line("ok")]
    source = sdk.files.create(file=("in.jsonl", jsonl(lines) + b"{not json\n"), purpose="batch")
    batch = sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_url"), (3, "model_not_found"), (5, "duplicate_custom_id"), (6, "invalid_json")]
    assert "'gpt-5'" in batch.errors.data[1].message and f"'{MODEL}'" in batch.errors.data[1].message
    assert sdk.batches.retrieve(batch.id).errors.data[0].line == 2


def test_limits_are_per_tenant_and_say_which(parked) -> None:
    base_url, key, other_key, service = parked
    sdk, other = client(base_url, key), client(base_url, other_key)
    service.max_batch_rows = 2
    with pytest.raises(openai.BadRequestError, match="--max-batch-rows"):
        sdk.batches.create(input_file_id=upload(sdk, [chat_line(f"r{i}") for i in range(3)]).id, endpoint=ENDPOINT,
                           completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        sdk.batches.create(input_file_id=upload(sdk, [chat_line("r")]).id, endpoint=ENDPOINT,
                           completion_window="48h")
    service.max_completion_window = "7d"
    assert sdk.batches.create(input_file_id=upload(sdk, [chat_line("r")]).id, endpoint=ENDPOINT,
                              completion_window="48h").completion_window == "48h"
    service.max_batches_in_progress = 1
    over = sdk.batches.create(input_file_id=upload(sdk, [chat_line("r")]).id, endpoint=ENDPOINT,
                              completion_window="24h")  # made and failed, as OpenAI's queue limits
    assert over.status == "failed" and over.errors.data[0].code == "batch_limit_exceeded"
    assert "--max-batches-in-progress" in over.errors.data[0].message
    assert other.batches.create(input_file_id=upload(other, [chat_line("r")]).id, endpoint=ENDPOINT,
                                completion_window="24h").status == "validating"
    stored = sum(f.bytes for f in sdk.files.list())
    service.max_tenant_bytes = stored + 10
    with pytest.raises(openai.PermissionDeniedError, match="--max-tenant-bytes"):
        upload(sdk, [chat_line("too-much")])
    upload(other, [chat_line("fits")])


def wait_until(sdk: openai.OpenAI, batch_id: str, done, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not done(batch := sdk.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.05)
    return batch


def test_the_sdk_drop_in_flow_and_no_id_crosses_tenants(sessions, tmp_path, llm_engine) -> None:
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine) as (base_url, key, other_key, service):
        sdk, other = client(base_url, key), client(base_url, other_key)
        bad = upload(sdk, [chat_line("fine"), chat_line("foreign", "gpt-5")])
        refused = sdk.batches.create(input_file_id=bad.id, endpoint=ENDPOINT, completion_window="24h")
        assert refused.status == "failed" and [(e.line, e.code) for e in refused.errors.data] == [
            (2, "model_not_found")]

        lines = [chat_line(f"short-{i}", max_tokens=2, seed=i) for i in range(2)]
        lines += [chat_line(f"long-{i}", max_tokens=256, min_tokens=256, seed=i) for i in range(10)]
        source = upload(sdk, lines)
        assert {f.id for f in sdk.files.list()} == {bad.id, source.id}
        batch = sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h",
                                   output_expires_after={"anchor": "created_at", "seconds": 7200})
        wait_until(sdk, batch.id, lambda b: b.request_counts.completed > 0 or b.status in TERMINAL)
        sdk.batches.cancel(batch.id)
        batch = wait_for(sdk, batch.id, TERMINAL, timeout_s=120)
        assert batch.status == "cancelled" and 0 < batch.request_counts.completed < 12, batch.request_counts
        finished = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
        unrun = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
        assert len(finished) == batch.request_counts.completed and len(unrun) == batch.request_counts.failed
        assert {line["error"]["code"] for line in unrun} == {"batch_cancelled"}  # the rows it never ran, as OpenAI
        assert sorted(line["custom_id"] for line in finished + unrun) == sorted(line["custom_id"]
                                                                                for line in lines)
        assert {line["custom_id"] for line in finished} >= {"short-0", "short-1"}
        for line in finished:
            assert ChatCompletion.model_validate(line["response"]["body"]).choices[0].message.role == "assistant"
        output = sdk.files.retrieve(batch.output_file_id)
        assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200

        for file_id in (bad.id, source.id, batch.output_file_id):
            with pytest.raises(openai.NotFoundError):
                other.files.retrieve(file_id)
            with pytest.raises(openai.NotFoundError):
                other.files.content(file_id)
            with pytest.raises(openai.NotFoundError):
                other.files.delete(file_id)
        for batch_id in (refused.id, batch.id):
            with pytest.raises(openai.NotFoundError):
                other.batches.retrieve(batch_id)
            with pytest.raises(openai.NotFoundError):
                other.batches.cancel(batch_id)
        with pytest.raises(openai.NotFoundError):
            other.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
        assert list(other.files.list()) == [] and list(other.batches.list()) == []

        results = Path(service.bucket_uri.removeprefix("file://")) / "results" / batch.id
        assert any(results.iterdir())
        assert sdk.files.delete(batch.output_file_id).deleted
        assert any(p.is_file() for p in results.rglob("*"))  # its error file still reads them
        assert sdk.files.delete(batch.error_file_id).deleted  # its last result file: the results go
        assert not any(p.is_file() for p in results.rglob("*"))
        assert sdk.files.delete(source.id).deleted and sdk.files.delete(bad.id).deleted
        assert list(sdk.files.list()) == []


def test_an_expired_batch_keeps_its_finished_rows(sessions, tmp_path, llm_engine) -> None:
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine) as (base_url, key, _, _):
        sdk = client(base_url, key)
        lines = [chat_line(f"short-{i}", max_tokens=2, seed=i) for i in range(2)]
        lines += [chat_line(f"long-{i}", max_tokens=256, min_tokens=256, seed=i) for i in range(10)]
        batch = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint=ENDPOINT, completion_window="24h")
        wait_until(sdk, batch.id, lambda b: b.request_counts.completed > 0 or b.status in TERMINAL)
        with sessions.begin() as session:  # what the sweep does past the deadline
            expire(repo.get_job(session, batch.id, for_update=True))
        batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "expired" and 0 < batch.request_counts.completed < 12, batch.request_counts
        finished = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
        unrun = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
        assert len(finished) == batch.request_counts.completed and len(unrun) == batch.request_counts.failed
        assert {line["error"]["code"] for line in unrun} == {"batch_expired"}
        assert len({line["custom_id"] for line in finished + unrun}) == len(finished + unrun) == 12
        assert {line["custom_id"] for line in finished} >= {"short-0", "short-1"}
        assert sdk.batches.retrieve(batch.id).output_file_id == batch.output_file_id  # made once


def test_result_files_expire_from_their_own_creation(parked, sessions) -> None:
    """#55 path 2: `output_expires_after` counts from each result file's creation (OpenAI's anchor), not from the
    batch's: a batch that ran longer than the lifetime gets files that live the whole of it."""
    base_url, key, _, service = parked
    sdk = client(base_url, key)
    batch = sdk.batches.create(input_file_id=upload(sdk, [chat_line("a")]).id, endpoint=ENDPOINT,
                               completion_window="24h", output_expires_after={"anchor": "created_at", "seconds": 3600})
    with sessions.begin() as session:  # it ran for two hours, and completed
        session.get(ApiBatch, batch.id).created_at = utcnow() - timedelta(hours=2)
        job = repo.get_job(session, batch.id)
        job.status, job.completed_at, job.requests_total, job.requests_completed = "completed", utcnow(), 1, 1
        write_jsonl(open_store(job.output_uri), BATCH_OUTPUT_KEY, [{"id": "r1", "custom_id": "a", "error": None,
                                                                   "response": {"status_code": 200, "body": {}}}])
    output = sdk.files.retrieve(sdk.batches.retrieve(batch.id).output_file_id)
    assert output.expires_at == output.created_at + 3600
    assert delete_expired_files(sessions, service.intake.s3) == 0
    assert sdk.files.content(output.id).text.strip()


def test_a_batch_whose_row_cannot_be_written_leaves_no_job(sessions, tmp_path) -> None:
    """#55 path 8: a batch's job and its batch row are written in one transaction, and the job is handed to the
    workers only once it committed: a database error on the batch row leaves no job running with no batch."""
    dispatched: list[str] = []
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=dispatched.append) as (base_url, key, _, _):
        sdk = client(base_url, key)
        source = upload(sdk, [chat_line("a")])

        def refuse(mapper, connection, target) -> None:
            raise OperationalError("INSERT INTO api_batches", {}, ConnectionResetError("the database went away"))

        event.listen(ApiBatch, "before_insert", refuse)
        try:
            with pytest.raises(openai.InternalServerError):
                sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
        finally:
            event.remove(ApiBatch, "before_insert", refuse)
        with sessions() as session:
            assert session.scalars(select(Job.id)).all() == []
        assert dispatched == []
        sdk = client(base_url, key)  # uvicorn closes a connection whose request raised
        batch = sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
        assert dispatched == [batch.id] and sdk.batches.retrieve(batch.id).status == "validating"


def test_a_batch_cancelled_before_it_ran_lists_every_row_even_once_its_input_is_deleted(parked) -> None:
    """#55 path 5: a cancelled batch's output and error files hold each custom_id once, the rows it never ran as
    `batch_cancelled` errors (OpenAI's); they are read from its input, so deleting the input writes them first."""
    base_url, key, _, _ = parked
    sdk = client(base_url, key)
    source = upload(sdk, [chat_line(f"r{i}") for i in range(3)])
    batch = sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
    sdk.batches.cancel(batch.id)
    assert sdk.files.delete(source.id).deleted  # before any poll wrote the result files
    batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "cancelled" and batch.output_file_id is None
    lines = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert [(line["custom_id"], line["error"]["code"]) for line in lines] == [
        (f"r{i}", "batch_cancelled") for i in range(3)]
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 3)
