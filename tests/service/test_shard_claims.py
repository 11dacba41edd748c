"""The database side of the distributed runner, without a broker or a model: claiming shards (attempt counter,
live and dead workers, the attempt limit), the sweep, and exactly one finisher when shards complete at once."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from datetime import timedelta

from storage import db, migrate
from storage import repository as repo
from storage.job_settings import CELERY, LOCAL, JobSettings
from storage.liveness import worker_id
from storage.models import Job, Shard, utcnow
from workers.job_steps import JobSteps
from workers.leases import shard_claim
from workers.shard_step import ERROR_WRITE_ATTEMPTS, ShardStep
from workers.shards import ShardOutcome
from workers.sweep import sweep


def dead_worker() -> str:
    """host:pid of a process that has exited."""
    process = subprocess.Popen(["true"])
    process.wait()
    return f"{socket.gethostname()}:{process.pid}"


def make_job(sessions, status: str = "in_progress", shards: int = 2, executor: str = CELERY) -> str:
    with sessions.begin() as session:
        job = Job(idempotency_key=f"k-{uuid.uuid4()}", status=status, model="m", input_uri="in",
                  output_uri="out", settings=JobSettings(executor=executor, shard_size=1), requests_total=shards,
                  created_at=utcnow(), finalizing_at=utcnow() if status == "finalizing" else None)
        session.add(job)
        session.flush()
        repo.add_shards(session, job, [(i, i + 1) for i in range(shards)])
        return job.id


def shard_ids(sessions, job_id: str) -> list[int]:
    with sessions() as session:
        return [s.id for s in repo.shards(session, job_id)]


def set_shard(sessions, shard_id: int, **values) -> None:
    with sessions.begin() as session:
        shard = session.get(Shard, shard_id)
        for name, value in values.items():
            setattr(shard, name, value)


def test_claims_count_attempts_skip_live_workers_and_end_the_rows_at_the_limit(sqlite_sessions) -> None:
    job_id = make_job(sqlite_sessions, status="queued")
    first, second = shard_ids(sqlite_sessions, job_id)
    steps = ShardStep(JobSteps(sqlite_sessions, job_id))

    claim = steps.claim_shard(first, max_attempts=2)
    assert claim.decision == "run" and claim.shard.attempts == 1 and claim.job.status == "in_progress"
    assert claim.shard.worker == worker_id()
    steps.steps.held.hold(shard_claim(first))  # while this process runs it
    assert steps.claim_shard(first, max_attempts=2).decision == "busy"
    steps.steps.held.let_go(shard_claim(first))
    retaken = steps.claim_shard(first, max_attempts=3)  # marked running here, but no longer run here
    assert retaken.decision == "run" and retaken.shard.claim_token == 2
    set_shard(sqlite_sessions, first, attempts=1)

    set_shard(sqlite_sessions, first, worker=dead_worker())  # its worker died mid-shard
    assert steps.claim_shard(first, max_attempts=2).shard.attempts == 2
    set_shard(sqlite_sessions, first, worker=dead_worker())
    exhausted = steps.claim_shard(first, max_attempts=2)  # its rows are to end as errors: the job goes on
    assert exhausted.decision == "exhausted" and exhausted.shard.status == "running"
    assert "its shard was tried 2 time(s), the limit" in exhausted.exhausted
    assert steps.steps.load().status == "in_progress"
    set_shard(sqlite_sessions, first, worker=dead_worker(), attempts=2 + ERROR_WRITE_ATTEMPTS)  # and that kept dying
    gave_up = steps.claim_shard(first, max_attempts=2)
    assert gave_up.decision == "gave_up" and gave_up.shard.status == "failed"
    job = steps.steps.load()
    assert job.status == "failed"
    assert job.error.startswith("shard 0 (rows 0-0) failed 5 attempt(s), the limit; last: its worker")
    assert steps.claim_shard(second, max_attempts=2).decision == "stopped"


def test_a_completed_shard_is_not_run_again(sqlite_sessions) -> None:
    job_id = make_job(sqlite_sessions)
    shard = shard_ids(sqlite_sessions, job_id)[0]
    set_shard(sqlite_sessions, shard, status="completed", attempts=1)
    assert ShardStep(JobSteps(sqlite_sessions, job_id)).claim_shard(shard, max_attempts=3).decision == "done"


def test_sweep_requeues_shards_of_dead_workers_and_finishes_cancels(sqlite_sessions) -> None:
    service, cancelling = make_job(sqlite_sessions, shards=4), make_job(sqlite_sessions)
    local = make_job(sqlite_sessions, executor=LOCAL)
    now = utcnow()
    dead_here, alive_here, expired_elsewhere, leased_elsewhere = shard_ids(sqlite_sessions, service)
    running = {"status": "running", "attempts": 1}
    leased = now + timedelta(hours=2)  # liveness is the lease; a dead process on this host ends it early
    set_shard(sqlite_sessions, dead_here, **running, worker=dead_worker(), lease_expires_at=leased)
    set_shard(sqlite_sessions, alive_here, **running, worker=worker_id(), lease_expires_at=leased)
    set_shard(sqlite_sessions, expired_elsewhere, **running, worker="other-host:1", lease_expires_at=now)
    set_shard(sqlite_sessions, leased_elsewhere, **running, worker="other-host:2",
              lease_expires_at=now + timedelta(hours=2))
    set_shard(sqlite_sessions, shard_ids(sqlite_sessions, local)[0], **running, worker=dead_worker())
    with sqlite_sessions.begin() as session:
        repo.get_job(session, cancelling).status = "cancelling"
    stale = make_job(sqlite_sessions, status="finalizing")

    found = sweep(sqlite_sessions, now=now + timedelta(hours=1))
    assert found.requeue == [(service, dead_here, "m"), (service, expired_elsewhere, "m")]
    assert found.cancelled == [cancelling] and found.finalize == []  # its holderless wait starts now
    later = sweep(sqlite_sessions, now=now + timedelta(hours=1, seconds=30))
    assert later.finalize == [stale] and later.requeue == []
    with sqlite_sessions() as session:
        statuses = {job_id: [s.status for s in repo.shards(session, job_id)] for job_id in (service, local)}
        assert repo.get_job(session, cancelling).status == "cancelled"
    assert statuses[service] == ["pending", "running", "pending", "running"]
    assert statuses[local] == ["running", "pending"]  # `tokenmill run` resumes its own jobs
    assert sweep(sqlite_sessions).requeue == []  # requeued once, not at every sweep


def test_the_reconciler_resends_shards_whose_task_was_lost_once_per_grace_period(sqlite_sessions) -> None:
    """Pending or failed shards waiting longer than the grace period lost their task (e.g. a Redis FLUSHALL): they
    are sent again, once per grace period, however busy their queue (#55 path 1)."""
    job_id = make_job(sqlite_sessions, shards=4)
    pending, failed, running, done = shard_ids(sqlite_sessions, job_id)
    set_shard(sqlite_sessions, failed, status="failed", attempts=1, finished_at=utcnow())
    grace, now = timedelta(minutes=5), utcnow()
    set_shard(sqlite_sessions, running, status="running", attempts=1, worker=worker_id(),
              lease_expires_at=now + timedelta(hours=1))
    set_shard(sqlite_sessions, done, status="completed", attempts=1)
    assert sweep(sqlite_sessions, now=now + timedelta(minutes=1), stale=grace).requeue == []  # within the grace
    later = now + timedelta(minutes=6)
    found = sweep(sqlite_sessions, now=later, stale=grace, queued=lambda model: 3)  # a busy queue holds none back
    assert found.requeue == [(job_id, pending, "m"), (job_id, failed, "m")]
    assert sweep(sqlite_sessions, now=later + timedelta(minutes=1), stale=grace).requeue == []  # just resent
    again = sweep(sqlite_sessions, now=later + timedelta(minutes=6), stale=grace)
    assert [shard for _, shard, _ in again.requeue] == [pending, failed]


def test_a_cancel_waits_for_the_job_row_and_cannot_overwrite_finalizing(pg_databases) -> None:
    """The last shard's transaction holds the job row and moves it to finalizing; a cancel arriving meanwhile
    waits for that lock and then sees finalizing, instead of writing cancelling over it."""
    import pytest

    from workers.inprocess import cancel_job

    url = pg_databases()
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url, pool_size=4))
    job_id = make_job(sessions, shards=1)
    outcome: list[object] = []

    def cancel() -> None:
        try:
            outcome.append(cancel_job(sessions, job_id[:8]).status)
        except ValueError as error:
            outcome.append(error)

    with sessions.begin() as session:
        repo.get_job(session, job_id, for_update=True).status = "finalizing"
        canceller = threading.Thread(target=cancel)
        canceller.start()
        canceller.join(timeout=1.0)
        assert canceller.is_alive(), "the cancel did not wait for the job row's lock"
    canceller.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError) and "is finalizing" in str(outcome[0])
    assert JobSteps(sessions, job_id).load().status == "finalizing"
    with pytest.raises(ValueError, match="is finalizing"):
        cancel_job(sessions, job_id)
    sessions.kw["bind"].dispose()


def test_exactly_one_of_the_shards_completing_at_once_finalizes(pg_databases) -> None:
    url = pg_databases()
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url, pool_size=4))
    job_id = make_job(sessions, shards=4)
    for shard in shard_ids(sessions, job_id):
        set_shard(sessions, shard, status="running", attempts=1, worker=worker_id())
    start, finishers = threading.Barrier(4), []

    def complete(shard_id: int) -> None:
        steps = ShardStep(JobSteps(sessions, job_id))
        with sessions() as session:
            shard = session.get(Shard, shard_id)
        start.wait()
        if steps._complete_shard(shard, ShardOutcome(), f"part-{shard_id}.parquet"):
            finishers.append(shard_id)

    threads = [threading.Thread(target=complete, args=(s,)) for s in shard_ids(sessions, job_id)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(finishers) == 1
    assert JobSteps(sessions, job_id).load().status == "finalizing"
    sessions.kw["bind"].dispose()
