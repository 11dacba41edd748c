"""Celery workers on the real stack: one job's shards split over two workers in parallel, a worker SIGKILLed
with two shards in flight, a shard that kills its worker every time, and a cancel during a run."""

from __future__ import annotations

import os
import signal
import time

import pytest

from storage.formats import MANIFEST_KEY
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import (
    job_events,
    job_row,
    shard_rows,
    shards_held,
    stack_module,
    submit_file,
    tokenmill,
    wait_for_job,
    wait_for_workers,
    wait_until,
    worker_pid,
)
from tests.service.faulty_engine import POISON

pytestmark = pytest.mark.real_model


def pid_of(shard: dict) -> int:
    return worker_pid(shard["worker"])


def test_two_workers_run_one_jobs_shards_in_parallel(stack, sessions, kafka_job) -> None:
    shards = shard_rows(sessions, kafka_job.id)
    assert len(shards) == 4 and all(s["status"] == "completed" and s["attempts"] == 1 for s in shards)
    workers = set(kafka_job.shard_workers.values())  # read when the job ended: later tests restart workers
    assert workers == {"worker1", "worker2"}, f"the shards ran on {workers} only"
    overlapping = [(a["index"], b["index"]) for a in shards for b in shards if a["worker"] != b["worker"]
                   and a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]]
    assert overlapping, "no two shards of the job ran at the same time on different workers"


def test_a_worker_killed_with_shards_in_flight_has_them_redone_on_the_other(stack, sessions, tmp_path) -> None:
    rows = prompt_rows(12, "kill")
    job_id = submit_file(stack, write_parquet(tmp_path / "in.parquet", rows), "--shard-size", "2",
                         "--max-tokens", "40")

    def a_worker_with_two_running_shards():
        running = [s for s in shard_rows(sessions, job_id) if s["status"] == "running"]
        by_worker = {w: [s for s in running if s["worker"] == w] for w in {s["worker"] for s in running}}
        return next((shards for shards in by_worker.values() if len(shards) >= 2), None)

    victims = wait_until(a_worker_with_two_running_shards, "a worker with two shards in flight", timeout=120,
                         every=0.05)
    killed = stack.worker_of(pid_of(victims[0]))
    os.killpg(stack.state["processes"][killed], signal.SIGKILL)
    try:
        job = wait_for_job(sessions, job_id, timeout=240)
        assert job["status"] == "completed", job["error"]
        shards = {s["index"]: s for s in shard_rows(sessions, job_id)}
        for victim in victims:
            redone = shards[victim["index"]]
            assert redone["attempts"] == 2 and redone["status"] == "completed"
            assert stack.worker_of(pid_of(redone)) != killed, "the shard must be redone by the surviving worker"
        assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])
    finally:
        stack_module().restart(stack.dir, killed)
        stack.reload()
        wait_for_workers(stack)


def test_a_shard_that_kills_its_worker_every_time_ends_with_its_rows_as_errors(stack, sessions, tmp_path) -> None:
    """Past the attempt limit the poisoned shard is not run again: its rows end as server_error errors and the job
    completes, every custom_id once (OpenAI's per-request failures)."""
    rows = prompt_rows(4, "poison")
    rows["prompt"][2] = f"{POISON}: this row crashes the engine"
    job_id = submit_file(stack, write_parquet(tmp_path / "in.parquet", rows), "--shard-size", "2",
                         "--max-tokens", "4")
    job = wait_for_job(sessions, job_id, timeout=300)
    assert job["status"] == "completed", job["error"]
    poisoned = shard_rows(sessions, job_id)[1]
    assert (poisoned["status"], poisoned["attempts"], poisoned["rows_failed"]) == ("completed", 3, 2)  # 2 runs, 1 write
    _, errors, _ = assert_each_id_once(stack.store(job["output_uri"]), rows["custom_id"])
    # shard 0 shares the worker's engine with the poisoned shard 1, so it dies with it and may use its attempts too
    assert {"poison-0002", "poison-0003"} <= {e["custom_id"] for e in errors}
    assert {e["code"] for e in errors} == {"server_error"}
    assert job["requests_completed"] + job["requests_failed"] == 4
    wait_for_workers(stack)  # `tokenmill worker` started its killed worker again


def test_cancel_during_a_run_keeps_the_finished_shards(stack, sessions, tmp_path) -> None:
    # the first shard's rows are short, the others' long: the cancel comes as the first completes, while the
    # others of its round still have hundreds of tokens to generate (a worker sees the cancel within a second)
    lengths = [16] * 4 + [512] * 36
    rows = prompt_rows(40, "cancel") | {"max_tokens": lengths, "min_tokens": lengths}
    job_id = submit_file(stack, write_parquet(tmp_path / "in.parquet", rows), "--shard-size", "4", "--max-tokens",
                         "512")

    def a_shard_completed_and_others_run() -> bool:
        shards = shard_rows(sessions, job_id)
        return (any(s["status"] == "completed" for s in shards)
                and sum(s["status"] == "running" for s in shards) >= 2)

    wait_until(a_shard_completed_and_others_run, "a shard to complete while others run", timeout=240, every=0.05)
    with shards_held(stack):  # the queued shards wait: a freed slot takes none before the cancel
        cancelled_at = time.monotonic()
        tokenmill("cancel", job_id, "--database-url", stack.database_url, env=stack.env)
        job = wait_for_job(sessions, job_id, timeout=60)
    assert job["status"] == "cancelled" and time.monotonic() - cancelled_at < 20
    shards = shard_rows(sessions, job_id)
    statuses = {s["index"]: s["status"] for s in shards}
    completed = [i for i, status in statuses.items() if status == "completed"]
    assert completed and len(completed) < len(shards), statuses
    assert "running" not in statuses.values() and "cancelled" in statuses.values(), statuses
    store = stack.store(job["output_uri"])
    assert all(store.exists(s["output_key"]) for s in shards if s["status"] == "completed")
    assert not store.exists(MANIFEST_KEY)
    assert job_row(sessions, job_id)["requests_completed"] == sum(s["rows_completed"] for s in shards
                                                                  if s["status"] == "completed")
    statuses = [event["status"] for event in job_events(stack, job_id)]
    assert statuses[-2:] == ["cancelling", "cancelled"], statuses
