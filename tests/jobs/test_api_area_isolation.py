"""The OpenAI API's areas (`files/`, `results/` in its bucket) are the API's alone (issue #56, item 1): no Kafka
message, inbox sidecar, `tokenmill submit` or schedule may name them as input, output or adapter source, whatever
the allow-lists say, while the API's own batches still use them; an API batch's job events name no file and no URI.
And output claims compare prefixes, not strings (item 7): a job cannot write under another live job's output."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from ingest.config import ServiceConfig
from ingest.intake import Intake, OutputClaimed, submit
from ingest.job_request import JobRequestError, validate_request
from ingest.kafka_consumer import JobConsumer
from ingest.policy import FrontDoorPolicy
from ingest.s3_watcher import InboxEntry, InboxWatcher
from ingest.submit import submit_job
from storage import repository as repo
from storage.job_settings import CELERY
from storage.models import Job, JobSource, RejectedMessage
from storage.objectstore import S3Options, UnsafeURI
from storage.states import transition
from tests.jobs.test_fuzz_front_doors import Record
from tests.jobs.test_openai_api import chat_line, client, jsonl, running_api
from workers.events import job_event

BUCKET = "s3://tokenmill"
ALLOW_LISTS = ("TOKENMILL_ALLOWED_INPUT_PREFIXES", "TOKENMILL_ALLOWED_OUTPUT_PREFIXES")
ROWS = [{"custom_id": "a", "prompt": "Hi"}]
# (the spec's fields, the field the refusal names): each names an API area as input, output or adapter source
TRESPASSES = [
    ({"input_uri": f"{BUCKET}/files/file-0123abcd.jsonl", "output_uri": f"{BUCKET}/mine/run-1"}, "input_uri"),
    ({"input_uri": f"{BUCKET}/results/batch-1/batch_output.jsonl", "output_uri": f"{BUCKET}/mine/run-1"},
     "input_uri"),
    ({"rows": ROWS, "output_uri": f"{BUCKET}/results/batch-1"}, "output_uri"),
    ({"rows": ROWS, "output_uri": f"{BUCKET}/files/x"}, "output_uri"),
    ({"rows": ROWS, "output_uri": BUCKET}, "output_uri"),  # the bucket's root holds the areas
    ({"rows": ROWS, "output_uri": f"{BUCKET}/mine/run-1", "lora_modules": {"sql": f"{BUCKET}/files"}},
     "lora_modules.sql"),
    ({"rows": ROWS, "output_uri": f"{BUCKET}/mine/run-1", "lora_modules": {"sql": f"{BUCKET}/results/batch-1"}},
     "lora_modules.sql"),
]


@pytest.fixture(params=["bucket", "*"], ids=["allow-bucket", "allow-anything"])
def open_policy(request, monkeypatch):
    """The service's policy with the allow-lists at their default (the whole bucket), or `*`."""
    for name in ALLOW_LISTS:
        if request.param == "*":
            monkeypatch.setenv(name, "*")
        else:
            monkeypatch.delenv(name, raising=False)
    return FrontDoorPolicy.from_env(BUCKET)


def intake_of(sessions, policy: FrontDoorPolicy, tmp_path: Path) -> Intake:
    return Intake(sessions, S3Options(endpoint_url="http://127.0.0.1:9"), lambda job_id: None,
                  inline_uri=str(tmp_path / "inline"), policy=policy)


def assert_refusal(message: str, field: str, spec: dict) -> None:
    """The refusal names the field and the URI the producer gave, and nothing of the service's settings."""
    named = spec.get("lora_modules", {}).get("sql") if field.startswith("lora") else spec[field]
    assert f"{field}: {named!r}" in message and "OpenAI Batch API" in message, message
    assert "TOKENMILL_" not in message and "allowed prefixes" not in message, message


@pytest.mark.parametrize(("spec", "field"), TRESPASSES)
def test_a_kafka_message_naming_an_api_area_is_rejected(sqlite_sessions, tmp_path, open_policy, spec,
                                                        field) -> None:
    consumer = JobConsumer(intake_of(sqlite_sessions, open_policy, tmp_path), "unused:9092", "jobs", "group")
    assert consumer.handle(Record("jobs", 0, 7, json.dumps(spec).encode(), b"tenant-b")) == "rejected"
    with sqlite_sessions() as session:
        assert session.scalar(select(Job.id)) is None
        error = session.scalar(select(RejectedMessage.error).where(RejectedMessage.offset == 7))
    assert_refusal(error, field, spec)


