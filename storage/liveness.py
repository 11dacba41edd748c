"""Who holds a job step or a shard: a claim is a lease, stamped and checked on the database's clock (hosts'
clocks disagree; SQLite is one host, so its clock is the process's). Liveness is the lease alone: a worker is
`host:pid`, and a PID seen dead on this host ends a lease early, but never keeps one alive."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage.models import Job, Shard, ShardStatus, utcnow

LEASE = timedelta(seconds=float(os.environ.get("TOKENMILL_LEASE_S") or 120))  # renewed every quarter


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def db_now(session: Session) -> datetime:
    """The database's clock (UTC): PostgreSQL's `now()`, the transaction's start; SQLite: this host's."""
    if session.get_bind().dialect.name == "sqlite":
        return utcnow()
    return _utc(session.scalar(select(func.now())))


def database_started_at(session: Session) -> datetime | None:
    """When the database server last started (PostgreSQL's postmaster start time, on its clock); None where it
    has no such notion (SQLite)."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    return _utc(session.scalar(select(func.pg_postmaster_start_time())))


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def lease_until(session: Session) -> datetime:
    """When a lease taken or renewed now lapses, on the database's clock."""
    return db_now(session) + LEASE


def holder_alive(worker: str | None, lease_expires_at: datetime | None, now: datetime) -> bool:
    """Does `worker` still hold a lease that runs until `lease_expires_at` (`now` on the database's clock)?
    A dead process on this host lets go at once."""
    if not worker or lease_expires_at is None or lease_expires_at <= now:
        return False
    host, _, pid = worker.rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid():
        return _process_alive(int(pid))
    return True


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def step_holder_alive(job: Job, now: datetime) -> bool:
    """Is a process holding the job itself (its plan or finalize step, or `tokenmill run`)?"""
    return holder_alive(job.worker, job.lease_expires_at, now)


def shard_runner_alive(shard: Shard, now: datetime) -> bool:
    return shard.status == ShardStatus.RUNNING and holder_alive(shard.worker, shard.lease_expires_at, now)


def runner_alive(job: Job, now: datetime) -> bool:
    """Is some process still working on this job: a step holder, or a worker running one of its shards?"""
    return step_holder_alive(job, now) or any(shard_runner_alive(s, now) for s in job.shards)
