"""Who is running a job: a worker is `host:pid`; a dead worker's job or shard may be taken over."""

from __future__ import annotations

import os
import socket
from datetime import datetime

from storage.models import Job, Shard, ShardStatus, utcnow


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_alive(worker: str | None, lease_expires_at: datetime | None = None) -> bool:
    """On this host: is the process there (zombies count as dead)? Elsewhere: is the lease still running?"""
    if not worker:
        return False
    if worker == worker_id():
        return True
    host, _, pid = worker.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        return _process_alive(int(pid))
    return lease_expires_at is not None and lease_expires_at > utcnow()


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


def runner_alive(job: Job) -> bool:
    """Is some process still running this job: its runner (`tokenmill run`), or a worker running one of its
    shards (its process on this host, its unexpired lease elsewhere)?"""
    running = [s for s in job.shards if s.status == ShardStatus.RUNNING]
    leases = [s.lease_expires_at for s in running if s.lease_expires_at]
    return worker_alive(job.worker, max(leases, default=None)) or any(shard_runner_alive(s) for s in running)


def shard_runner_alive(shard: Shard) -> bool:
    return worker_alive(shard.worker, shard.lease_expires_at)
