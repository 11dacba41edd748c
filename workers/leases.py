"""Holding claims: a `LeaseHeartbeat` renews the leases a process holds (shards, and job steps) on the
database's clock, from claim to commit; `HeldHere` is what the process is running now (a claim recorded as this
process's own holds only while it does); `StatusWatch` tells a running shard when to stop."""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

from sqlalchemy.orm import Session, sessionmaker

from storage import clock
from storage import repository as repo
from storage.faults import is_transient
from storage.liveness import LEASE, lease_until
from storage.models import JobStatus

log = logging.getLogger("tokenmill.leases")

STATUS_POLL_SECONDS = 1.0


class StaleClaim(RuntimeError):
    """The claim was taken over (its token moved on): this worker must stop and write nothing."""


class Claim(NamedTuple):
    kind: str  # "shard" or "job" (a job's plan or finalize step, or `tokenmill run`)
    id: int | str


def shard_claim(shard_id: int) -> Claim:
    return Claim("shard", shard_id)


def job_claim(job_id: str) -> Claim:
    return Claim("job", job_id)


class HeldHere:
    """The job steps and shards a process runs now, kept by whoever owns the process's work (a worker process,
    `workers.worker_engine.WorkerProcess`; a job run in process) and shared by its steps: a claim recorded under
    this process's worker id holds only while it is here (else its end was never recorded)."""

    def __init__(self) -> None:
        self._jobs: set[str] = set()
        self._shards: set[int] = set()
        self._lock = threading.Lock()

    def job(self, job_id: str) -> bool:
        return job_id in self._jobs

    def shard(self, shard_id: int) -> bool:
        return shard_id in self._shards

    def hold(self, claim: Claim) -> None:
        with self._lock:
            (self._jobs if claim.kind == "job" else self._shards).add(claim.id)

    def let_go(self, claim: Claim) -> None:
        with self._lock:
            (self._jobs if claim.kind == "job" else self._shards).discard(claim.id)


class LeaseHeartbeat:
    """Renews the leases of the claims it holds ({claim: token}) on its own thread, every quarter lease,
    whatever the engine or a write is doing. A renewal that finds a claim gone (another claim or a cancel moved
    the token on) records it in `lost`: that work must stop and write nothing. A renewal that fails (the
    database down) is tried again at the next beat; the lease has four."""

    def __init__(self, sessions: sessionmaker[Session], claims: dict[Claim, int] | None = None,
                 every_s: float | None = None) -> None:
        self.sessions, self.claims = sessions, dict(claims or {})
        self.every_s = every_s if every_s is not None else LEASE.total_seconds() / 4
        self.lost: set[Claim] = set()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None
        self._users = 0

    def add(self, claim: Claim, token: int) -> None:
        with self._lock:
            self.claims[claim] = token

    def discard(self, claim: Claim) -> None:
        with self._lock:
            self.claims.pop(claim, None)

    def holds(self, claim: Claim) -> bool:
        return claim not in self.lost

    def __enter__(self) -> LeaseHeartbeat:
        """Beat while any user is inside (several shards of one `tokenmill run` share its heartbeat)."""
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._stop = threading.Event()
                self._thread = clock.periodic(self.every_s, self.beat, self._stop, "lease-heartbeat")
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            if self._users:
                return
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def beat(self) -> None:
        with self._lock:
            claims = {c: t for c, t in self.claims.items() if c not in self.lost}
        if not claims:
            return
        try:
            with self.sessions.begin() as session:
                until = lease_until(session)
                for claim, token in claims.items():
                    renew = repo.renew_lease if claim.kind == "shard" else repo.renew_job_lease
                    if not renew(session, claim.id, token, until):
                        log.warning("%s %s: its claim (token %d) was taken over; stopping it", claim.kind,
                                    claim.id, token)
                        self.lost.add(claim)
        except Exception as error:  # the database is down: try again next beat (the lease has 4 beats)
            log.warning("could not renew the leases: %s", error)


class StatusWatch:
    """Between engine steps: is the job still in progress, and does this worker still hold its shard? Asks
    the database at most once a second (the lease is renewed by a `LeaseHeartbeat`)."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, heartbeat: LeaseHeartbeat,
                 claim: Claim | None = None) -> None:
        self.sessions, self.job_id, self.heartbeat, self.claim = sessions, job_id, heartbeat, claim
        self.checked = float("-inf")  # the first call always asks: a shard never starts on a cancelled job

    def should_stop(self) -> bool:
        if self.claim is not None and not self.heartbeat.holds(self.claim):
            return True
        now = clock.monotonic()
        if now - self.checked < STATUS_POLL_SECONDS:
            return False
        self.checked = now
        try:
            with self.sessions() as session:
                status = repo.job_status(session, self.job_id)
        except Exception as error:
            if not is_transient(error):
                raise
            log.warning("job %s: cannot read its status (%s); running on", self.job_id, error)
            return False  # the database is down: keep generating (the leases outlast a short outage)
        return status != JobStatus.IN_PROGRESS
