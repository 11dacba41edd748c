"""The fuzz test of the way in, end to end on the real stack (the 10,000-example run on SQLite is
tests/jobs/test_fuzz_front_doors.py): random Kafka values through tansu and random inbox keys through
SeaweedFS each become a job or a recorded rejection, and the front doors keep taking what comes after."""

from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaProducer
from sqlalchemy import text

from ingest.intake import bounded_key, content_key
from ingest.job_request import parse_request
from ingest.submit import send
from storage.objectstore import is_under
from tests.jobs.test_fuzz_front_doors import kafka_values
from tests.service.conftest import wait_for_job, wait_until
from tests.service.test_front_doors import committed_offset

pytestmark = pytest.mark.real_model
MESSAGES = 150
KEYS = 25
NOT_SETTINGS = ("rows", "sampling", "engine", "input_uri")  # no job here may run long on the workers


def test_random_kafka_values_through_tansu_each_become_a_job_or_a_rejection(stack, sessions) -> None:
    tag = uuid.uuid4().hex[:8]
    base = {"input_uri": f"{stack.bucket}/fuzz-{tag}/missing.parquet", "output_uri": f"{stack.bucket}/fuzz-{tag}/o"}
    sent: dict[int, bytes | None] = {}
    producer = KafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")

    @settings(max_examples=MESSAGES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(value=kafka_values(f"{stack.bucket}/fuzz-{tag}", "/tmp/tokenmill-fuzz-outside", base))
    def produce(value: bytes | None) -> None:
        if value and any(f'"{name}"'.encode() in value for name in NOT_SETTINGS[:3]):
            value = json.dumps(base).encode()  # a job that fails validation quickly, not one that generates
        sent[producer.send("tokenmill.jobs", value=value, key=b"fuzz").get(timeout=30).offset] = value

    try:
        produce()
    finally:
        producer.close(timeout=5)
    good = send(stack.bootstrap, "tokenmill.jobs", {"rows": [{"custom_id": "after", "prompt": "Hi"}],
                                                   "output_uri": f"{stack.bucket}/fuzz-{tag}-after",
                                                   "sampling": {"max_tokens": 2}}).offset

    wait_until(lambda: committed_offset(stack) > good, "the consumer to take every message", timeout=240)
    with sessions() as session:
        rejected = dict(session.execute(text(
            'SELECT "offset", error FROM rejected_messages WHERE topic = \'tokenmill.jobs\' AND "offset" >= :o'),
            {"o": min(sent)}).all())
        jobs = session.execute(text("SELECT id, idempotency_key, source_ref, input_uri, output_uri FROM jobs "
                                    "WHERE source = 'kafka'")).mappings().all()
    by_ref = {job["source_ref"]: job for job in jobs}
    by_key = {job["idempotency_key"]: job for job in jobs}
    made = []
    for offset, value in sent.items():
        if offset in rejected:
            assert rejected[offset], "a rejection says why"
            continue
        job = by_ref.get(f"tokenmill.jobs/0/{offset}")
        if job is None:  # a duplicate of an earlier message: it found that message's job
            request = parse_request(value)
            job = by_key[bounded_key(request.idempotency_key or content_key("kafka", request.model_dump_json()))]
        made.append(job)
    assert len(rejected) > MESSAGES // 3 and made, (len(rejected), len(made))
    assert all(is_under(job["input_uri"], stack.bucket) and is_under(job["output_uri"], stack.bucket) for job in made)
    after = by_ref[f"tokenmill.jobs/0/{good}"]
    assert wait_for_job(sessions, after["id"])["status"] == "completed"


def test_random_inbox_keys_through_seaweedfs_are_each_recorded(stack, sessions) -> None:
    tag = uuid.uuid4().hex[:8]
    inbox = stack.store(f"{stack.bucket}/inbox")
    names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=260)
    put: list[str] = []

    @settings(max_examples=KEYS, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(name=names)
    def drop(name: str) -> None:
        key = f"fuzz-{tag}/{name}"
        try:
            inbox.put_bytes(key, b"not parquet")
        except Exception:  # a key S3 itself refuses never reaches the watcher
            return
        put.append(key)

    drop()
    inbox.put_bytes(f"fuzz-{tag}-after.jsonl", b"")
    assert len(put) >= KEYS // 2
    listed = [key for key in inbox.list(f"fuzz-{tag}/") if not key.endswith(".job.json")]
    listed = [k for k in listed if not k.rsplit("/", 1)[-1].startswith((".", ".tmp-")) and k.rsplit("/", 1)[-1]]

    def recorded():
        with sessions() as session:
            rows = dict(session.execute(text("SELECT key, coalesce(job_id, error) FROM inbox_objects "
                                             "WHERE key LIKE :p"), {"p": f"inbox/fuzz-{tag}%"}).all())
        keys = [f"inbox/{k}".replace("\x00", "\ufffd") for k in [*listed, f"fuzz-{tag}-after.jsonl"]]
        return rows if all(rows.get(k) for k in keys) else None

    rows = wait_until(recorded, f"the watcher to record {len(listed) + 1} objects", timeout=120)
    assert rows[f"inbox/fuzz-{tag}-after.jsonl"] and len(rows) >= len(listed) + 1
