"""One shard of a job: claim it, run its rows in the process's engine loop, write its part file, commit it.
The Celery task `run_shard` runs one; `tokenmill run` (`workers.inprocess`) runs a job's shards K at a time.

A claim is a lease on the database's clock, renewed by the job's `LeaseHeartbeat` from claim to commit (through
the part write), and a fencing token that each write is conditional on: a worker whose claim was taken over
writes nothing. The shard that completes a job's last row range moves it to `finalizing` in the same
transaction that holds the job row's lock, so exactly one finisher sees it.

A shard that used its attempts (its rows raised or killed its workers each time) does not fail the job: its next
claim writes each of its rows as a `server_error` error, through the same part write and commit as a run, so the
job completes with the rows that could not run in its error file, as OpenAI's batches do. Only a shard whose
engine could not load, or whose errors could not be written either, fails the job."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

from sqlalchemy import select

from storage import claims, clock
from storage import repository as repo
from storage.faults import crash_point, is_transient, pause_point
from storage.formats import Request, RowError, part_key, write_part
from storage.liveness import LEASE, db_now
from storage.models import FailedRow, Job, JobStatus, Shard, ShardStatus, utcnow
from storage.objectstore import InputChanged, open_store
from storage.states import transition
from workers.adapters import AdapterSource, job_adapters, resolve_adapters
from workers.engine_loop import EngineLoop, RowSettings
from workers.job_steps import JobSteps, discard_if_ended
from workers.leases import Claim, StaleClaim, StatusWatch, shard_claim
from workers.shards import ShardOutcome, served_models

log = logging.getLogger("tokenmill.jobs")
# how long a shard whose rows are done waits out a database or S3 outage to commit them (rather than redo them)
OUTAGE_WAIT_S = float(os.environ.get("TOKENMILL_OUTAGE_WAIT_S") or 300)
# how long a shard stopped by an outage waits for the database to give its attempt back (past it, the attempt counts)
REFUND_WAIT_S = 3600.0
ERROR_WRITE_ATTEMPTS = 3  # claims past the attempt limit that may try to write a shard's rows as errors

S = JobStatus


class ShardClaim(NamedTuple):
    """What `ShardStep.claim_shard` decided: `run` (the shard is ours now), `exhausted` (ours, but out of attempts:
    its rows are to be written as errors with the message `exhausted`), `done` (completed before), `busy` (a live
    worker runs it), `stopped` (the job is not running: cancelled, failed...) or `gave_up` (out of attempts and
    not the rows' fault, or its errors could not be written: the shard and the job are now failed)."""

    decision: str
    shard: Shard | None = None
    job: Job | None = None
    exhausted: str | None = None


class EngineUnavailable(RuntimeError):
    """The worker's engine could not load: the whole job cannot run here, whatever its rows hold."""


def exhausted_message(shard: Shard) -> str:
    """The error of each row of a shard that used its attempts; it names no worker and no exception text."""
    last = f"it raised {shard.error.split(':', 1)[0]}" if shard.error else "its worker stopped while running it"
    return (f"The server had an error while processing this request: its shard was tried {shard.attempts} "
            f"time(s), the limit (last: {last})")


def cannot_end_with_errors(shard: Shard, max_attempts: int) -> bool:
    """Must a shard out of attempts fail its job? When its engine could not load (not its rows' fault), or when
    writing its rows as errors failed ERROR_WRITE_ATTEMPTS times too."""
    engine_down = (shard.error or "").startswith(f"{EngineUnavailable.__name__}:")
    return engine_down or shard.attempts >= max_attempts + ERROR_WRITE_ATTEMPTS


def engine_priority(job: Job) -> int:
    """The engine request priority of a job's rows: a higher job priority is admitted first, and the engine
    admits the lowest value first."""
    return -(job.priority or 0)


def request_prefix(job: Job, shard: Shard) -> str:
    """Request ids unique in a shared engine: the whole job id, the shard and the claim (then the row)."""
    return f"{job.id}-{shard.index}-c{shard.claim_token}-"


class ShardStep:
    """The shard steps of one job. `steps` is the job's: its sessions, worker id, heartbeat, progress and input
    reader serve every shard of the job this process runs."""

    def __init__(self, steps: JobSteps, adapters: Mapping[str, AdapterSource] | None = None) -> None:
        self.steps = steps
        self.adapters = adapters or {}  # the worker's own LoRA adapters, served to every job beside the job's

    def claim_shard(self, shard_id: int, max_attempts: int, count_attempt: bool = True) -> ShardClaim:
        """Take the shard unless it is done, a live lease holds it, or its job is not running. A shard that
        already used `max_attempts` (its workers died, or it raised) is claimed `exhausted` (see `ShardClaim`).
        `count_attempt` False: a claim that uses none and applies no limit (a prefill, `workers.disagg`)."""
        steps = self.steps
        gave_up, exhausted = None, None
        with steps.sessions.begin() as session:
            job = steps.job_row(session)
            shard = repo.get_shard_by_id(session, shard_id, for_update=True)
            now = db_now(session)
            if job.status not in (S.QUEUED, S.IN_PROGRESS):
                claims.settle(job)
                return ShardClaim("stopped", shard, job)
            if shard.status == ShardStatus.COMPLETED:
                return ShardClaim("done", shard, job)
            if shard.status == ShardStatus.RUNNING and steps.held_by_another(
                    shard.worker, shard.lease_expires_at, steps.held.shard(shard.id), now):
                return ShardClaim("busy", shard, job)
            if count_attempt and shard.attempts >= max_attempts and cannot_end_with_errors(shard, max_attempts):
                claims.give_up(job, shard)
                gave_up = ShardClaim("gave_up", shard, job)
            else:
                if count_attempt and shard.attempts >= max_attempts:
                    exhausted, cause = exhausted_message(shard), shard.error
                    log.warning("job %s: %s; its rows end as errors", job.id, claims.attempts_used(shard))
                if job.status == S.QUEUED:
                    transition(job, S.IN_PROGRESS)
                repo.start_shard(shard, steps.worker, now + LEASE)
                if not count_attempt:  # start_shard counted one
                    shard.attempts -= 1
                if exhausted is not None:
                    shard.error = cause  # why its rows end as errors, kept beside them
        if gave_up is not None:
            discard_if_ended(steps.sessions, gave_up.job)
            return gave_up
        return ShardClaim("run" if exhausted is None else "exhausted", shard, job, exhausted)

    def execute_shard(self, job: Job, shard: Shard, engine: Callable[[], EngineLoop],
                      exhausted: str | None = None) -> ShardOutcome:
        """Run a shard this process has claimed (status running, its lease ours) in the process's engine service
        (`engine` gives it, loading the engine at first), write its part file and mark it completed, renewing its
        lease until the commit. A stop request ends it `cancelled`; a lost claim writes nothing (and, not being
        the work's fault, gives its attempt back); an error (loading the engine included, as `EngineUnavailable`)
        ends it `failed` and is raised. `exhausted` (an exhausted claim's message): its rows are not run but each
        written as a `server_error` error."""
        started = time.perf_counter()
        heartbeat = self.steps.heartbeat
        claim = shard_claim(shard.id)
        key = None
        self.steps.held.hold(claim)
        heartbeat.add(claim, shard.claim_token)
        try:
            with heartbeat:
                if exhausted is None:
                    outcome = self._run_rows(job, shard, loaded_engine(engine), claim)
                else:
                    outcome = self._rows_as_errors(job, shard, exhausted)
                self._check_claim(job, shard, claim)
                if outcome.cancelled:
                    if not self._end_shard(shard, ShardStatus.CANCELLED):  # stopped because it was taken over
                        raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
                    return outcome
                through_outages(lambda: self.steps.check_input_unchanged(job))
                key = part_key(shard.index, job.id, shard.claim_token)  # known to the cleanup should the write raise
                key = through_outages(lambda: self._write_part(job, shard, outcome, claim))
                crash_point("after_part_upload")
                through_outages(lambda: self._record_shard(job, shard, outcome, key, started))
        except StaleClaim as lost:
            log.warning("%s; this worker stops it and writes nothing", lost)
            self._after_lost_claim(job, shard, key)
            return ShardOutcome(lost=True)
        except InputChanged as changed:  # not the shard's fault, nor a retry's cure: the job fails with why
            self._end_shard(shard, ShardStatus.FAILED, str(changed))
            self.steps.fail(str(changed))
            log.error("job %s: %s", job.id, changed)
            return ShardOutcome(cancelled=True)
        except Exception as error:
            if not self._end_shard(shard, ShardStatus.FAILED, f"{type(error).__name__}: {error}"):
                log.warning("job %s: shard %d failed after its claim was taken over (%s: %s)", job.id, shard.index,
                            type(error).__name__, error)
                self._after_lost_claim(job, shard, key)
                return ShardOutcome(lost=True)
            raise
        finally:
            heartbeat.discard(claim)
            self.steps.held.let_go(claim)
        return outcome

    def _run_rows(self, job: Job, shard: Shard, loop: EngineLoop, claim: Claim) -> ShardOutcome:
        watch = StatusWatch(self.steps.sessions, job.id, self.steps.heartbeat, claim)
        if watch.should_stop():  # a shard never starts on a job that stopped
            return ShardOutcome(cancelled=True)
        rows = self.steps.read_rows(job, shard)  # read here, not on the engine thread
        return loop.run(self.row_settings(job, rows), rows, request_prefix(job, shard), watch.should_stop,
                        self.steps.progress)

    def _rows_as_errors(self, job: Job, shard: Shard, message: str) -> ShardOutcome:
        """The outcome of a shard out of attempts: each row a `server_error` (a row that could not have run keeps
        its own error)."""
        rows = self.steps.read_rows(job, shard)
        return ShardOutcome(errors=[row if isinstance(row, RowError) else
                                    RowError(row.row, row.custom_id, "server_error", message) for row in rows])

    def row_settings(self, job: Job, rows: list) -> RowSettings:
        """How the job's rows run; the adapters its rows name are fetched here (not on the engine thread)."""
        sources = job_adapters(job, self.adapters)
        named = {row.model for row in rows if isinstance(row, Request) and isinstance(row.model, str)}
        return RowSettings(job.settings.sampling, engine_priority(job), job.settings.cache_salt,
                           job.settings.speculative_config, served_models(job), job.settings.batch_invariant,
                           job.settings.truncate_inputs, resolve_adapters(named & sources.keys(), sources),
                           frozenset(sources))

    def _check_claim(self, job: Job, shard: Shard, claim: Claim) -> None:
        if not self.steps.heartbeat.holds(claim):
            raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")

    def _after_lost_claim(self, job: Job, shard: Shard, key: str | None) -> None:
        """The claim went to another worker, or a cancel or the deadline fenced it: remove the part this claim
        wrote or may have written (its key is its own) and give its attempt back."""
        if key is not None:
            self._remove_lost_part(job, shard, key)
        try:
            with self.steps.sessions.begin() as session:
                self.steps.job_row(session)
                row = repo.get_shard_by_id(session, shard.id, for_update=True)
                if row.attempts > 0:  # counted by the claim that took over (perhaps completed since) too
                    row.attempts -= 1
        except Exception as error:
            log.warning("job %s: shard %d: could not clean up after its lost claim: %s", job.id, shard.index, error)

    def _remove_lost_part(self, job: Job, shard: Shard, key: str) -> None:
        """Delete a lost claim's part, through a store outage; failing that, it stays recorded (noted before its
        upload, and noted again here should a sweep have forgotten it) for `remove_stray_parts`."""
        try:
            with self.steps.sessions.begin() as session:
                repo.note_upload(session, job.id, key)
        except Exception as error:  # the database is down: the delete may still work
            log.warning("job %s: shard %d: could not record its lost claim's part %s: %s", job.id, shard.index,
                        key, error)
        try:
            through_outages(lambda: open_store(job.output_uri, job.settings.s3).delete(key))
            with self.steps.sessions.begin() as session:
                repo.forget_upload(session, job.id, key)
        except Exception as error:
            log.warning("job %s: shard %d: could not remove its lost claim's part %s (%s); the sweep will",
                        job.id, shard.index, key, error)

    def _write_part(self, job: Job, shard: Shard, outcome: ShardOutcome, claim: Claim) -> str:
        """The part under this claim's own key, once the claim is checked to be still ours; the key is recorded
        before the upload, so a cleanup finds it whatever happens to this worker after."""
        key = part_key(shard.index, job.id, shard.claim_token)
        with self.steps.sessions.begin() as session:
            if session.scalar(select(Shard.claim_token).where(Shard.id == shard.id)) != shard.claim_token:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
            repo.note_upload(session, job.id, key)
        pause_point("before_part_upload")
        key = write_part(open_store(job.output_uri, job.settings.s3), shard.index, outcome.records, job.id,
                         shard.claim_token, outcome.embedding_size)
        if not self.steps.heartbeat.holds(claim):
            raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker during its write")
        return key

    def _record_shard(self, job: Job, shard: Shard, outcome: ShardOutcome, key: str, started: float) -> None:
        outcome.completed_job = self._complete_shard(shard, outcome, key)
        log.info("job %s: shard %d (rows %d-%d) completed in %.1f s: %d ok, %d failed", job.id, shard.index,
                 shard.row_start, shard.row_end - 1, time.perf_counter() - started,
                 outcome.totals()["rows_completed"], len(outcome.errors))

    def _complete_shard(self, shard: Shard, outcome: ShardOutcome, key: str) -> bool:
        """Mark the shard completed; True when it was the job's last (the job went to finalizing), also when
        this is a retry whose first try committed that (its reply lost): the finalize task is still to send."""
        with self.steps.sessions.begin() as session:
            job = self.steps.job_row(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker "
                                 f"(token {row.claim_token}, ours {shard.claim_token})")
            committed_before = row.status == ShardStatus.COMPLETED  # by this claim's earlier try
            errors = [FailedRow(job_id=job.id, shard=shard.index, row_index=e.row, custom_id=e.custom_id,
                                code=e.code, message=e.message) for e in outcome.errors]
            repo.complete_shard(session, row, outcome.totals(), key, errors)
            return claims.settle(job) == S.FINALIZING or (committed_before and job.status == S.FINALIZING)

    def _end_shard(self, shard: Shard, status: ShardStatus, error: str | None = None) -> bool:
        """A shard that stopped without completing: cancelled, or failed with its error (redone on a retry).
        False when its claim was taken over meanwhile (nothing is written)."""
        with self.steps.sessions.begin() as session:
            job = self.steps.job_row(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:
                log.warning("job %s: shard %d was claimed by another worker; not marking it %s", job.id,
                            shard.index, status)
                return False
            row.status, row.error, row.lease_expires_at, row.finished_at = status.value, error, None, utcnow()
            claims.settle(job)
        discard_if_ended(self.steps.sessions, job)
        return True

    def refund_attempt(self, shard: Shard, error: BaseException) -> None:
        """The shard stopped for a transient fault (a service down), not for its work: the attempt does not
        count. Waits for the database (up to REFUND_WAIT_S): an outage may also have kept its end from being
        recorded (it ends failed here), and should its claim have moved on meanwhile, the attempt is given
        back as after a lost claim."""
        through_outages(lambda: self._refund_attempt(shard, f"{type(error).__name__}: {error}"), REFUND_WAIT_S)

    def _refund_attempt(self, shard: Shard, error: str) -> None:
        with self.steps.sessions.begin() as session:
            job = self.steps.job_row(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:  # counted by the claim that took over too
                if row.attempts > 0:
                    row.attempts -= 1
                return
            ended = row.status == ShardStatus.RUNNING
            if ended:
                row.status, row.error, row.lease_expires_at, row.finished_at = (ShardStatus.FAILED.value, error,
                                                                                None, utcnow())
                claims.settle(job)
            if row.status == ShardStatus.FAILED and row.attempts == shard.attempts > 0:  # not given back yet
                row.attempts -= 1
        if ended:
            discard_if_ended(self.steps.sessions, job)


def loaded_engine(engine: Callable[[], EngineLoop]) -> EngineLoop:
    """The process's engine service; a load that fails (not for a service being down) raises
    `EngineUnavailable`."""
    try:
        return engine()
    except Exception as error:
        if is_transient(error):
            raise
        raise EngineUnavailable(f"{type(error).__name__}: {error}") from error


T = TypeVar("T")


def through_outages(step: Callable[[], T], wait_s: float | None = None) -> T:
    """Run one commit step, retrying it with backoff while the database or S3 is down (up to `wait_s`, default
    OUTAGE_WAIT_S). Each step is safe to repeat: the part key is the claim's own and the shard's commit replaces
    its rows."""
    deadline, delay = clock.monotonic() + (OUTAGE_WAIT_S if wait_s is None else wait_s), 1.0
    while True:
        try:
            return step()
        except Exception as error:
            if not is_transient(error) or clock.monotonic() + delay > deadline:
                raise
            log.warning("a service is down (%s: %s); trying again in %.0f s", type(error).__name__,
                        str(error).splitlines()[0][:200], delay)
            clock.sleep(delay)
            delay = min(delay * 2, 15.0)
