"""A client users have: confluent-kafka (librdkafka) produces a job spec on the stack's job topic and reads the
job's events with `assign()`, as the README shows (a `subscribe()` waits out a group join first)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

pytestmark = pytest.mark.real_model
FINAL = {"completed", "failed", "cancelled", "expired"}


def test_a_job_sent_with_confluent_kafka_runs_and_its_events_arrive_through_assign(stack) -> None:
    job = str(uuid.uuid4())
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce("tokenmill.jobs", key=job, value=json.dumps({
        "job_id": job, "idempotency_key": job, "rows": [{"custom_id": "a", "prompt": "Hello"}],
        "output_uri": f"{stack.bucket}/outputs/{job}", "sampling": {"max_tokens": 4}}))
    assert producer.flush(30) == 0, "the job spec was not delivered"

    events = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": f"test-{job}",
                       "enable.auto.commit": False})
    try:
        partitions = events.list_topics("tokenmill.job-events", timeout=10).topics["tokenmill.job-events"].partitions
        events.assign([TopicPartition("tokenmill.job-events", p, 0) for p in partitions])
        statuses, deadline = [], time.monotonic() + 180
        while not FINAL & set(statuses):
            assert time.monotonic() < deadline, f"events so far: {statuses}"
            message = events.poll(1.0)
            if message is not None and message.error() is None and message.key() == job.encode():
                statuses.append(json.loads(message.value())["status"])
    finally:
        events.close()
    assert statuses[0] == "validating" and statuses[-1] == "completed", statuses
    assert "in_progress" in statuses and "finalizing" in statuses
