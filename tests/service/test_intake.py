"""Job specs and the consumer's handling of messages, on SQLite and a local folder (no broker needed): what is
refused and why, redelivery, duplicates, and inline rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from ingest.kafka_consumer import JobConsumer
from ingest.spec import SpecError, parse_request
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
])
def test_specs_that_cannot_run_say_which_field_and_why(payload: bytes, message: str) -> None:
    with pytest.raises(SpecError) as raised:
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
