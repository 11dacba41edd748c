"""The front doors on the real stack: the Kafka job topic (the README walkthrough: `tokenmill submit --via
kafka`, `tokenmill status --json`, `job_status` in SQL, job events), redelivered and duplicate messages,
rejected messages, and the S3 inbox (a raw drop, and `tokenmill submit --via s3` with its sidecar)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from sqlalchemy import text

from ingest.submit import send
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import job_events, job_row, submit_file, wait_for_job, wait_until

pytestmark = pytest.mark.real_model
STATUSES = ["validating", "queued", "in_progress", "finalizing", "completed"]


def committed_offset(stack, topic: str = "tokenmill.jobs") -> int:
    """The consumer group's committed offset of the job topic's partition (-1 before any commit)."""
    from kafka import KafkaAdminClient, TopicPartition

    admin = KafkaAdminClient(bootstrap_servers=stack.bootstrap)
    try:
        offsets = admin.list_group_offsets("tokenmill-ingest").get("tokenmill-ingest", {})
    finally:
        admin.close()
    found = offsets.get(TopicPartition(topic, 0))
    return found.offset if found else -1


def jobs_where(sessions, condition: str, **params) -> list[dict]:
    with sessions() as session:
        return [dict(r) for r in session.execute(text(f"SELECT * FROM jobs WHERE {condition}"), params).mappings()]


def test_a_kafka_message_becomes_a_completed_job_with_outputs_in_s3(stack, sessions, kafka_job) -> None:
    job = job_row(sessions, kafka_job.id)
    assert job["status"] == "completed", job["error"]
    assert job["source"] == "kafka" and job["source_ref"].startswith("tokenmill.jobs/0/")
    assert job["idempotency_key"] == kafka_job.id, "the CLI sends the job id as the idempotency key"
    assert job["input_uri"] == f"{stack.bucket}/uploads/{kafka_job.id}/sample.parquet"
    assert kafka_job.output_uri == f"{stack.bucket}/outputs/{kafka_job.id}"
    results, errors, manifest = assert_each_id_once(stack.store(kafka_job.output_uri), kafka_job.custom_ids)
    assert not errors and len(results) == 40 and all(0 < r["completion_tokens"] <= 16 for r in results)
    assert manifest["counts"] == {"total": 40, "completed": 40, "failed": 0}


def test_the_readme_walkthrough_shows_the_job_in_status_flower_and_sql(stack, kafka_job) -> None:
    status = json.loads((kafka_job.folder / "status.json").read_text())
    assert status["job"]["status"] == "completed" and len(status["shards"]) == 4
    workers = json.loads((kafka_job.folder / "workers.json").read_text())
    assert {name.partition("@")[0] for name in workers} >= {"worker1", "worker2"}
    rows = [line.split("|") for line in (kafka_job.folder / "job_status.txt").read_text().splitlines()]
    mine = [[cell.strip() for cell in row] for row in rows if row[0].strip() == kafka_job.id]
    assert len(mine) == 1 and mine[0][1:4] == ["completed", "40", "4"] and int(mine[0][4]) > 0


def test_every_status_change_is_published_as_an_event(stack, kafka_job) -> None:
    events = job_events(stack, kafka_job.id)
    assert [e["status"] for e in events] == STATUSES
    assert [e["previous_status"] for e in events] == [None, *STATUSES[:-1]]
    assert events[-1]["requests"] == {"total": 40, "completed": 40, "failed": 0}
    assert events[-1]["tokens"]["completion"] > 0 and all(e["at"] for e in events)


def test_the_same_message_twice_and_the_same_key_twice_are_one_job(stack, sessions) -> None:
    tag = uuid.uuid4().hex[:8]
    spec = {"rows": [{"custom_id": f"dup-{i}", "prompt": f"Say {i}."} for i in range(2)],
            "output_uri": f"{stack.bucket}/dup-{tag}", "sampling": {"max_tokens": 4}}
    first, second = (send(stack.bootstrap, "tokenmill.jobs", json.dumps(spec).encode()) for _ in range(2))
    keyed = {**spec, "output_uri": f"{stack.bucket}/keyed-{tag}", "idempotency_key": f"key-{tag}"}
    third = send(stack.bootstrap, "tokenmill.jobs", keyed)
    fourth = send(stack.bootstrap, "tokenmill.jobs", {**keyed, "output_uri": f"{stack.bucket}/keyed-{tag}-again"})
    wait_until(lambda: committed_offset(stack) > fourth.offset, "the consumer to commit all four messages")

    duplicates = jobs_where(sessions, "output_uri = :uri", uri=f"{stack.bucket}/dup-{tag}")
    assert len(duplicates) == 1 and duplicates[0]["source_ref"] == f"tokenmill.jobs/0/{first.offset}"
    assert second.offset == first.offset + 1
    keyed_jobs = jobs_where(sessions, "idempotency_key = :key", key=f"key-{tag}")
    assert len(keyed_jobs) == 1 and keyed_jobs[0]["output_uri"] == f"{stack.bucket}/keyed-{tag}"
    assert not jobs_where(sessions, "output_uri = :uri", uri=f"{stack.bucket}/keyed-{tag}-again")
    assert third.offset < fourth.offset
    done = wait_for_job(sessions, duplicates[0]["id"])
    assert done["status"] == "completed", done["error"]
    assert_each_id_once(stack.store(done["output_uri"]), ["dup-0", "dup-1"])


def test_a_bad_message_is_stored_as_rejected_and_the_next_one_still_becomes_a_job(stack, sessions) -> None:
    tag = uuid.uuid4().hex[:8]
    not_json = send(stack.bootstrap, "tokenmill.jobs", b"{this is not json", key=f"bad-{tag}")
    bad_spec = send(stack.bootstrap, "tokenmill.jobs", {"rows": [{"custom_id": "x", "prompt": "y"}],
                                                        "sampling": {"max_tokens": 0}})
    good = send(stack.bootstrap, "tokenmill.jobs", {"rows": [{"custom_id": "after-bad", "prompt": "Hello"}],
                                                    "output_uri": f"{stack.bucket}/after-bad-{tag}",
                                                    "sampling": {"max_tokens": 3}})
    job = wait_until(lambda: jobs_where(sessions, "source_ref = :ref", ref=f"tokenmill.jobs/0/{good.offset}"),
                     "the valid message after the bad ones to become a job")[0]
    with sessions() as session:
        rejected = {r.offset: r for r in session.execute(text(
            'SELECT * FROM rejected_messages WHERE topic = :t AND "offset" IN (:a, :b)'),
            {"t": "tokenmill.jobs", "a": not_json.offset, "b": bad_spec.offset})}
    assert set(rejected) == {not_json.offset, bad_spec.offset}
    assert rejected[not_json.offset].error.startswith("not JSON")
    assert rejected[not_json.offset].payload == "{this is not json" and rejected[not_json.offset].key == f"bad-{tag}"
    assert rejected[not_json.offset].partition == not_json.partition == 0
    assert "sampling: max_tokens must be an integer >= 1, got 0" in rejected[bad_spec.offset].error
    assert wait_for_job(sessions, job["id"])["status"] == "completed"


def test_a_file_dropped_in_the_inbox_becomes_a_completed_job(stack, sessions, tmp_path) -> None:
    rows = prompt_rows(4, "drop")
    name = f"drop-{uuid.uuid4().hex[:8]}"
    inbox = stack.store(f"{stack.bucket}/inbox")
    inbox.put_bytes(f"{name}.job.json", json.dumps({"sampling": {"max_tokens": 3}, "shard_size": 2}).encode())
    inbox.put_file(f"{name}.parquet", write_parquet(tmp_path / "in.parquet", rows))
    etag = inbox.fingerprint(f"{name}.parquet")["etag"]

    def seen():
        with sessions() as session:
            return session.execute(text("SELECT job_id, error FROM inbox_objects WHERE key = :k"),
                                   {"k": f"inbox/{name}.parquet"}).one_or_none()

    job_id, error = wait_until(seen, "the watcher to take the dropped file", timeout=60)
    assert error is None and job_id
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed", job["error"]
    assert job["source"] == "s3" and job["source_ref"] == f"{stack.bucket}/inbox/{name}.parquet@{etag}"
    assert job["output_uri"] == f"{stack.bucket}/outputs/{name}-{etag[:12]}"
    assert job["settings"]["sampling"] == {"max_tokens": 3} and job["settings"]["shard_size"] == 2
    assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])

    inbox.put_file(f"{name}.parquet", tmp_path / "in.parquet")  # the same content again: the same ETag
    time.sleep(6)  # a few scans
    assert len(jobs_where(sessions, "source_ref LIKE :ref", ref=f"%/inbox/{name}.parquet@%")) == 1


def test_submit_via_s3_sends_the_file_and_its_sidecar_to_the_inbox(stack, sessions, tmp_path) -> None:
    rows = prompt_rows(3, "via-s3")
    path = write_parquet(tmp_path / "mine.parquet", rows)
    output = f"{stack.bucket}/via-s3-{uuid.uuid4().hex[:8]}"
    job_id = submit_file(stack, path, "--output", output, "--max-tokens", "4", via="s3")
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed", job["error"]
    assert job["source"] == "s3" and job["output_uri"] == output and job["settings"]["sampling"]["max_tokens"] == 4
    assert job["input_uri"] == f"{stack.bucket}/inbox/{job_id}-mine.parquet"
    assert_each_id_once(stack.store(output), rows["custom_id"])
