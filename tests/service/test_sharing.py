"""Jobs sharing the stack's workers (each holds K=2 shards in flight in one engine): a higher priority job
submitted while a lower one runs finishes first, a small job sent while a large one of equal priority runs starts
within about one shard's time instead of behind the large job's queued shards, and cancelling one of two jobs
sharing a worker leaves the other to complete with each custom_id exactly once.

The workers stop taking shards (`shards_held`) while the second job is sent and planned, so its shards are in the
broker while the first job's later ones still wait there, however slow the machine is to submit and plan it."""

from __future__ import annotations

import pytest

from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import shard_rows, shards_held, submit_file, tokenmill, wait_for_job, wait_until

pytestmark = pytest.mark.real_model


def submit_rows(stack, tmp_path, name: str, count: int, *args: str,
                **per_row: list[int] | int) -> tuple[str, list[str]]:
    """A job of `count` prompt rows; `per_row` adds sampling columns (one value for every row, or a list)."""
    rows = prompt_rows(count, name) | {key: value if isinstance(value, list) else [value] * count
                                       for key, value in per_row.items()}
    return submit_file(stack, write_parquet(tmp_path / f"{name}.parquet", rows), *args), rows["custom_id"]


def started(sessions, job_id: str) -> None:
    wait_until(lambda: any(s["status"] == "running" for s in shard_rows(sessions, job_id)), f"job {job_id} to start",
               every=0.1)


def send_while_held(stack, tmp_path, name: str, count: int, shards: int, *args: str,
                    **per_row) -> tuple[str, list[str]]:
    """Sends a job while the workers take no new shard, and lets them go on once its `shards` messages are in the
    broker."""
    with shards_held(stack) as held:
        before = held.messages()
        job = submit_rows(stack, tmp_path, name, count, *args, **per_row)
        held.wait_for(shards, since=before)
    return job


def test_the_higher_priority_job_finishes_first(stack, sessions, tmp_path) -> None:
    # 4 shard slots: the low job's first four shards run; the high job's two go before its eight others
    low, _ = submit_rows(stack, tmp_path, "low", 12, "--shard-size", "1", "--max-tokens", "48", min_tokens=48)
    started(sessions, low)
    high, _ = send_while_held(stack, tmp_path, "high", 2, 2, "--shard-size", "1", "--max-tokens", "12",
                              "--priority", "5")
    low_job, high_job = wait_for_job(sessions, low, 240), wait_for_job(sessions, high, 240)
    assert low_job["status"] == high_job["status"] == "completed"
    assert high_job["completed_at"] < low_job["completed_at"]
    last_high_shard = max(s["finished_at"] for s in shard_rows(sessions, high))
    # in queue order, all twelve low shards (queued first) would start before any high one
    assert sum(s["started_at"] > last_high_shard for s in shard_rows(sessions, low)) >= 1, \
        "the low job's later shards must wait for the high job's"


def test_a_small_job_sent_during_a_large_one_of_equal_priority_starts_within_a_shard(stack, sessions,
                                                                                      tmp_path) -> None:
    # 4 shard slots: the large job's first four shards run; the small job's one shard goes before its eight others
    large, _ = submit_rows(stack, tmp_path, "large", 12, "--shard-size", "1", "--max-tokens", "64", min_tokens=64)
    started(sessions, large)
    small, _ = send_while_held(stack, tmp_path, "small", 1, 1, "--max-tokens", "16")
    small_job, large_job = wait_for_job(sessions, small, 240), wait_for_job(sessions, large, 240)
    assert small_job["status"] == large_job["status"] == "completed"
    small_started = shard_rows(sessions, small)[0]["started_at"]
    # in queue order it would start after all of the large job's shards, queued before it
    assert sum(s["started_at"] > small_started for s in shard_rows(sessions, large)) >= 1, \
        "the small job waited behind the large job's queued shards"
    assert small_job["completed_at"] < large_job["completed_at"], "both jobs must progress at once"


def test_cancelling_one_of_two_jobs_sharing_a_worker_leaves_the_other_whole(stack, sessions, tmp_path) -> None:
    # both sent while the workers take nothing: the doomed job's first four shards (queued first, each a different
    # length) take every slot; the kept job's, queued before the doomed job's four others, take the slot of the
    # first to end, beside its longer neighbour on that worker
    lengths = [32, 160, 288, 416] * 2
    with shards_held(stack) as held:
        before = held.messages()
        doomed, _ = submit_rows(stack, tmp_path, "doomed", 8, "--shard-size", "1", "--max-tokens", "416",
                                max_tokens=lengths, min_tokens=lengths)
        held.wait_for(8, since=before)
        # the kept rows run 96 tokens at least: a shard that ends in a second can start and end between two polls
        kept, kept_ids = submit_rows(stack, tmp_path, "kept", 4, "--shard-size", "1", "--max-tokens", "128",
                                     min_tokens=96)
        held.wait_for(8 + 4, since=before)

    def sharing() -> set[str]:  # a worker running shards of both jobs at once
        running = [s for s in shard_rows(sessions, kept) + shard_rows(sessions, doomed) if s["status"] == "running"]
        of = {job_id: {s["worker"] for s in running if s["job_id"] == job_id} for job_id in (kept, doomed)}
        return of[kept] & of[doomed]

    wait_until(sharing, "a worker running shards of both jobs", timeout=240, every=0.05)
    tokenmill("cancel", doomed, "--database-url", stack.database_url, env=stack.env)
    assert wait_for_job(sessions, doomed, 60)["status"] == "cancelled"
    job = wait_for_job(sessions, kept, 240)
    assert job["status"] == "completed", job["error"]
    assert all(s["attempts"] == 1 for s in shard_rows(sessions, kept)), "the kept job's shards must run once"
    assert_each_id_once(stack.store(job["output_uri"]), kept_ids)
