"""A job never waits the whole grace in `finalizing` (issue #40, item 8): a shard commit whose reply was lost
still reports that it completed the job, the finalize task is sent through a broker outage, and a finalize step
that no one holds and no task waits for is sent again by the sweep within about one sweep interval."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from storage import repository as repo
from storage.models import utcnow
from tests.jobs.conftest import migrated_sessions
from tests.jobs.test_claims import make_job, record
from workers.job_steps import JobSteps
from workers.leases import shard_claim
from workers.shard_step import ShardStep, through_outages
from workers.shards import ShardOutcome
from workers.sweep import sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
    else:
        url = request.getfixturevalue("pg_databases")()
    sessions = migrated_sessions(url)
    yield sessions
    sessions.kw["bind"].dispose()


def test_a_last_shard_whose_commit_reply_was_lost_still_sends_finalize(database, tmp_path) -> None:
    """The commit of the job's last shard reaches the database but its reply is lost (the connection drops): the
    retry finds its own commit done and the job finalizing, and still reports that it completed the job (before,
    no finalize was sent and the job waited for the sweep's grace)."""
    job_id = make_job(database, str(tmp_path / "out"), shards=1, status="in_progress")
    step = ShardStep(JobSteps(database, job_id))
    with database() as session:
        shard_id = repo.shards(session, job_id)[0].id
    claim = step.claim_shard(shard_id, max_attempts=3)
    outcome = ShardOutcome(records=[record("a", 0)])
    key = step._write_part(claim.job, claim.shard, outcome, shard_claim(shard_id))

    replies_lost = []

    def lose_the_reply(session) -> None:
        if not replies_lost:
            replies_lost.append(session)
            raise OperationalError("COMMIT", {}, ConnectionResetError("server closed the connection unexpectedly"))

    event.listen(database, "after_commit", lose_the_reply)
    try:
        through_outages(lambda: step._record_shard(claim.job, claim.shard, outcome, key, time.perf_counter()))
    finally:
        event.remove(database, "after_commit", lose_the_reply)
    assert replies_lost  # the first commit did commit, and raised
    assert JobSteps(database, job_id).load().status == "finalizing"
    assert outcome.completed_job


def test_a_finalize_step_no_one_holds_is_sent_again_within_a_sweep_or_two(sqlite_sessions, tmp_path) -> None:
    """The finalize task was never sent (the broker was down as the last shard completed): the sweep sends it
    again at its next sweep but one, not after the 10-min grace; not while a task waits in the control queue."""
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1, status="finalizing")
    start, grace, interval = utcnow(), timedelta(minutes=10), timedelta(seconds=30)
    assert sweep(sqlite_sessions, now=start, stale=grace).finalize == []  # perhaps its task is on its way
    assert sweep(sqlite_sessions, now=start + interval, stale=grace, queued=lambda queue: 1).finalize == []
    assert sweep(sqlite_sessions, now=start + 2 * interval, stale=grace).finalize == [job_id]
    assert sweep(sqlite_sessions, now=start + 2 * interval + timedelta(seconds=1), stale=grace).finalize == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.service  # a redis-server of its own
def test_the_finalize_task_is_sent_through_a_broker_outage(tmp_path) -> None:
    """Redis is down as the last shard completes and sends finalize, for longer than one send retries (about
    20 s: Redis starts once the sender has said that its first send failed); it comes back: the task is sent
    then (before, the send raised and the job waited for the sweep)."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENMILL_BROKER_URL": url, "TOKENMILL_OUTAGE_WAIT_S": "90",
           "TOKENMILL_QUEUE_PREFIX": "t."}
    sender = subprocess.Popen([sys.executable, "-c", "from workers.tasks import finalize_later; finalize_later('j1')"],
                              env=env, stderr=subprocess.PIPE, text=True)
    said = []
    for line in sender.stderr:  # the first send's own retries are over
        said.append(line)
        if "a service is down" in line:
            break
    assert sender.poll() is None, "".join(said)[-2000:]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        _, errors = sender.communicate(timeout=120)
        assert sender.returncode == 0, ("".join(said) + errors)[-2000:]
        assert redis.Redis.from_url(url).llen("t.control") == 1
    finally:
        sender.kill()
        server.terminate()
        server.wait()
