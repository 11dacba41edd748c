"""Job specs and the consumer's handling of messages, on SQLite and a local folder (no broker needed): what is
refused and why, redelivery, duplicates, and inline rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from ingest.job_request import JobRequestError, parse_request
from ingest.kafka_consumer import JobConsumer
from storage.models import Job, RejectedMessage


@dataclass
class Record:
    """The fields of a Kafka ConsumerRecord the consumer reads."""

    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = None


@pytest.fixture
def consumer(local_intake) -> tuple[JobConsumer, list[str]]:
    intake, handed_out = local_intake
    return JobConsumer(intake, "unused:9092", "jobs", "group"), handed_out


def count(sessions, model) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


@pytest.mark.parametrize(("payload", "message"), [
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "a job spec is a JSON object, got list"),
    (b'{"output_uri": "/tmp/o"}', "give exactly one of input_uri or rows"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"temperature": -1}}',
     "sampling: temperature must be a number >= 0, got -1"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"beam": 2}}',
     "sampling: sampling got an unexpected keyword argument 'beam'"),
    (b'{"input_uri": "/i.parquet", "output_uri": "s3://b/../x"}', "output_uri: output URI 's3://b/../x' contains"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "shard_size": 0}', "shard_size: Input should be greater"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "job_id": "7"}', "job_id: Input should be a valid UUID"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "outptu": 1}', "outptu: Extra inputs are not permitted"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "engine": {"kv_cache_mem": 1}}',
     "engine: unknown engine setting(s): kv_cache_mem"),
    (None, "empty message (null value)"),
    (b'{"rows": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deep"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"seed": 18446744073709551616}}',
     "sampling: seed must be an integer in [0, 2^63), got 18446744073709551616"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "priority": 1e400}', "priority:"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "priority": 100000000000000000000}', "priority:"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", '
     b'"speculative_config": {"method": "ngram", "num_speculative_tokens": "4"}}',
     "speculative_config: num_speculative_tokens must be int, got str '4'"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "shard_size": 10000001}', "shard_size: Input should be less "
     "than or equal to 1000000"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"top_k": 1099511627776}}',
     "sampling: top_k must be at most 1048576"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"temperature": Infinity}}',
     "sampling: temperature must be a finite number"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"n": 17}}', "sampling: n must be at most 16"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "sampling": {"stop": ["a","b","c","d","e","f","g","h",'
     b'"i","j","k","l","m","n","o","p","q"]}}', "sampling: stop: at most 16 strings"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", "cache_salt": "' + b"s" * 257 + b'"}', "cache_salt:"),
    (b'{"input_uri": "/i.parquet", "output_uri": "/tmp/o", '
     b'"speculative_config": {"method": "ngram", "prompt_lookup_max": 1000000}}',
     "speculative_config: prompt_lookup_max must be in [1, 64], got 1000000"),
    (b'{"input_uri": "s3://b/in//x.parquet", "output_uri": "/tmp/o"}', "input_uri: the key of"),
])
def test_specs_that_cannot_run_say_which_field_and_why(payload: bytes, message: str) -> None:
    with pytest.raises(JobRequestError) as raised:
        parse_request(payload)
    assert message in str(raised.value)


def test_a_bad_message_is_stored_once_with_where_it_came_from(consumer) -> None:
    job_consumer, handed_out = consumer
    record = Record("jobs", 3, 41, b"not json", key=b"k1")
    assert job_consumer.handle(record) == job_consumer.handle(record) == "rejected"  # redelivered
    sessions = job_consumer.intake.sessions
    with sessions() as session:
        rejected = session.scalars(select(RejectedMessage)).one()
    assert (rejected.topic, rejected.partition, rejected.offset, rejected.key) == ("jobs", 3, 41, "k1")
    assert rejected.payload == "not json" and rejected.error.startswith("not JSON")
    assert handed_out == [] and count(sessions, Job) == 0


def test_engine_settings_for_the_workers_are_refused_not_dropped(consumer, tmp_path: Path) -> None:
    """The workers run the engine they loaded: a job that sets engine settings is rejected, saying why."""
    job_consumer, handed_out = consumer
    spec = {"input_uri": str(tmp_path / "in.parquet"), "output_uri": str(tmp_path / "out"),
            "engine": {"max_num_seqs": 4}}
    assert job_consumer.handle(Record("jobs", 0, 9, json.dumps(spec).encode())) == "rejected"
    sessions = job_consumer.intake.sessions
    with sessions() as session:
        rejected = session.scalars(select(RejectedMessage)).one()
    assert "engine: the service's workers run the engine they loaded" in rejected.error
    assert "max_num_seqs" in rejected.error
    assert handed_out == [] and count(sessions, Job) == 0


def test_redelivered_and_duplicate_messages_are_one_job_with_inline_rows_stored(consumer, tmp_path: Path) -> None:
    job_consumer, handed_out = consumer
    spec = {"rows": [{"custom_id": "a", "prompt": "Hi"}, {"custom_id": "b", "prompt": "Yo"}],
            "output_uri": str(tmp_path / "out"), "sampling": {"max_tokens": 4}}
    first = job_consumer.handle(Record("jobs", 0, 5, json.dumps(spec).encode()))
    again = job_consumer.handle(Record("jobs", 0, 5, json.dumps(spec).encode()))  # redelivered
    reordered = json.dumps(dict(reversed(spec.items())), indent=1).encode()  # the same spec, other bytes
    duplicate = job_consumer.handle(Record("jobs", 0, 6, reordered))
    assert first == again == duplicate and count(job_consumer.intake.sessions, Job) == 1
    with job_consumer.intake.sessions() as session:
        job = session.get(Job, first)
    assert (job.source, job.source_ref, job.status) == ("kafka", "jobs/0/5", "validating")
    assert pq.read_table(job.input_uri[len("file://"):]).to_pylist() == spec["rows"]
    assert handed_out == [first] * 3  # still validating each time: handed out again, the workers skip repeats

    keyed = {**spec, "idempotency_key": "mine", "output_uri": str(tmp_path / "other")}
    assert job_consumer.handle(Record("jobs", 0, 7, json.dumps(keyed).encode())) == job_consumer.handle(
        Record("jobs", 0, 8, json.dumps({**keyed, "output_uri": str(tmp_path / "third")}).encode()))
    assert count(job_consumer.intake.sessions, Job) == 2


def test_a_database_that_is_down_is_retried_not_recorded_as_rejected(tmp_path: Path) -> None:
    """A transient error (here: no database file can be opened) leaves the message for a retry."""
    from ingest.intake import Intake
    from storage import db
    from storage.faults import is_transient
    from storage.objectstore import S3Options

    sessions = db.session_factory(db.make_engine(f"sqlite:///{tmp_path / 'missing' / 'jobs.db'}"))
    intake = Intake(sessions, S3Options(), lambda job_id: None, inline_uri=str(tmp_path / "inline"))
    spec = {"rows": [{"custom_id": "a", "prompt": "Hi"}], "output_uri": str(tmp_path / "out")}
    with pytest.raises(Exception) as raised:
        JobConsumer(intake, "unused:9092", "jobs", "group").handle(Record("jobs", 0, 1, json.dumps(spec).encode()))
    assert is_transient(raised.value), raised.value
    with pytest.raises(Exception) as raised:  # a poison message while the database is down: still a retry
        JobConsumer(intake, "unused:9092", "jobs", "group").handle(Record("jobs", 0, 2, None))
    assert is_transient(raised.value), raised.value


@pytest.mark.parametrize(("fields", "message"), [
    ({"model": "/root/.cache/tokenmill/models/smollm2-135m"}, "model: '/root/.cache/tokenmill/models/smollm2-135m' "
                                                             "is not a model name"),
    ({"model": "llama-70b"}, "model: unknown model 'llama-70b'; registered: smollm2-135m"),
    ({"speculative_config": {"method": "draft", "model": "../models/x"}}, "speculative_config.model: '../models/x' "
                                                                          "is not a model name"),
])
def test_the_service_runs_registered_models_by_name_only(fields: dict, message: str) -> None:
    from ingest.job_request import validate_request
    from storage.job_settings import CELERY, LOCAL

    request = validate_request({"input_uri": "s3://b/in.parquet", "output_uri": "s3://b/out", **fields})
    with pytest.raises(JobRequestError) as raised:
        request.to_job(executor=CELERY)
    assert message in str(raised.value)
    if "speculative_config" not in fields:
        assert request.to_job(executor=LOCAL).model == fields["model"], "tokenmill run keeps paths"


def test_rows_with_a_long_custom_id_or_too_many_messages_fail_alone() -> None:
    from storage.formats.rows import MAX_MESSAGES, check_custom_id, parse_messages

    assert check_custom_id(3, "k" * 512) is None
    error = check_custom_id(3, "k" * 513)
    assert error.code == "invalid_custom_id" and "513 characters long, over the limit of 512" in error.message
    too_many = parse_messages(4, "a", [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1))
    assert too_many.code == "invalid_messages" and "1025 messages" in too_many.message
