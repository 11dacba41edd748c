"""Jobs sharing the stack's workers (each holds K=2 shards in flight in one engine): a higher priority job
submitted with a lower one finishes first, a small job sent while a large one of equal priority runs starts
within about one shard's time instead of behind the large job's queued shards, and
cancelling one of two jobs sharing a worker leaves the other to complete with each custom_id exactly once."""

from __future__ import annotations

import pytest

from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import shard_rows, submit_file, tokenmill, wait_for_job, wait_until

pytestmark = pytest.mark.real_model


def submit_rows(stack, tmp_path, name: str, count: int, *args: str, min_tokens: int = 0) -> tuple[str, list[str]]:
    rows = prompt_rows(count, name) | ({"min_tokens": [min_tokens] * count} if min_tokens else {})
    return submit_file(stack, write_parquet(tmp_path / f"{name}.parquet", rows), *args), rows["custom_id"]


def test_the_higher_priority_job_finishes_first(stack, sessions, tmp_path) -> None:
    # 4 shard slots in all: the low job's first shards start, then the high job's shards jump its others
    # the low shards run their full 128 tokens (short answers let them all start before the high job is planned)
    low, _ = submit_rows(stack, tmp_path, "low", 12, "--shard-size", "1", "--max-tokens", "128", min_tokens=128)
    wait_until(lambda: any(s["status"] == "running" for s in shard_rows(sessions, low)), "the low job to start",
               every=0.1)
    high, _ = submit_rows(stack, tmp_path, "high", 2, "--shard-size", "1", "--max-tokens", "12", "--priority", "5")
    low_job, high_job = wait_for_job(sessions, low, 240), wait_for_job(sessions, high, 240)
    assert low_job["status"] == high_job["status"] == "completed"
    assert high_job["completed_at"] < low_job["completed_at"]
    last_high_shard = max(s["finished_at"] for s in shard_rows(sessions, high))
    # in queue order, all twelve low shards (queued first) would start before any high one; its planning also
    # waits for a free task thread, so a round or two of low shards go first (with eight, on CI once all did)
    assert sum(s["started_at"] > last_high_shard for s in shard_rows(sessions, low)) >= 1, \
        "the low job's later shards must wait for the high job's"


def test_a_small_job_sent_during_a_large_one_of_equal_priority_starts_within_a_shard(stack, sessions,
                                                                                      tmp_path) -> None:
    # 4 shard slots: the large job's first four shards start; the small job's one shard goes before its others
    # each row runs its 96 tokens (answers ending early let the whole large job start before the small one was
    # planned on a slow 2-core machine)
    large, _ = submit_rows(stack, tmp_path, "large", 24, "--shard-size", "2", "--max-tokens", "96", min_tokens=96)
    wait_until(lambda: any(s["status"] == "running" for s in shard_rows(sessions, large)), "the large job to start",
               every=0.1)
    small, _ = submit_rows(stack, tmp_path, "small", 1, "--max-tokens", "16")
    small_job, large_job = wait_for_job(sessions, small, 240), wait_for_job(sessions, large, 240)
    assert small_job["status"] == large_job["status"] == "completed"
    small_started = shard_rows(sessions, small)[0]["started_at"]
    # in queue order it would start after all twelve of the large job's shards, queued before it
    assert sum(s["started_at"] > small_started for s in shard_rows(sessions, large)) >= 1, \
        "the small job waited behind the large job's queued shards"
    assert small_job["completed_at"] < large_job["completed_at"], "both jobs must progress at once"


def test_cancelling_one_of_two_jobs_sharing_a_worker_leaves_the_other_whole(stack, sessions, tmp_path) -> None:
    # the doomed job first, on every slot; the kept job's one-row shards then take slots as the doomed job's shards
    # end (fairness puts them before its queued ones), each beside a doomed shard still running on that worker
    # long rows, and far more shards than slots: it is nowhere near done when the cancel comes (with 8 shards,
    # on a loaded machine, the kept job's shards started beside its last ones and it completed before the cancel)
    doomed, _ = submit_rows(stack, tmp_path, "doomed", 48, "--shard-size", "2", "--max-tokens", "400",
                            min_tokens=300)
    wait_until(lambda: any(s["status"] == "running" for s in shard_rows(sessions, doomed)), "the doomed job to start",
               every=0.1)
    # the kept rows run 192 tokens at least: a shard that ends in a second can start and finish between two polls
    kept, kept_ids = submit_rows(stack, tmp_path, "kept", 4, "--shard-size", "1", "--max-tokens", "256",
                                 min_tokens=192)

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