@pytest.mark.parametrize(("spec", "field"), [(s, f) for s, f in TRESPASSES if f != "input_uri"])
def test_an_inbox_sidecar_naming_an_api_area_is_refused(sqlite_sessions, tmp_path, open_policy, spec,
                                                        field) -> None:
    watcher = InboxWatcher(intake_of(sqlite_sessions, open_policy, tmp_path), f"{BUCKET}/inbox", f"{BUCKET}/outputs")
    entry = InboxEntry("inbox/tenant-b/prompts.parquet", "etag1", datetime.now(UTC) - timedelta(minutes=1))
    sidecar = {key: value for key, value in spec.items() if key != "rows"}
    with pytest.raises(JobRequestError) as refused:
        watcher.accept(entry, json.dumps(sidecar).encode())
    assert_refusal(str(refused.value), field, spec)
    with sqlite_sessions() as session:
        assert session.scalar(select(Job.id)) is None


@pytest.mark.parametrize("via", ["kafka", "s3"])
@pytest.mark.parametrize(("spec", "field"), TRESPASSES)
def test_tokenmill_submit_refuses_an_api_area_before_sending(monkeypatch, spec, field, via) -> None:
    monkeypatch.setenv("TOKENMILL_BUCKET_URI", BUCKET)
    monkeypatch.setenv("TOKENMILL_KAFKA_BOOTSTRAP", "127.0.0.1:9")  # never reached
    monkeypatch.setenv("TOKENMILL_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    for name in ALLOW_LISTS:
        monkeypatch.setenv(name, "*")
    config = ServiceConfig.from_env()
    source = spec.get("input_uri", f"{BUCKET}/datasets/in.parquet")
    settings = {key: value for key, value in spec.items() if key not in ("input_uri", "output_uri", "rows")}
    with pytest.raises(UnsafeURI) as refused:
        submit_job(source, via, config, spec["output_uri"], **settings)
    assert_refusal(str(refused.value), field, spec)


def test_the_front_doors_default_outputs_lie_outside_the_api_areas(monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_BUCKET_URI", BUCKET)
    config = ServiceConfig.from_env()
    config.policy.check_outside_api_areas(f"{config.outputs_uri}/job-1", "output_uri")  # submit's and the inbox's
    config.policy.check_outside_api_areas(f"{BUCKET}/resultsx/a", "output_uri")  # segment-wise
    with pytest.raises(UnsafeURI):
        config.policy.check_outside_api_areas(f"{config.in_bucket('results')}/job-1", "output_uri")


def test_a_local_path_through_a_symlink_into_an_api_area_is_refused(sqlite_sessions, tmp_path, monkeypatch) -> None:
    for name in ALLOW_LISTS:
        monkeypatch.setenv(name, "*")
    bucket = tmp_path / "bucket"
    (bucket / "files").mkdir(parents=True)
    (tmp_path / "innocent").symlink_to(bucket / "files")
    intake = intake_of(sqlite_sessions, FrontDoorPolicy.from_env(str(bucket)), tmp_path)
    request = validate_request({"input_uri": str(tmp_path / "innocent" / "file-1.jsonl"),
                                "output_uri": str(tmp_path / "out")})
    with pytest.raises(JobRequestError, match="input_uri: .* OpenAI Batch API"):
        intake.accept(request, source=JobSource.KAFKA.value, source_ref="jobs/0/1", default_key="k1")


def test_an_api_tenants_upload_is_out_of_a_kafka_producers_reach_while_the_api_uses_it(sessions, tmp_path,
                                                                                       monkeypatch) -> None:
    """The whole way: a tenant uploads and makes a batch through the API (its job reads files/ and writes
    results/); a Kafka message naming that upload, or the batch's results, is rejected; the batch's events name
    neither."""
    for name in ALLOW_LISTS:
        monkeypatch.setenv(name, "*")
    bucket = tmp_path / "bucket"
    with running_api(sessions, str(bucket), None, dispatch=lambda job_id: None) as (base_url, key, _, service):
        sdk = client(base_url, key)
        upload = sdk.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        with sessions() as session:
            api_job = repo.get_job(session, batch.id)
        assert (api_job.source, api_job.status) == ("api", "validating")
        assert api_job.input_uri == f"file://{bucket}/files/{upload.id}.jsonl"
        assert api_job.output_uri == f"file://{bucket}/results/{batch.id}"

        consumer = JobConsumer(intake_of(sessions, FrontDoorPolicy.from_env(str(bucket)), tmp_path),
                               "unused:9092", "jobs", "group")
        thefts = [{"input_uri": api_job.input_uri, "output_uri": str(tmp_path / "mine")},
                  {"rows": ROWS, "output_uri": f"{api_job.output_uri}/x"},
                  {"rows": ROWS, "output_uri": str(tmp_path / "mine"), "lora_modules": {"x": f"file://{bucket}/files"}}]
        for offset, spec in enumerate(thefts):
            assert consumer.handle(Record("jobs", 0, offset, json.dumps(spec).encode(), b"b")) == "rejected"
        with sessions() as session:
            assert session.scalars(select(Job.id)).all() == [batch.id]
            errors = session.scalars(select(RejectedMessage.error).order_by(RejectedMessage.offset)).all()
        assert len(errors) == 3 and all("OpenAI Batch API" in error for error in errors), errors

    event = json.dumps(job_event(api_job, None, "validating"))
    assert "source_ref" not in event and "output_uri" not in event and '"source": "api"' in event
    assert upload.id not in event and "file://" not in event and str(bucket) not in event, event


def test_an_api_batchs_event_carries_no_file_id_or_uri_even_in_its_error(sqlite_sessions, tmp_path) -> None:
    def made(source: str, source_ref: str) -> Job:
        new = validate_request({"input_uri": str(tmp_path / "bucket" / "files" / "file-abc123.jsonl"),
                                "output_uri": str(tmp_path / "bucket" / "results" / str(uuid.uuid4()))}
                               ).to_job(executor=CELERY, source=source, source_ref=source_ref)
        job = submit(sqlite_sessions, new).job
        with sqlite_sessions.begin() as session:
            job = repo.get_job(session, job.id)
            transition(job, "failed", error=f"input {job.input_uri} does not exist")
        return job

    api_job = made(JobSource.API.value, "file-abc123")
    event = job_event(api_job, "validating", "failed")
    assert "source_ref" not in event and "output_uri" not in event
    assert event["error"] and "file-abc123" not in json.dumps(event) and "file://" not in json.dumps(event), event
    kafka_event = job_event(made(JobSource.KAFKA.value, "jobs/0/5"), "validating", "failed")
    assert kafka_event["source_ref"] == "jobs/0/5" and kafka_event["output_uri"].startswith("file://")


def new_job(output_uri: str, tmp_path: Path, name: str):
    return validate_request({"input_uri": str(tmp_path / f"{name}.jsonl"), "output_uri": output_uri}
                            ).to_job(executor=CELERY)


def test_an_output_under_or_over_a_live_jobs_output_is_taken(sqlite_sessions, tmp_path) -> None:
    """A job writing under results/<batch>/x would be wiped with that batch (its results deleted, or its cleanup):
    while the batch lives, no job may write there, nor in a prefix holding the batch's."""
    batch_out = tmp_path / "results" / "batch-1"
    batch = submit(sqlite_sessions, new_job(str(batch_out), tmp_path, "batch")).job
    for nested in (batch_out / "x", batch_out / "x" / "y", tmp_path / "results", tmp_path):
        with pytest.raises(OutputClaimed, match=f"taken by live job {batch.id}"):
            submit(sqlite_sessions, new_job(str(nested), tmp_path, f"n-{nested.name}"))
    intake = Intake(sqlite_sessions, S3Options(), dispatch=lambda job_id: None)
    request = validate_request({"input_uri": str(tmp_path / "k.jsonl"), "output_uri": str(batch_out / "x")})
    with pytest.raises(JobRequestError, match=batch.id):  # a front door's refusal names the owner
        intake.accept(request, source="kafka", source_ref="t/0/1", default_key="k-nested")
    sibling = submit(sqlite_sessions, new_job(str(tmp_path / "results" / "batch-10"), tmp_path, "sibling")).job
    assert sibling.output_claim == f"file://{tmp_path}/results/batch-10", "prefixes compare by segment"
    assert submit(sqlite_sessions, new_job(str(batch_out), tmp_path, "batch")).outcome == "resumed"  # itself

    with sqlite_sessions.begin() as session:
        transition(repo.get_job(session, batch.id), "cancelled")
    inner = submit(sqlite_sessions, new_job(str(batch_out / "x"), tmp_path, "inner")).job  # the prefix is free
    with pytest.raises(OutputClaimed, match=inner.id):  # and retrying the batch now finds the job under it
        submit(sqlite_sessions, new_job(str(batch_out), tmp_path, "batch"))


def test_output_prefix_overlap_on_postgres(pg_databases, tmp_path) -> None:
    from tests.jobs.conftest import migrated_sessions

    sessions = migrated_sessions(pg_databases())
    try:
        outer = submit(sessions, new_job(f"{BUCKET}/out/a", tmp_path, "outer")).job
        with pytest.raises(OutputClaimed, match=outer.id):
            submit(sessions, new_job(f"{BUCKET}/out/a/b_%", tmp_path, "inner"))
        assert submit(sessions, new_job(f"{BUCKET}/out/a_", tmp_path, "like")).outcome == "created"
    finally:
        sessions.kw["bind"].dispose()
