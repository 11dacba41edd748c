"""Jobs of many shards: settling after a shard counts shards in SQL (no job loads all its shards after each one),
and a heartbeat that renews a shard its own claim just completed does not call it taken over."""

from __future__ import annotations

from storage import claims
from storage import repository as repo
from storage.models import ShardStatus, utcnow
from storage.states import transition
from tests.jobs.test_claims import make_job
from workers.leases import LeaseHeartbeat, shard_claim


def complete(session, shard) -> None:
    shard.status, shard.finished_at = ShardStatus.COMPLETED.value, utcnow()


def test_the_last_completed_shard_moves_the_job_to_finalizing_without_loading_its_shards(sqlite_sessions, tmp_path):
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=3)
    with sqlite_sessions.begin() as session:
        transition(repo.get_job(session, job_id), "in_progress")
    for index in range(3):
        with sqlite_sessions.begin() as session:
            job = repo.get_job(session, job_id, for_update=True)
            complete(session, repo.get_shard(session, job_id, index))  # flushed by settle's count
            settled = claims.settle(job)
            assert "shards" not in job.__dict__  # counted, not loaded
            assert settled == ("finalizing" if index == 2 else None) and job.status == (
                "finalizing" if index == 2 else "in_progress")


def test_a_cancel_settles_once_no_shard_runs(sqlite_sessions, tmp_path):
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=2)
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, job_id)
        transition(job, "in_progress")
        repo.get_shard(session, job_id, 0).status = ShardStatus.RUNNING.value
        transition(job, "cancelling")
    with sqlite_sessions.begin() as session:
        assert claims.settle(repo.get_job(session, job_id, for_update=True)) is None  # shard 0 still runs
        repo.get_shard(session, job_id, 0).status = ShardStatus.CANCELLED.value
        assert claims.settle(repo.get_job(session, job_id, for_update=True)) == "cancelled"


def test_a_renewal_after_the_claims_own_commit_is_not_a_takeover(sqlite_sessions, tmp_path):
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1)
    with sqlite_sessions.begin() as session:
        shard = repo.shards(session, job_id)[0]
        repo.start_shard(shard, "here:1", utcnow())
        token = shard.claim_token
        complete(session, shard)  # its commit, between the heartbeat reading its claims and renewing them
    heartbeat = LeaseHeartbeat(sqlite_sessions, {shard_claim(shard.id): token})
    heartbeat.beat()
    assert not heartbeat.lost
    stale = LeaseHeartbeat(sqlite_sessions, {shard_claim(shard.id): token - 1})  # an older claim's
    stale.beat()
    assert stale.lost
