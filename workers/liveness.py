"""Who is running a job: a worker is `host:pid`; a dead worker's job or shard may be taken over."""

from __future__ import annotations

import os
import socket
from datetime import datetime

from storage.models import utcnow


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
