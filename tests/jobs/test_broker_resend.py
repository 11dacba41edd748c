"""Resending lost work (issue #40, item 6): the resend waits out its grace on the database's clock alone, whatever
the clocks of the hosts that stamped the job; a broker that lost its state is still seen as lost until the resend
was sent; a Redis restored from a snapshot (an older marker in it) is seen as lost too. On the real Redis (a
database of its own, 12) and SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import redis

from storage import repository as repo
from storage.models import Shard, utcnow
from tests.jobs.test_claims import make_job
from workers import broker_marker
from workers.broker_marker import KEY, broker_lost
from workers.sweep import sweep

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/12"
GRACE, INTERVAL = timedelta(minutes=5), timedelta(seconds=30)


@pytest.fixture
def broker() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.mark.parametrize("skew", [timedelta(hours=-1), timedelta(hours=1)], ids=["writer-behind", "writer-ahead"])
def test_a_writer_clock_an_hour_off_neither_hastens_nor_holds_back_a_resend(sqlite_sessions, skew) -> None:
    """A job planned, a shard failed and a job submitted on a host whose clock is an hour off: with a sweep every
    30 s, their lost tasks are sent again between the grace and the grace plus one sweep after they began to
    wait (before, an hour early or an hour late)."""
    start = utcnow()
    queued = make_job(sqlite_sessions, "s3://b/out", shards=2)
    validating = make_job(sqlite_sessions, "s3://b/out2", shards=0, status="validating")
    with sqlite_sessions.begin() as session:  # the stamps as the skewed host wrote them
        for job_id in (queued, validating):
            job = repo.get_job(session, job_id)
            job.created_at = job.validating_at = start + skew
        repo.get_job(session, queued).queued_at = start + skew
        pending, failed = repo.shards(session, queued)
        failed.status, failed.attempts, failed.finished_at = "failed", 1, start + skew
        pending, failed = pending.id, failed.id
    first_sent: dict[object, timedelta] = {}
    for sweeps in range(int((GRACE + 3 * INTERVAL) / INTERVAL)):
        now = start + sweeps * INTERVAL
        found = sweep(sqlite_sessions, now=now, stale=GRACE)
        for sent in [shard for _, shard, _ in found.requeue] + found.plan:
            first_sent.setdefault(sent, now - start)
    for sent in (pending, failed, validating):
        assert GRACE <= first_sent.get(sent, timedelta.max) <= GRACE + INTERVAL, (sent, first_sent)


@pytest.mark.service  # the machine's Redis
def test_a_lost_broker_stays_lost_until_the_resend_is_sent(sqlite_sessions, broker) -> None:
    """Unit: the check does not put the marker back; only `restore_marker`, called once the resend went out."""
    assert broker_lost(sqlite_sessions, REDIS_URL) is False  # the first check of this database
    broker.flushdb()
    assert broker_lost(sqlite_sessions, REDIS_URL) is True
    assert broker_lost(sqlite_sessions, REDIS_URL) is True  # nothing was resent yet
    broker_marker.restore_marker(sqlite_sessions, REDIS_URL)
    assert broker_lost(sqlite_sessions, REDIS_URL) is False


@pytest.mark.service  # the machine's Redis
def test_a_redis_restored_from_a_snapshot_is_seen_as_lost(sqlite_sessions, tmp_path, broker) -> None:
    """The marker moves on at each check: a broker put back to an older snapshot holds an older marker and lost
    what was sent since. Another deployment on the same Redis keeps its own marker."""
    assert broker_lost(sqlite_sessions, REDIS_URL) is False
    [key] = broker.keys(f"{KEY}:*")
    snapshot = broker.dump(key)
    assert broker_lost(sqlite_sessions, REDIS_URL) is False  # a sweep runs: the marker moves on
    broker.restore(key, 0, snapshot, replace=True)  # Redis restarts from the snapshot taken before it
    assert broker_lost(sqlite_sessions, REDIS_URL) is True
    broker_marker.restore_marker(sqlite_sessions, REDIS_URL)
    assert broker_lost(sqlite_sessions, REDIS_URL) is False

    from storage import db, migrate

    migrate.upgrade(other_url := f"sqlite:///{tmp_path / 'other.db'}")
    other = db.session_factory(db.make_engine(other_url))
    for _ in range(3):  # two deployments' sweeps interleaved on one Redis: neither disturbs the other's marker
        assert broker_lost(other, REDIS_URL) is False and broker_lost(sqlite_sessions, REDIS_URL) is False


SWEEP_TASK = "import json; from workers.tasks import sweep; print(json.dumps(sweep()))"


def run_sweep_task(database_url: str, prefix: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    """The beat's sweep task in a process of its own, on this test's database and Redis."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENMILL_DATABASE_URL": database_url,
           "TOKENMILL_BROKER_URL": REDIS_URL, "TOKENMILL_QUEUE_PREFIX": prefix, "TOKENMILL_CRASH_AT": crash_at or ""}
    return subprocess.run([sys.executable, "-c", SWEEP_TASK], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.service  # the machine's Redis
def test_a_sweep_that_dies_before_its_resend_leaves_the_loss_to_the_next(sqlite_sessions, broker) -> None:
    """Redis flushed; the sweep that notices it commits its resend, then dies before sending (as when the broker
    goes down again): the next sweep still sees the loss and sends the pending shards at once, then puts the
    marker back."""
    database_url = str(sqlite_sessions.kw["bind"].url)
    prefix = f"t{uuid.uuid4().hex[:8]}."
    job_id = make_job(sqlite_sessions, "s3://b/out", shards=2)
    with sqlite_sessions() as session:
        pending = [s.id for s in repo.shards(session, job_id)]
    first = run_sweep_task(database_url, prefix)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["requeued"] == []  # just planned: within the grace

    broker.flushdb()  # the broker loses its state
    died = run_sweep_task(database_url, prefix, crash_at="before_sweep_sends")
    retried = run_sweep_task(database_url, prefix)
    assert retried.returncode == 0, retried.stderr
    found = json.loads(retried.stdout.splitlines()[-1])
    assert found["broker_lost"] is True and found["requeued"] == pending
    assert died.returncode == -9  # it did die after committing (its resend stamped), before sending
    queue = f"{prefix}gpu.m"
    assert sum(broker.llen(key) for key in broker.keys(f"{queue}*") if broker.type(key) == b"list") == 2

    after = json.loads(run_sweep_task(database_url, prefix).stdout.splitlines()[-1])
    assert after["broker_lost"] is False and after["requeued"] == []  # the marker is back; the resend waits
    with sqlite_sessions() as session:
        assert all(session.get(Shard, shard).status == "pending" for shard in pending)


def test_a_busy_queue_does_not_hold_back_lost_work(sqlite_sessions) -> None:
    """#55 path 1: with work arriving all the time, the model's and the control queue are never empty. A shard, a
    plan step and a finalize step that lost their tasks are sent again once their grace passed all the same, then
    not again before another grace; right after the broker lost its state, at once."""
    def busy(queue: str | None) -> int:
        return 5

    start = utcnow()
    queued = make_job(sqlite_sessions, "s3://b/out", shards=1)
    validating = make_job(sqlite_sessions, "s3://b/out2", shards=0, status="validating")
    finalizing = make_job(sqlite_sessions, "s3://b/out3", shards=0, status="finalizing")
    with sqlite_sessions() as session:
        [shard] = [s.id for s in repo.shards(session, queued)]

    def sent(after: timedelta, broker_lost: bool = False) -> list:
        found = sweep(sqlite_sessions, now=start + after, stale=GRACE, queued=busy, broker_lost=broker_lost)
        return [shard for _, shard, _ in found.requeue] + found.plan + found.finalize

    assert sent(timedelta(0)) == []  # first seen waiting: perhaps the tasks are on their way
    assert sent(INTERVAL) == []  # a busy control queue: finalize waits out the whole grace
    assert sent(GRACE) == [shard, validating, finalizing]
    assert sent(GRACE + INTERVAL) == []  # just resent: not again before another grace
    assert sent(GRACE + 2 * INTERVAL, broker_lost=True) == [shard, validating, finalizing]
    assert sent(2 * GRACE + 2 * INTERVAL) == [shard, validating, finalizing]
