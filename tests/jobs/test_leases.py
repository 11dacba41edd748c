"""Leases on the database clock, fencing and cleanup, each against the way it broke across hosts (issue #21):
a clock 60 s off, a sibling process on one host, a duplicated step, a cancel or give-up that did not fence, an
S3 timeout taken for a corrupt file, an inbox object replaced before planning, a lost broker."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from storage import claims, db, migrate
from storage import repository as repo
from storage.formats import MANIFEST_KEY, InputError, Limits, part_key
from storage.formats.parquet import ParquetInput
from storage.job_settings import CELERY, JobSettings
from storage.liveness import LEASE
from storage.models import Job, Shard, utcnow
from storage.objectstore import open_store
from storage.states import output_claim
from tests.jobs.test_claims import make_job, record
from tokenmill.stack.hosts import faketime_env as clock_offset_env
from workers.broker_marker import broker_lost, restore_marker
from workers.job_steps import JobSteps
from workers.leases import StaleClaim, shard_claim
from workers.shard_step import ShardStep, request_prefix
from workers.shards import ShardOutcome
from workers.sweep import sweep

REPO = Path(__file__).resolve().parents[2]


def faketime_env(offset: str) -> dict[str, str]:
    """This environment with the process clock moved by `offset`."""
    return {**os.environ, **clock_offset_env(offset), "PYTHONPATH": str(REPO)}


SKEWED_CLAIM = """
import sys, datetime
from storage import db
from workers.job_steps import JobSteps
from workers.shard_step import ShardStep
sessions = db.session_factory(db.make_engine(sys.argv[1]))
steps = JobSteps(sessions, sys.argv[2])
steps.worker = "hostb:1"
claim = ShardStep(steps).claim_shard(int(sys.argv[3]), max_attempts=3)
print(claim.decision, datetime.datetime.now(datetime.UTC).isoformat(), claim.shard.lease_expires_at.isoformat())
"""

SKEWED_SWEEP = """
import sys, time
from storage import db
from workers.sweep import sweep
found = sweep(db.session_factory(db.make_engine(sys.argv[1])))
print(time.time(), [shard for _, shard, _ in found.requeue])
"""


def test_a_lease_is_stamped_on_the_database_clock_not_the_workers(pg_databases) -> None:
    """A worker whose clock runs 60 s slow claims a shard: its lease still runs LEASE from the database's now,
    and a sweep on a clock a minute more than a lease fast leaves it alone, yet takes it once it lapsed on the
    database's clock (before, both hosts read their own clocks)."""
    url = pg_databases()
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    try:
        job_id = make_job(sessions, "s3://b/out", shards=1)
        with sessions() as session:
            shard_id = repo.shards(session, job_id)[0].id
        done = subprocess.run([sys.executable, "-c", SKEWED_CLAIM, url, job_id, str(shard_id)], capture_output=True,
                              text=True, env=faketime_env("-60s"), timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        decision, worker_now, lease = done.stdout.split()
        with sessions() as session:
            database_now = session.scalar(select(func.now()))
        assert decision == "run"
        assert database_now - datetime.fromisoformat(worker_now) > timedelta(seconds=55), "the clock was not skewed"
        assert abs(datetime.fromisoformat(lease) - (database_now + LEASE)) < timedelta(seconds=10)
        skew = LEASE + timedelta(seconds=60)  # on its own clock, the lease lapsed a minute ago

        def skewed_sweep() -> list[int]:
            ahead = subprocess.run([sys.executable, "-c", SKEWED_SWEEP, url], capture_output=True, text=True,
                                   env=faketime_env(f"+{int(skew.total_seconds())}s"), timeout=120)
            assert ahead.returncode == 0, ahead.stderr[-3000:]
            sweeper_now, requeued = ahead.stdout.split(maxsplit=1)
            with sessions() as session:
                database_now = session.scalar(select(func.now()))
            assert datetime.fromtimestamp(float(sweeper_now), UTC) - database_now > skew - timedelta(seconds=5), \
                "the sweeper's clock was not skewed"
            return json.loads(requeued)

        assert skewed_sweep() == []
        with sessions.begin() as session:  # the control: lapsed on the database's clock, the same sweep takes it
            session.get(Shard, shard_id).lease_expires_at = session.scalar(select(func.now())) - timedelta(seconds=1)
        assert skewed_sweep() == [shard_id]
    finally:
        sessions.kw["bind"].dispose()


def test_a_lease_lapsed_while_the_database_was_down_counts_only_a_lease_after_it_started(pg_databases) -> None:
    """Every lease lapses while PostgreSQL is down. Within one lease of its start the sweep leaves a lapsed shard
    and a lapsed step holder alone (their workers are renewing); from one lease on, it takes them."""
    from storage.liveness import database_started_at

    url = pg_databases()
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    try:
        shard_job, step_job = make_job(sessions, "s3://b/out", shards=1), make_job(sessions, "s3://b/out2")
        with sessions.begin() as session:
            started = database_started_at(session)
            shard = repo.shards(session, shard_job)[0]
            shard.status, shard.attempts, shard.worker = "running", 1, "other-host:1"
            shard.lease_expires_at = started - timedelta(seconds=1)
            job = repo.get_job(session, step_job)
            job.status, job.worker, job.lease_expires_at = "finalizing", "other-host:2", started
        settling = sweep(sessions, now=started + LEASE / 2)
        assert settling.requeue == [] and settling.finalize == []
        after = sweep(sessions, now=started + LEASE + timedelta(seconds=1))
        assert [job_id for job_id, _, _ in after.requeue] == [shard_job] and after.finalize == [step_job]
    finally:
        sessions.kw["bind"].dispose()


def test_a_sibling_process_takes_over_a_shard_whose_lease_lapsed(sqlite_sessions, tmp_path) -> None:
    """On one host, a live process no longer keeps a shard: its lease does. A process still alive whose lease
    lapsed (its write and its refund failed in a database blip) gives way; one whose lease runs keeps it."""
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1)
    with sqlite_sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with sqlite_sessions.begin() as session:
            shard = session.get(Shard, shard_id)
            shard.status, shard.worker, shard.attempts = "running", f"{socket.gethostname()}:{sibling.pid}", 1
            shard.lease_expires_at = utcnow() + timedelta(minutes=1)
        assert ShardStep(JobSteps(sqlite_sessions, job_id)).claim_shard(shard_id, 3).decision == "busy"
        with sqlite_sessions.begin() as session:
            session.get(Shard, shard_id).lease_expires_at = utcnow() - timedelta(seconds=1)
        assert ShardStep(JobSteps(sqlite_sessions, job_id)).claim_shard(shard_id, 3).decision == "run"
    finally:
        sibling.kill()
        sibling.wait()


