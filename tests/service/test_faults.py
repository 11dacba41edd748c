"""Faults of a real deployment, injected on the real stack while jobs run. Each test ends with every custom_id
exactly once in the outputs and none of its jobs left non-terminal."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid

import pytest
from sqlalchemy import text

from ingest.submit import send
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows
from tests.service.conftest import TERMINAL, job_row, shard_rows, submit_file, wait_for_job, wait_until
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


def test_a_redis_flushall_mid_job_loses_no_shard(stack, sessions, tmp_path) -> None:
    """Redis (broker and result backend) loses every queued task; the next sweep finds the broker marker gone and
    sends the shards that wait with no task again at once, well within the grace period (10 s here)."""
    import redis

    from tests.jobs.jobhelpers import write_parquet

    rows = prompt_rows(24, "flush")
    path = write_parquet(tmp_path / "flush.parquet", rows)
    job_id = submit_file(stack, path, "--output", f"{stack.bucket}/flush-{uuid.uuid4().hex[:8]}",
                         "--shard-size", "2", "--max-tokens", "24")
    wait_until(lambda: any(s["status"] == "completed" for s in shard_rows(sessions, job_id)),
               "a first shard to complete", timeout=180)
    client = redis.Redis(port=stack.state["ports"]["redis"])
    client.flushall()
    flushed = time.monotonic()
    waiting = [s for s in shard_rows(sessions, job_id) if s["status"] == "pending"]
    assert waiting, "every shard had started before the flush: nothing was lost"
    worker_logs = lambda: "".join(p.read_text(errors="replace") for p in (stack.dir / "logs").glob("worker*.log"))
    wait_until(lambda: "the broker lost its state" in worker_logs(), "the sweep to notice the lost broker",
               timeout=8, every=0.2)
    assert time.monotonic() - flushed < 10, "noticed only after the grace period"
    job = wait_for_job(sessions, job_id, timeout=300)
    assert job["status"] == "completed", job["error"]
    assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])
    assert_all_ended(sessions, [job_id])
    logs = "".join(path.read_text(errors="replace") for path in (stack.dir / "logs").glob("worker*.log"))
    assert re.search(rf"job {job_id}: shard \d+ has been \w+ since .* with no task; sending it again", logs)


def test_seaweedfs_down_mid_job_is_waited_out_without_using_up_attempts(stack, sessions, tmp_path) -> None:
    """S3 stopped for 15 s (longer than the stack's longest wait between transient retries, 6 s) while shards run
    (the stack allows 2 attempts a shard): the shards that hit the outage wait it out, their attempts not counted,
    and the job completes."""
    from tests.jobs.jobhelpers import write_parquet
    from tests.service.conftest import stack_module

    module, weed_dir, port = stack_module(), str(stack.dir / "seaweedfs"), stack.state["ports"]["s3"]
    script = str(module.SCRIPTS / "seaweedfs.sh")
    rows = prompt_rows(16, "s3down")
    job_id = submit_file(stack, write_parquet(tmp_path / "s3down.parquet", rows), "--output",
                         f"{stack.bucket}/s3down-{uuid.uuid4().hex[:8]}", "--shard-size", "2", "--max-tokens", "24")
    wait_until(lambda: any(s["status"] == "completed" for s in shard_rows(sessions, job_id)),
               "a first shard to complete", timeout=180)
    subprocess.run(["bash", script, "stop", weed_dir], check=True, timeout=60)
    seen_errors: set[str] = set()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            seen_errors |= {s["error"] for s in shard_rows(sessions, job_id) if s["error"]}
            time.sleep(0.5)
    finally:
        subprocess.run(["bash", script, "start", weed_dir, str(port)], env={**stack.env, **module.script_env()},
                       check=True, timeout=180, capture_output=True)
    assert seen_errors, "no shard met the outage"
    assert job_row(sessions, job_id)["status"] not in TERMINAL, "the job ended during the outage"
    job = wait_for_job(sessions, job_id, timeout=300)
    assert job["status"] == "completed", job["error"]
    assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])
    charged = {s["index"]: s["attempts"] for s in shard_rows(sessions, job_id) if s["attempts"] != 1}
    assert not charged, f"shards that met the outage used attempts: {charged}"
    assert_all_ended(sessions, [job_id])


def test_a_bad_object_in_the_inbox_is_recorded_and_the_watcher_goes_on(stack, sessions, tmp_path) -> None:
    from tests.jobs.jobhelpers import write_parquet

    tag = uuid.uuid4().hex[:8]
    inbox = stack.store(f"{stack.bucket}/inbox")
    inbox.put_bytes(f"a-bad-{tag}.job.json", b'{"sampling": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    inbox.put_bytes(f"b-bad-{tag}.job.json", json.dumps(
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": "4"}}).encode())
    rows = prompt_rows(3, "after-bad-drop")
    for name in (f"a-bad-{tag}", f"b-bad-{tag}", f"c-good-{tag}"):
        inbox.put_file(f"{name}.parquet", write_parquet(tmp_path / "in.parquet", rows))

    def seen(name: str):
        with sessions() as session:
            return session.execute(text("SELECT job_id, error FROM inbox_objects WHERE key = :k"),
                                   {"k": f"inbox/{name}.parquet"}).one_or_none()

    job_id, error = wait_until(lambda: seen(f"c-good-{tag}"), "the watcher to take the good file", timeout=90)
    assert error is None and job_id
    assert seen(f"a-bad-{tag}") == (None, "nested too deep (the limit is 32 levels)")
    bad_type = seen(f"b-bad-{tag}")
    assert bad_type[0] is None and "num_speculative_tokens must be int, got str '4'" in bad_type[1]
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed", job["error"]
    assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])
    assert_all_ended(sessions, [job_id])
