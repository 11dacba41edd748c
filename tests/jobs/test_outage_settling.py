"""A database outage without a restart (a network partition, a failover) and the leases it lapses (issue #40,
item 9): the sweep sees it as a gap since its last run on the database's clock and lets every lapsed lease wait
one lease before it counts, as after a restart; at the usual cadence a lapsed lease is fenced at once. A shard
whose commit outlasts TOKENMILL_OUTAGE_WAIT_S waits for the database to give its attempt back."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy.exc import OperationalError

from storage import db, migrate
from storage import repository as repo
from storage.faults import is_transient
from storage.liveness import LEASE, OUTAGE_GAP, db_now
from storage.models import Shard
from tests.jobs.jobhelpers import prompt_rows, write_parquet
from tests.jobs.test_claims import make_job, new_job
from tests.service.test_restarts import private_postgres  # noqa: F401 - a fixture
from workers import shard_step as shard_step_module
from workers.job_steps import JobSteps
from workers.shard_step import ShardStep
from workers.sweep import sweep


@pytest.fixture
def pg_sessions(pg_databases):
    """A migrated PostgreSQL database of this test's own (the sweep's marker starts empty)."""
    url = pg_databases()
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    yield sessions
    sessions.kw["bind"].dispose()


def running_claims(sessions, lease_until) -> tuple[str, int, int, str]:
    """A job with two shards running on other hosts and a job finalizing on a third, every lease until
    `lease_until`: (shard job, shard a, shard b, step job)."""
    shard_job, step_job = make_job(sessions, "s3://b/out", shards=2), make_job(sessions, "s3://b/out2")
    with sessions.begin() as session:
        a, b = repo.shards(session, shard_job)
        for shard, worker in ((a, "hosta:1"), (b, "hostb:1")):
            shard.status, shard.attempts, shard.worker, shard.lease_expires_at = "running", 1, worker, lease_until
        job = repo.get_job(session, step_job)
        job.status, job.worker, job.lease_expires_at = "finalizing", "hostc:1", lease_until
        return shard_job, a.id, b.id, step_job


def test_a_partition_lets_lapsed_leases_wait_one_lease_after_the_database_is_seen_again(pg_sessions) -> None:
    """No sweep reached the database for a lease (a partition: PostgreSQL never restarted) while every lease
    lapsed. The first sweep after takes nothing; the renewed shard stays; from one lease on, the shard and the
    step whose holders never came back are taken (before: all of them at the first sweep)."""
    with pg_sessions() as session:
        t0 = db_now(session)
    shard_job, a, b, step_job = running_claims(pg_sessions, t0 + timedelta(seconds=5))
    assert sweep(pg_sessions, now=t0).requeue == []
    seen_again = t0 + LEASE  # the partition ends: every lease lapsed during it
    first = sweep(pg_sessions, now=seen_again)
    assert first.requeue == [] and first.finalize == [], "the first sweep after a partition fenced live claims"
    with pg_sessions.begin() as session:  # b's worker reaches the database and renews; a's and c's never do
        session.get(Shard, b).lease_expires_at = seen_again + timedelta(seconds=10) + LEASE
    now = seen_again
    while (now := now + OUTAGE_GAP / 2) < seen_again + LEASE:  # the usual cadence within the settling
        found = sweep(pg_sessions, now=now)
        assert found.requeue == [] and found.finalize == [], f"fenced {now - seen_again} after the partition"
    after = sweep(pg_sessions, now=seen_again + LEASE + timedelta(seconds=1))
    assert after.requeue == [(shard_job, a, "m")] and after.finalize == [step_job]


def test_at_the_usual_cadence_a_lapsed_lease_is_fenced_at_once(pg_sessions) -> None:
    with pg_sessions() as session:
        t0 = db_now(session)
    shard_job, a, b, step_job = running_claims(pg_sessions, t0 + timedelta(seconds=5))
    assert sweep(pg_sessions, now=t0).requeue == []
    with pg_sessions.begin() as session:
        session.get(Shard, b).lease_expires_at = t0 + LEASE
    found = sweep(pg_sessions, now=t0 + OUTAGE_GAP - timedelta(seconds=1))
    assert found.requeue == [(shard_job, a, "m")] and found.finalize == [step_job]


def test_a_commit_outlasting_the_outage_wait_uses_no_attempt(private_postgres, engine_service, tmp_path,  # noqa: F811
                                                             monkeypatch) -> None:
    """PostgreSQL stops while a shard runs and stays down past TOKENMILL_OUTAGE_WAIT_S (here 0): its commit and
    its end give up. The refund waits for the database, so the shard's retry is its first counted attempt
    (before: the refund failed at once and the shard stayed running with its attempt counted)."""
    url, ctl = private_postgres
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    monkeypatch.setattr(shard_step_module, "OUTAGE_WAIT_S", 0.0)
    try:
        path = write_parquet(tmp_path / "in.parquet", prompt_rows(2))
        job_id = repo_submit(sessions, str(path), str(tmp_path / "out"))
        steps = JobSteps(sessions, job_id)
        assert steps.validate().status == "queued"
        with sessions() as session:
            shard_id = repo.shards(session, job_id)[0].id
        shard_step = ShardStep(steps)
        claim = shard_step.claim_shard(shard_id, max_attempts=3)
        assert claim.decision == "run" and claim.shard.attempts == 1

        def engine_then_outage():
            ctl("stop")
            return engine_service

        with pytest.raises(OperationalError) as failed:
            shard_step.execute_shard(claim.job, claim.shard, engine_then_outage)
        assert is_transient(failed.value)
        back = threading.Timer(2.0, lambda: ctl("start"))
        back.start()
        try:  # as run_shard does
            shard_step.refund_attempt(claim.shard, failed.value)
        except Exception as error:
            print(f"refund failed: {error}")
        back.join()
        steps.close()
        with sessions() as session:
            row = session.get(Shard, shard_id)
            assert (row.status, row.attempts) == ("failed", 0), "the refund did not wait for the database"
        retry = ShardStep(JobSteps(sessions, job_id)).claim_shard(shard_id, max_attempts=3)
        assert retry.decision == "run"
        assert retry.shard.attempts == 1, "the outage used up an attempt"
    finally:
        sessions.kw["bind"].dispose()


def repo_submit(sessions, input_uri: str, output_uri: str) -> str:
    from ingest.intake import submit

    return submit(sessions, new_job(input_uri, output_uri, shard_size=2,
                                    sampling={"max_tokens": 2, "temperature": 0})).job.id


def test_a_refund_after_the_claim_moved_on_gives_the_attempt_back(sqlite_sessions) -> None:
    """The database came back after the sweep fenced the shard and another worker claimed it: the refund gives
    the outage's attempt back the way a lost claim does (before: it did nothing, and the shard had two)."""
    job_id = make_job(sqlite_sessions, "s3://b/out", shards=1)
    with sqlite_sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    ours = ShardStep(JobSteps(sqlite_sessions, job_id))
    claim = ours.claim_shard(shard_id, max_attempts=3)
    with sqlite_sessions.begin() as session:  # fenced by the sweep and claimed elsewhere while it was cut off
        row = session.get(Shard, shard_id)
        row.status, row.claim_token, row.worker, row.attempts = "running", 2, "hostb:1", 2
    ours.refund_attempt(claim.shard, OperationalError("commit", {}, Exception("server closed the connection")))
    with sqlite_sessions() as session:
        row = session.get(Shard, shard_id)
        assert (row.status, row.worker, row.claim_token, row.attempts) == ("running", "hostb:1", 2, 1)