def finalizing_job(sessions, tmp_path) -> tuple[str, str]:
    """A job whose one shard completed (its part written and committed): finalizing."""
    output = str(tmp_path / "out")
    job_id = make_job(sessions, output, shards=1, status="in_progress")
    with sessions.begin() as session:
        repo.get_job(session, job_id).queued_at = utcnow()
    steps = ShardStep(JobSteps(sessions, job_id))
    with sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    claim = steps.claim_shard(shard_id, 3)
    outcome = ShardOutcome(records=[record("a", 0)])
    key = steps._write_part(claim.job, claim.shard, outcome, shard_claim(shard_id))
    assert steps._complete_shard(claim.shard, outcome, key)
    return job_id, output


def test_a_finalize_held_past_the_grace_is_neither_resent_nor_stolen(sqlite_sessions, tmp_path) -> None:
    """A finalize step renews its lease: however long it runs, a duplicate task gets nothing and the sweep does
    not resend it. Once its lease lapses, the sweep fences it: the old holder writes no manifest, and the new
    one completes the job with it."""
    job_id, output = finalizing_job(sqlite_sessions, tmp_path)
    slow = JobSteps(sqlite_sessions, job_id)
    assert slow.claim_step("finalizing", max_attempts=3)
    with sqlite_sessions.begin() as session:  # another host's holder, hours into its step, lease renewed
        job = repo.get_job(session, job_id)
        job.worker, job.finalizing_at = "hosta:1", utcnow() - timedelta(hours=3)
    duplicate = JobSteps(sqlite_sessions, job_id)
    assert not duplicate.claim_step("finalizing", max_attempts=3)
    assert sweep(sqlite_sessions, stale=timedelta(minutes=10)).finalize == []
    with sqlite_sessions.begin() as session:
        repo.get_job(session, job_id).lease_expires_at = utcnow() - timedelta(seconds=1)
    assert sweep(sqlite_sessions, stale=timedelta(minutes=10)).finalize == [job_id]
    assert slow.finalize().status == "finalizing"  # fenced: no manifest
    assert not open_store(output).exists(MANIFEST_KEY)
    assert duplicate.claim_step("finalizing", max_attempts=3)
    assert duplicate.finalize().status == "completed"
    manifest = json.loads(open_store(output).get_bytes(MANIFEST_KEY))
    assert [p["key"] for p in manifest["files"]["parts"]] == [part_key(0, job_id, 1)]


