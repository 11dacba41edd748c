"""Faults of a real deployment, injected on the real stack while jobs run. Each test ends with every custom_id
exactly once in the outputs and none of its jobs left non-terminal."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text

from ingest.submit import send
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows
from tests.service.conftest import TERMINAL, job_row, submit_file, wait_for_job, wait_until
from tests.service.test_front_doors import committed_offset, jobs_where

pytestmark = pytest.mark.real_model


def assert_all_ended(sessions, job_ids: list[str]) -> None:
    statuses = {job_id: job_row(sessions, job_id)["status"] for job_id in job_ids}
    assert all(status in TERMINAL for status in statuses.values()), statuses


def send_null(bootstrap: str, topic: str):
    """A message whose value is null (a tombstone)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        return producer.send(topic, value=None, key=b"null-value").get(timeout=30)
    finally:
        producer.close(timeout=5)


def test_poison_messages_are_rejected_and_the_job_after_them_completes(stack, sessions) -> None:
    tag = uuid.uuid4().hex[:8]
    row = [{"custom_id": "x", "prompt": "y"}]
    poison = {
        "null value": send_null(stack.bootstrap, "tokenmill.jobs"),
        "not UTF-8": send(stack.bootstrap, "tokenmill.jobs", b'{"rows": "\xff\xfe"}'),
        "nested 5,000 deep": send(stack.bootstrap, "tokenmill.jobs", b"[" * 5000 + b"]" * 5000),
        "wrong type": send(stack.bootstrap, "tokenmill.jobs", {
            "rows": row, "output_uri": f"{stack.bucket}/poison-{tag}",
            "speculative_config": {"method": "ngram", "num_speculative_tokens": "4"}}),
        "too large": send(stack.bootstrap, "tokenmill.jobs", {  # the stack's limit: 256 KiB
            "rows": [{"custom_id": f"big-{i}", "prompt": "z" * 1000} for i in range(300)],
            "output_uri": f"{stack.bucket}/poison-big-{tag}"}),
        "huge priority": send(stack.bootstrap, "tokenmill.jobs", {
            "rows": row, "output_uri": f"{stack.bucket}/poison-prio-{tag}", "priority": 10**30}),
    }
    rows = [{"custom_id": f"after-poison-{i}", "prompt": f"Count to {i}."} for i in range(6)]
    good = send(stack.bootstrap, "tokenmill.jobs", {"rows": rows, "output_uri": f"{stack.bucket}/after-poison-{tag}",
                                                    "sampling": {"max_tokens": 4}, "shard_size": 2})
    job = wait_until(lambda: jobs_where(sessions, "source_ref = :ref", ref=f"tokenmill.jobs/0/{good.offset}"),
                     "the job after the poison messages", timeout=60)[0]
    wait_until(lambda: committed_offset(stack) > good.offset, "the consumer to commit the job's offset")
    with sessions() as session:
        rejected = {r.offset: r for r in session.execute(text(
            'SELECT * FROM rejected_messages WHERE topic = :t AND "offset" >= :first AND "offset" < :good'),
            {"t": "tokenmill.jobs", "first": min(m.offset for m in poison.values()), "good": good.offset})}
    errors = {what: rejected[sent.offset].error for what, sent in poison.items()}
    assert errors["null value"] == "empty message (null value)"
    assert errors["not UTF-8"].startswith("not JSON")
    assert errors["nested 5,000 deep"].startswith("nested too deep")
    assert "speculative_config: num_speculative_tokens must be int, got str '4'" in errors["wrong type"]
    assert errors["too large"].startswith("too large") and "262144" in errors["too large"]
    assert "priority" in errors["huge priority"]
    assert all(rejected[sent.offset].partition == 0 for sent in poison.values())
    assert not jobs_where(sessions, "output_uri LIKE :uri", uri=f"{stack.bucket}/poison-%{tag}")

    done = wait_for_job(sessions, job["id"])
    assert done["status"] == "completed", done["error"]
    assert_each_id_once(stack.store(done["output_uri"]), [r["custom_id"] for r in rows])
    assert_all_ended(sessions, [job["id"]])


def test_a_seed_out_of_range_fails_its_row_only(stack, sessions, tmp_path) -> None:
    """19 good rows and one with seed 2^64 at temperature 0.7 (sampled): 19 outputs, 1 error, job completed."""
    ids = prompt_rows(20, "seed")["custom_id"]
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Name a colour ({cid}).", "max_tokens": 4, "temperature": 0.7,
                       "seed": 2**64 if cid == ids[7] else 7}} for cid in ids]
    path = tmp_path / "seeds.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job_id = submit_file(stack, path, "--output", f"{stack.bucket}/seeds-{uuid.uuid4().hex[:8]}",
                         "--shard-size", "10")
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed", job["error"]
    results, errors, manifest = assert_each_id_once(stack.store(job["output_uri"]), ids)
    assert len(results) == 19 and [e["custom_id"] for e in errors] == [ids[7]]
    assert "seed must be an integer in [0, 2^63), got 18446744073709551616" in json.dumps(errors[0])
    assert manifest["counts"] == {"total": 20, "completed": 19, "failed": 1}
    assert_all_ended(sessions, [job_id])
