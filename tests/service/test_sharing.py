"""Jobs sharing the stack's workers (each holds K=2 shards in flight in one engine): a higher priority job
submitted with a lower one finishes first, two jobs of equal priority both make progress from the start, and
cancelling one of two jobs sharing a worker leaves the other to complete with each custom_id exactly once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import shard_rows, submit_file, tokenmill, wait_for_job, wait_until

pytestmark = pytest.mark.real_model


def submit_rows(stack, tmp_path, name: str, count: int, *args: str) -> tuple[str, list[str]]:
    rows = prompt_rows(count, name)
    return submit_file(stack, write_parquet(tmp_path / f"{name}.parquet", rows), *args), rows["custom_id"]


def test_the_higher_priority_job_finishes_first(stack, sessions, tmp_path) -> None:
    # 4 shard slots in all: the low job's first four start, then the high job's shards jump its other four
    low, _ = submit_rows(stack, tmp_path, "low", 8, "--shard-size", "1", "--max-tokens", "12")
    high, _ = submit_rows(stack, tmp_path, "high", 2, "--shard-size", "1", "--max-tokens", "12", "--priority", "5")
    low_job, high_job = wait_for_job(sessions, low, 240), wait_for_job(sessions, high, 240)
    assert low_job["status"] == high_job["status"] == "completed"
    assert high_job["completed_at"] < low_job["completed_at"]
    last_high_shard = max(s["finished_at"] for s in shard_rows(sessions, high))
    assert sum(s["started_at"] > last_high_shard for s in shard_rows(sessions, low)) >= 2, \
        "the low job's later shards must wait for the high job's"


def test_jobs_of_equal_priority_both_progress_from_the_start(stack, sessions, tmp_path) -> None:
    with ThreadPoolExecutor(2) as pool:  # together: one `tokenmill submit` takes seconds
        first, second = (job_id for job_id, _ in pool.map(
            lambda name: submit_rows(stack, tmp_path, name, 4, "--shard-size", "2", "--max-tokens", "40"),
            ("even-a", "even-b")))
    jobs = [wait_for_job(sessions, job_id) for job_id in (first, second)]
    assert all(job["status"] == "completed" for job in jobs)
    first_done = min(job["finalizing_at"] for job in jobs)
    for job_id in (first, second):
        assert min(s["finished_at"] for s in shard_rows(sessions, job_id)) <= first_done, \
            f"job {job_id} had no completed rows before the other job finished"


def test_cancelling_one_of_two_jobs_sharing_a_worker_leaves_the_other_whole(stack, sessions, tmp_path) -> None:
    kept, kept_ids = submit_rows(stack, tmp_path, "kept", 4, "--shard-size", "2", "--max-tokens", "32")
    doomed, _ = submit_rows(stack, tmp_path, "doomed", 8, "--shard-size", "2", "--max-tokens", "400")

    def sharing() -> set[str]:  # a worker running shards of both jobs at once
        running = [s for s in shard_rows(sessions, kept) + shard_rows(sessions, doomed) if s["status"] == "running"]
        of = {job_id: {s["worker"] for s in running if s["job_id"] == job_id} for job_id in (kept, doomed)}
        return of[kept] & of[doomed]

    wait_until(sharing, "a worker running shards of both jobs", timeout=120, every=0.05)
    tokenmill("cancel", doomed, "--database-url", stack.database_url, env=stack.env)
    assert wait_for_job(sessions, doomed, 60)["status"] == "cancelled"
    job = wait_for_job(sessions, kept, 120)
    assert job["status"] == "completed", job["error"]
    assert all(s["attempts"] == 1 for s in shard_rows(sessions, kept)), "the kept job's shards must run once"
    assert_each_id_once(stack.store(job["output_uri"]), kept_ids)