def test_a_failed_job_keeps_no_manifest_and_no_uncommitted_part(sqlite_sessions, tmp_path) -> None:
    job_id, output = finalizing_job(sqlite_sessions, tmp_path)
    store = open_store(output)
    store.put_bytes(MANIFEST_KEY, b"{}")  # a finalizer wrote it before the job failed
    store.put_bytes(part_key(0, job_id, 7), b"a stale claim's part")
    store.put_bytes(part_key(0, "another-job", 1), b"not this job's")
    JobSteps(sqlite_sessions, job_id).fail("finalizing failed")
    assert sorted(store.list()) == sorted([part_key(0, "another-job", 1), part_key(0, job_id, 1)])


def test_cancel_give_up_and_expiry_fence_the_claims(sqlite_sessions, tmp_path) -> None:
    """A worker whose lease lapsed wrote its part and then found the job cancelled: it commits nothing, removes
    its part and gets its attempt back; give-up and expiry move the tokens on as well."""
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=2, status="in_progress")
    steps = ShardStep(JobSteps(sqlite_sessions, job_id))
    with sqlite_sessions() as session:
        first, second = (s.id for s in repo.shards(session, job_id))
    claim = steps.claim_shard(first, 3)
    outcome = ShardOutcome(records=[record("a", 0)])
    key = steps._write_part(claim.job, claim.shard, outcome, shard_claim(first))
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, job_id, for_update=True)
        token = job.claim_token
        job.status = "cancelling"  # a cancel request, then its end
        claims.mark_cancelled(job)
    with pytest.raises(StaleClaim):
        steps._complete_shard(claim.shard, outcome, key)
    steps._after_lost_claim(claim.job, claim.shard, key)
    with sqlite_sessions() as session:
        job = repo.get_job(session, job_id)
        assert job.status == "cancelled" and job.claim_token == token + 1
        assert [(s.status, s.attempts) for s in job.shards] == [("cancelled", 0), ("cancelled", 0)]
    assert open_store(str(tmp_path / "out")).list() == []

    given_up = make_job(sqlite_sessions, str(tmp_path / "g"), shards=1, status="in_progress")
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, given_up, for_update=True)
        shard_token = job.shards[0].claim_token
        claims.give_up(job, job.shards[0])
        assert (job.status, job.shards[0].claim_token) == ("failed", shard_token + 1)
    expired = make_job(sqlite_sessions, str(tmp_path / "e"), shards=1, status="queued")
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, expired, for_update=True)
        claims.expire(job)
        assert (job.status, job.claim_token) == ("expired", 1)


def test_a_cancelling_job_always_ends_once_no_lease_runs(sqlite_sessions, tmp_path) -> None:
    """A shard marked running by this very process, with no running lease (its end was never recorded): the
    job used to wait for it forever."""
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1, status="cancelling")
    with sqlite_sessions.begin() as session:
        shard = repo.get_job(session, job_id).shards[0]
        shard.status, shard.worker = "running", f"{socket.gethostname()}:{os.getpid()}"
        shard.lease_expires_at = utcnow() - timedelta(seconds=1)
    assert sweep(sqlite_sessions).cancelled == [job_id]


