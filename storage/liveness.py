"""Who holds a job step or a shard: a claim is a lease, stamped and checked on the database's clock (hosts'
clocks disagree; SQLite is one host, so its clock is the process's). Liveness is the lease alone: a PID seen dead
ends a lease early, but never keeps one alive, and is probed only where it means the same process as here.

A worker is `host:pid@boot.pidns.nonce` (`WorkerIdentity`): containers with host networking share a hostname but
not PIDs, so a PID is only comparable under the same boot id and PID namespace; the random nonce tells apart equal
PIDs elsewhere and a PID reused after a restart. Rows of older workers say `host:pid`, read as before.

Every lease lapses while the database is out of reach (a restart, a failover, a network partition), live
holders included: `lapses_count_by` lets the sweep hold off for one lease after it sees the database again."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from storage import clock
from storage.models import Job, ServiceMarker, Shard, ShardStatus, utcnow

LEASE = timedelta(seconds=float(os.environ.get("TOKENMILL_LEASE_S") or 120))  # renewed every quarter
SWEEP_INTERVAL = timedelta(seconds=float(os.environ.get("TOKENMILL_SWEEP_INTERVAL_S") or 30))
# A sweep that last reached the database longer ago than this saw an outage that may have lapsed leases: renewed
# every quarter of a lease, one lapses only after three quarters of one without the database.
OUTAGE_GAP = max(LEASE / 2, 2 * SWEEP_INTERVAL)
SWEEP_MARKER = "sweep"  # its ServiceMarker: "<this sweep> <lapsed by> <settling until>" on the database's clock


@dataclass(frozen=True)
class WorkerIdentity:
    host: str
    pid: int
    boot: str | None = None  # the kernel's boot id; None in an older worker's `host:pid`, "" where unknown
    pid_namespace: str | None = None  # its inode; "" where unknown
    nonce: str | None = None  # random, one per process

    def __str__(self) -> str:
        if self.nonce is None:
            return f"{self.host}:{self.pid}"
        return f"{self.host}:{self.pid}@{self.boot}.{self.pid_namespace}.{self.nonce}"

    @classmethod
    def parse(cls, worker: str) -> WorkerIdentity | None:
        """`host:pid@boot.pidns.nonce`, or an older worker's `host:pid`; None if neither."""
        host_pid, tagged, where = worker.partition("@")
        host, _, pid = host_pid.rpartition(":")
        if not host or not pid.isdigit():
            return None
        if not tagged:
            return cls(host, int(pid))
        parts = where.split(".")
        if len(parts) != 3 or not parts[2]:
            return None
        return cls(host, int(pid), *parts)

    def shares_pids_with(self, other: WorkerIdentity) -> bool:
        """Does a PID of `other` name a process here: same host, boot and PID namespace, all known?"""
        return (self.host == other.host and bool(self.boot) and bool(self.pid_namespace)
                and (self.boot, self.pid_namespace) == (other.boot, other.pid_namespace))


_this_process: WorkerIdentity | None = None


def this_worker() -> WorkerIdentity:
    """This process's identity, made afresh in a forked child (its PID changed)."""
    global _this_process
    if _this_process is None or _this_process.pid != os.getpid():
        _this_process = WorkerIdentity(socket.gethostname(), os.getpid(), _boot_id(), _pid_namespace(),
                                       secrets.token_hex(6))
    return _this_process


def worker_id() -> str:
    return str(this_worker())


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:16]
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())  # "pid:[4026531836]"
    except OSError:
        return ""


def db_now(session: Session) -> datetime:
    """The database's clock (UTC): PostgreSQL's `now()`, the transaction's start; SQLite: this host's (a
    simulated clock, `storage.clock`, stands in for both)."""
    if (simulated := clock.database_now()) is not None:
        return simulated
    if session.get_bind().dialect.name == "sqlite":
        return utcnow()
    return _utc(session.scalar(select(func.now())))


def database_started_at(session: Session) -> datetime | None:
    """When the database server last started (PostgreSQL's postmaster start time, on its clock); None where it
    has no such notion (SQLite)."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    return _utc(session.scalar(select(func.pg_postmaster_start_time())))


def lapses_count_by(session: Session, now: datetime) -> datetime:
    """(at a sweep, `now` on the database's clock) By when a lapsed lease must have lapsed to count: `now`, but
    within one lease of the sweep seeing the database again after an outage (the server restarted, or no sweep
    reached it for longer than OUTAGE_GAP: a partition, a failover), the time of the last sweep before it: the
    leases that lapsed during the outage wait for their holders to renew them. Records this sweep (its marker
    row, locked: sweeps take turns)."""
    marker = session.get(ServiceMarker, SWEEP_MARKER, with_for_update=True)
    last, since, until = _marker_times(marker.value) if marker is not None else (None, None, None)
    started = database_started_at(session)
    if started is not None and timedelta(0) <= now - started < LEASE and (last is None or last < started):
        since, until = last, started + LEASE  # the first sweep since the server restarted
    elif last is not None and now - last > OUTAGE_GAP:
        since, until = last, now + LEASE
    value = " ".join(moment.isoformat() if moment else "-" for moment in (now, since, until))
    if marker is None:
        session.add(ServiceMarker(name=SWEEP_MARKER, value=value))
    else:
        marker.value = value
    if until is None or now >= until:
        return now
    return since or datetime.min.replace(tzinfo=UTC)  # no sweep before the restart: none counts yet


def _marker_times(value: str) -> list[datetime | None]:
    times = [None if part == "-" else _utc(datetime.fromisoformat(part)) for part in value.split()]
    return times if len(times) == 3 else [None, None, None]


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def lease_until(session: Session) -> datetime:
    """When a lease taken or renewed now lapses, on the database's clock."""
    return db_now(session) + LEASE


def holder_alive(worker: str | None, lease_expires_at: datetime | None, now: datetime) -> bool:
    """Does `worker` still hold a lease that runs until `lease_expires_at` (`now` on the database's clock)?
    A dead process whose PID means the same here lets go at once; elsewhere only the lease counts."""
    if not worker or lease_expires_at is None or lease_expires_at <= now:
        return False
    holder, me = WorkerIdentity.parse(worker), this_worker()
    if holder is None or holder.host != me.host:
        return True
    if holder.nonce is None:  # an older worker's `host:pid`: its PID taken as one of this host's, as before
        return holder.pid == me.pid or _process_alive(holder.pid)
    if not me.shares_pids_with(holder):  # another container or boot: its PID means nothing here
        return True
    if holder.pid == me.pid:  # our PID: us, or a process that held it before this one started
        return holder.nonce == me.nonce
    return _process_alive(holder.pid)


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