def test_the_output_claim_sees_through_symlinks(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert output_claim(str(tmp_path / "link" / "out")) == output_claim(str(tmp_path / "real" / "out"))


class TimingOutFile:
    """A Parquet file whose reads time out after the footer, as an S3 GET does under load."""

    def __init__(self, data: bytes) -> None:
        import io

        self.data, self.inner = data, io.BytesIO(data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def read(self, size: int = -1) -> bytes:
        if self.inner.tell() < len(self.data) - 4096:
            from botocore.exceptions import ReadTimeoutError

            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1/bucket/in.parquet")
        return self.inner.read(size)


def test_an_s3_timeout_while_validating_is_transient_not_a_corrupt_file(tmp_path) -> None:
    from storage.faults import is_transient

    table = pa.table({"custom_id": [f"r{i}" for i in range(2000)], "prompt": ["x" * 50] * 2000})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, row_group_size=500)
    with pytest.raises(Exception) as raised:
        ParquetInput(TimingOutFile(buffer.getvalue().to_pybytes()), Limits()).validate()
    assert not isinstance(raised.value, InputError) and is_transient(raised.value), raised.value


@pytest.mark.parametrize("where", ["local", "s3"])
def test_validation_reads_only_the_version_the_inbox_listed(sqlite_sessions, tmp_path, request, where) -> None:
    """The inbox pins the version it listed (a local file's size, mtime and hash; an S3 object's ETag, read
    with If-Match on SeaweedFS): an object re-uploaded before planning fails that job with the reason (the
    replacement is a new object version, and the inbox makes it a job of its own)."""
    from tests.jobs.jobhelpers import prompt_rows, write_parquet

    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    options = request.getfixturevalue("seaweedfs") if where == "s3" else None
    folder = f"{request.getfixturevalue('s3_prefix')}/inbox" if where == "s3" else str(tmp_path)
    store = open_store(folder, options)
    if where == "s3":
        store.put_file("in.parquet", path)
    listed = store.fingerprint("in.parquet")
    write_parquet(path, prompt_rows(5, prefix="replaced"))
    if where == "s3":
        store.put_file("in.parquet", path)
    with sqlite_sessions.begin() as session:
        job = Job(idempotency_key=f"k-{uuid.uuid4()}", status="validating", model="m",
                  input_uri=f"{folder}/in.parquet", output_uri=str(tmp_path / "out"), created_at=utcnow(),
                  validating_at=utcnow(),
                  settings=JobSettings(executor=CELERY, inbox_pin=listed, **({"s3": options} if options else {})))
        session.add(job)
    failed = JobSteps(sqlite_sessions, job.id).validate()
    assert failed.status == "failed" and "changed" in failed.error, failed.error


def test_request_ids_carry_the_whole_job_id_and_the_claim() -> None:
    first = Job(id="0193a1b2-0000-7000-8000-000000000001")
    second = Job(id="0193a1b2-0000-7000-8000-000000000002")  # UUIDv7s of one minute share 8 digits
    shard = Shard(index=3, claim_token=2)
    assert request_prefix(first, shard) != request_prefix(second, shard)
    assert request_prefix(first, shard) == "0193a1b2-0000-7000-8000-000000000001-3-c2-"


@pytest.mark.service  # the machine's Redis
def test_a_flushed_broker_is_noticed_at_the_next_sweep(sqlite_sessions, tmp_path) -> None:
    """The broker marker, on the real Redis (a database of its own): unseen the first time, then lost after a
    FLUSHDB until put back, and the sweep sends pending work at once instead of after the grace."""
    import redis

    url = "redis://127.0.0.1:6379/13"
    redis.Redis.from_url(url).flushdb()
    assert broker_lost(sqlite_sessions, url) is False  # the first sweep of this database
    assert broker_lost(sqlite_sessions, url) is False
    redis.Redis.from_url(url).flushdb()
    assert broker_lost(sqlite_sessions, url) is True
    restore_marker(sqlite_sessions, url)  # the sweep put it back once its resend went out
    assert broker_lost(sqlite_sessions, url) is False
    assert broker_lost(sqlite_sessions, "amqp://guest@localhost//") is False  # durable queues: no marker
    migrate.upgrade(other_url := f"sqlite:///{tmp_path / 'other.db'}")
    other_database = db.session_factory(db.make_engine(other_url))
    for _ in range(2):  # another deployment's sweeps on the same Redis: neither sees the other's marker as a loss
        assert broker_lost(other_database, url) is False and broker_lost(sqlite_sessions, url) is False

    job_id = make_job(sqlite_sessions, "s3://b/out", shards=2)
    assert sweep(sqlite_sessions).requeue == []  # just planned: within the grace
    with sqlite_sessions() as session:
        pending = [s.id for s in repo.shards(session, job_id)]
    assert [shard for _, shard, _ in sweep(sqlite_sessions, broker_lost=True).requeue] == pending
