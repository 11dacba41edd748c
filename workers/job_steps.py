"""The steps of one job, each in its own transactions: validate the input and plan shards, run one shard
through the process's engine loop, finalize. The Celery tasks (`workers.tasks`) run them as separate tasks on
many workers; `tokenmill run` (`workers.runner`) takes one job through them in one process.

Every step is a claim: a lease on the database's clock, renewed by a `LeaseHeartbeat` from claim to commit
(through the part and manifest writes), and a fencing token that each of the step's writes is conditional on.
The shard that completes a job's last row range moves it to `finalizing` in the same transaction that holds the
job row's lock, so exactly one finisher sees it. A job that ends without completing keeps only its committed
parts."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from storage import claims
from storage import repository as repo
from storage.faults import crash_point, is_transient
from storage.formats import InputError, InputReader, open_input, write_manifest, write_part
from storage.liveness import LEASE, db_now, holder_alive, worker_id
from storage.models import FailedRow, Job, JobStatus, Shard, ShardStatus, utcnow
from storage.objectstore import InputChanged, ObjectStore, open_file_store, open_store
from storage.states import TERMINAL, transition
from workers.engine_loop import RowSettings, loop_for
from workers.finalize import discard_outputs, finalize_outputs
from workers.leases import Claim, LeaseHeartbeat, StaleClaim, StatusWatch, job_claim, shard_claim
from workers.shards import ShardOutcome, served_models

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.jobs")
# how long a shard whose rows are done waits out a database or S3 outage to commit them (rather than redo them)
OUTAGE_WAIT_S = float(os.environ.get("TOKENMILL_OUTAGE_WAIT_S") or 300)

S = JobStatus
RUNNING_HERE: set[int] = set()  # the shards this process is running now
STEPS_HERE: set[str] = set()  # the jobs whose step this process holds now
_here_lock = threading.Lock()


class Progress(Protocol):
    def phase(self, description: str) -> None: ...

    def start(self, total_rows: int, done_rows: int) -> None: ...

    def advance(self, rows: int, tokens: int) -> None: ...


class NoProgress:
    def phase(self, description: str) -> None:
        log.info(description)

    def start(self, total_rows: int, done_rows: int) -> None:
        pass

    def advance(self, rows: int, tokens: int) -> None:
        pass


class ShardClaim(NamedTuple):
    """What `JobSteps.claim_shard` decided: `run` (the shard is ours now), `done` (completed before), `busy`
    (a live worker runs it), `stopped` (the job is not running: cancelled, failed...) or `gave_up` (out of
    attempts: the shard and the job are now failed)."""

    decision: str
    shard: Shard | None = None
    job: Job | None = None


def engine_priority(job: Job) -> int:
    """The engine request priority of a job's rows: a higher job priority is admitted first, and the engine
    admits the lowest value first."""
    return -(job.priority or 0)


def discard_if_ended(sessions: sessionmaker[Session], job: Job) -> None:
    """After a commit: a job that ended without completing keeps only its committed parts."""
    if job.status not in TERMINAL or job.status == S.COMPLETED or not job.output_uri:
        return
    try:
        with sessions() as session:
            shards = repo.shards(session, job.id)
        discard_outputs(open_store(job.output_uri, job.settings.s3), job, shards)
    except Exception as error:  # the store is down: the next step or retry of the job cleans up
        log.warning("job %s: could not remove its uncommitted outputs: %s", job.id, error)


def request_prefix(job: Job, shard: Shard) -> str:
    """Request ids unique in a shared engine: the whole job id, the shard and the claim (then the row)."""
    return f"{job.id}-{shard.index}-c{shard.claim_token}-"


class JobSteps:
    """The steps of one job. Each opens its own transactions and locks the job row before it changes it."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, progress: Progress | None = None) -> None:
        self.sessions, self.job_id = sessions, job_id
        self.progress = progress or NoProgress()
        self.worker = worker_id()
        self.step_token: int | None = None  # the job's claim token while this holds its step (claim_step)
        self.heartbeat = LeaseHeartbeat(sessions)
        self._reader: InputReader | None = None
        self._reader_lock = threading.Lock()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # -- state ------------------------------------------------------------------------------------

    def _job(self, session: Session, lock: bool = True) -> Job:
        return repo.get_job(session, self.job_id, for_update=lock)

    def load(self) -> Job:
        with self.sessions() as session:
            return self._job(session, lock=False)

    def set_status(self, status: JobStatus, error: str | None = None) -> Job:
        """Transition, unless a cancel request came first (then only cancelled or failed may follow)."""
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status == S.CANCELLING and status not in (S.CANCELLED, S.FAILED):
                return job
            if job.status != status:
                if status == S.FAILED:
                    claims.fail(job, error or "failed")
                else:
                    transition(job, status, error=error)
        discard_if_ended(self.sessions, job)
        return job

    def fail(self, error: str) -> Job:
        """End the job `failed` with error, unless it already ended; its uncommitted outputs are removed."""
        with self.sessions.begin() as session:
            job = self._job(session)
            claims.fail(job, error)
        discard_if_ended(self.sessions, job)
        return job

    def claim_step(self, status: JobStatus, max_attempts: int | None = None) -> bool:
        """Hold the job for one step (validating, finalizing) unless it is past that step or another live
        process holds it. Each claim bumps the job's token (the step's writes are conditional on it), takes a
        lease that `heartbeat` renews, and counts an attempt: a step started `max_attempts` times without
        finishing (its worker died each time) fails the job. `release` lets go."""
        with self.sessions.begin() as session:
            job, now = self._job(session), db_now(session)
            if job.status != status or self._held_by_another(job.worker, job.lease_expires_at, job.id in STEPS_HERE,
                                                             now):
                return False
            if max_attempts is not None and job.attempts >= max_attempts:
                claims.fail(job, f"{status} was started {job.attempts} time(s) without finishing "
                                 f"(the limit; its worker died or it kept failing)")
                log.error("job %s: %s", job.id, job.error)
                ended = job
            else:
                self._take_step(job, now)
                ended = None
        if ended is not None:
            discard_if_ended(self.sessions, ended)
            return False
        return True

    def _held_by_another(self, worker: str | None, lease_expires_at, running_here: bool, now) -> bool:
        """Is a claim held elsewhere? This process's own holds only while it still runs the work (else its end
        was never recorded); any other holder while its lease runs."""
        if worker == self.worker:
            return running_here
        return holder_alive(worker, lease_expires_at, now)

    def _take_step(self, job: Job, now) -> None:
        job.worker, job.attempts = self.worker, job.attempts + 1
        repo.fence(job)
        job.lease_expires_at = now + LEASE
        self.step_token = job.claim_token
        with _here_lock:
            STEPS_HERE.add(job.id)
        self.heartbeat.add(job_claim(job.id), job.claim_token)

    def _step_is_ours(self, job: Job) -> bool:
        """(job row locked) Does this process still hold the job's step? Always, outside `claim_step`."""
        if self.step_token is None or job.claim_token == self.step_token:
            return True
        log.warning("job %s: its step was claimed again (token %s, ours %s); writing nothing", job.id,
                    job.claim_token, self.step_token)
        return False

    def release(self, finished: bool = False, refund: bool = False) -> None:
        """Let go of the step; `finished` clears the step's attempt count, `refund` gives this attempt back
        (a transient fault, not the work)."""
        self.close()
        self.heartbeat.discard(job_claim(self.job_id))
        with _here_lock:
            STEPS_HERE.discard(self.job_id)
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status in TERMINAL and job.worker == self.worker:  # ended (perhaps fenced by this very step)
                job.worker, job.lease_expires_at = None, None
                return
            if not self._step_is_ours(job):
                return
            if job.worker == self.worker:
                job.worker, job.lease_expires_at = None, None
            if finished:
                job.attempts = 0
            elif refund and job.attempts > 0:
                job.attempts -= 1

    # -- validating ---------------------------------------------------------------------------------

    def _reader_for(self, job: Job) -> InputReader:
        """The job's input; once validated, the pinned version only (else `InputChanged`)."""
        with self._reader_lock:
            if self._reader is None:
                pin = job.settings.input_fingerprint if job.status != S.VALIDATING else job.settings.inbox_pin
                self._reader = open_input(*self._input_location(job), job.settings.limits, pin=pin,
                                          task=job.settings.task)
            return self._reader

    def _read_rows(self, job: Job, shard: Shard) -> list:
        reader = self._reader_for(job)
        with self._reader_lock:  # one reader per job, shared by the shards of this process
            return list(reader.read(shard.row_start, shard.row_end))

    def _check_input(self, job: Job) -> None:
        """After reading a shard: the input is still the validated version (a local file checks size, mtime)."""
        if job.settings.input_fingerprint is not None:
            store, key = self._input_location(job)
            store.check_pin(key, job.settings.input_fingerprint)

    def _input_location(self, job: Job) -> tuple[ObjectStore, str]:
        return open_file_store(job.input_uri, job.settings.s3)

    def validate(self) -> Job:
        """validating -> queued with the shards planned, or -> failed with a message naming the problem. A
        transient fault of the store (a timeout, throttling) is raised: the caller retries with backoff. The
        step's lease is renewed while it reads."""
        with self.heartbeat:
            return self._validate()

    def _validate(self) -> Job:
        self.progress.phase("validating input")
        with self.sessions() as session:
            job = self._job(session, lock=False)
            started = any(s.attempts for s in job.shards)
        try:
            store, key = self._input_location(job)
            fingerprint = store.pin(key)
            reader = self._reader_for(job)  # with an inbox pin, only the version the inbox listed
            reader.validate()
            store.check_pin(key, fingerprint)  # not replaced while it was read
            if not started:
                self._check_output_empty(job)
        except FileNotFoundError:
            return self.set_status(S.FAILED, error=f"input {job.input_uri} does not exist")
        except (InputError, InputChanged) as error:
            log.warning("job %s failed validation: %s", job.id, error)
            return self.set_status(S.FAILED, error=str(error))
        return self._plan(reader.num_rows, reader.format, fingerprint, started)

    def _check_output_empty(self, job: Job) -> None:
        existing = open_store(job.output_uri, job.settings.s3).list()
        if existing:
            raise InputError(f"output {job.output_uri} already holds {len(existing)} file(s) (e.g. {existing[0]}) "
                             f"from another job; choose an empty --output")

    def _plan(self, num_rows: int, input_format: str, fingerprint: dict, started: bool) -> Job:
        with self.sessions.begin() as session:
            job = self._job(session)
            if not self._step_is_ours(job):
                return job
            if job.status == S.CANCELLING:
                claims.mark_cancelled(job)
                return job
            if started and job.settings.input_fingerprint != fingerprint:
                claims.fail(job, f"input {job.input_uri} changed since this job started "
                                 f"(pinned {job.settings.input_fingerprint}, now {fingerprint}); "
                                 "write to a new --output to run it as a new job")
                return job
            if not started:
                session.execute(delete(Shard).where(Shard.job_id == job.id))
                session.execute(delete(FailedRow).where(FailedRow.job_id == job.id))
                size = job.settings.shard_size
                repo.add_shards(session, job, ((s, min(s + size, num_rows)) for s in range(0, num_rows, size)))
            job.requests_total = num_rows
            job.settings = job.settings.model_copy(update={"input_fingerprint": fingerprint,
                                                           "input_format": input_format})
            transition(job, S.QUEUED)
            log.info("job %s: %d rows of %s in %d shard(s)", job.id, num_rows, input_format,
                     -(-num_rows // job.settings.shard_size))
            return job

    # -- shards -------------------------------------------------------------------------------------

    def claim_shard(self, shard_id: int, max_attempts: int) -> ShardClaim:
        """Take the shard unless it is done, a live lease holds it, or its job is not running. A shard that
        already used `max_attempts` (its workers died, or it raised) fails the job."""
        gave_up = None
        with self.sessions.begin() as session:
            job = self._job(session)
            shard = repo.get_shard_by_id(session, shard_id, for_update=True)
            now = db_now(session)
            if job.status not in (S.QUEUED, S.IN_PROGRESS):
                claims.settle(job)
                return ShardClaim("stopped", shard, job)
            if shard.status == ShardStatus.COMPLETED:
                return ShardClaim("done", shard, job)
            if shard.status == ShardStatus.RUNNING and self._held_by_another(
                    shard.worker, shard.lease_expires_at, shard.id in RUNNING_HERE, now):
                return ShardClaim("busy", shard, job)
            if shard.attempts >= max_attempts:
                claims.give_up(job, shard)
                gave_up = ShardClaim("gave_up", shard, job)
            else:
                if job.status == S.QUEUED:
                    transition(job, S.IN_PROGRESS)
                repo.start_shard(shard, self.worker, now + LEASE)
        if gave_up is not None:
            discard_if_ended(self.sessions, gave_up.job)
            return gave_up
        return ShardClaim("run", shard, job)

    def execute_shard(self, job: Job, shard: Shard, engine: Callable[[], LLMEngine]) -> ShardOutcome:
        """Run a shard this process has claimed (status running, its lease ours) in the process's engine loop,
        write its part file and mark it completed, renewing its lease until the commit. A stop request ends it
        `cancelled`; a lost claim writes nothing (and, not being the work's fault, gives its attempt back); an
        error (loading the engine included) ends it `failed` and is raised."""
        started = time.perf_counter()
        claim = shard_claim(shard.id)
        key = None
        with _here_lock:
            RUNNING_HERE.add(shard.id)
        self.heartbeat.add(claim, shard.claim_token)
        try:
            with self.heartbeat:
                outcome = self._run_rows(job, shard, engine(), claim)
                self._check_claim(job, shard, claim)
                if outcome.cancelled:
                    if not self._end_shard(shard, ShardStatus.CANCELLED):  # stopped because it was taken over
                        raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
                    return outcome
                through_outages(lambda: self._check_input(job))
                key = through_outages(lambda: self._write_part(job, shard, outcome, claim))
                crash_point("after_part_upload")
                through_outages(lambda: self._record_shard(job, shard, outcome, key, started))
        except StaleClaim as lost:
            log.warning("%s; this worker stops it and writes nothing", lost)
            self._after_lost_claim(job, shard, key)
            return ShardOutcome(lost=True)
        except InputChanged as changed:  # not the shard's fault, nor a retry's cure: the job fails with why
            self._end_shard(shard, ShardStatus.FAILED, str(changed))
            self.fail(str(changed))
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
            self.heartbeat.discard(claim)
            with _here_lock:
                RUNNING_HERE.discard(shard.id)
        return outcome

    def _run_rows(self, job: Job, shard: Shard, engine: LLMEngine, claim: Claim) -> ShardOutcome:
        watch = StatusWatch(self.sessions, job.id, self.heartbeat, claim)
        if watch.should_stop():  # a shard never starts on a job that stopped
            return ShardOutcome(cancelled=True)
        settings = RowSettings(job.settings.sampling, engine_priority(job), job.settings.cache_salt,
                               job.settings.speculative_config, served_models(job), job.settings.batch_invariant,
                               job.settings.truncate_inputs)
        rows = self._read_rows(job, shard)  # read here, not on the engine thread
        return loop_for(engine).run(settings, rows, request_prefix(job, shard), watch.should_stop, self.progress)

    def _check_claim(self, job: Job, shard: Shard, claim: Claim) -> None:
        if not self.heartbeat.holds(claim):
            raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")

    def _after_lost_claim(self, job: Job, shard: Shard, key: str | None) -> None:
        """The claim went to another worker, or a cancel or the deadline fenced it: remove the part this claim
        wrote (its key is its own) and give its attempt back."""
        try:
            if key is not None:
                open_store(job.output_uri, job.settings.s3).delete(key)
            with self.sessions.begin() as session:
                self._job(session)
                row = repo.get_shard_by_id(session, shard.id, for_update=True)
                if row.attempts > 0:  # counted by the claim that took over (perhaps completed since) too
                    row.attempts -= 1
        except Exception as error:
            log.warning("job %s: shard %d: could not clean up after its lost claim: %s", job.id, shard.index, error)

    def _write_part(self, job: Job, shard: Shard, outcome: ShardOutcome, claim: Claim) -> str:
        """The part under this claim's own key, once the claim is checked to be still ours."""
        with self.sessions() as session:
            if session.scalar(select(Shard.claim_token).where(Shard.id == shard.id)) != shard.claim_token:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
        key = write_part(open_store(job.output_uri, job.settings.s3), shard.index, outcome.records, job.id,
                         shard.claim_token, outcome.embedding_size)
        if not self.heartbeat.holds(claim):
            raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker during its write")
        return key

    def _record_shard(self, job: Job, shard: Shard, outcome: ShardOutcome, key: str, started: float) -> None:
        outcome.completed_job = self._complete_shard(shard, outcome, key)
        log.info("job %s: shard %d (rows %d-%d) completed in %.1f s: %d ok, %d failed", job.id, shard.index,
                 shard.row_start, shard.row_end - 1, time.perf_counter() - started,
                 outcome.totals()["rows_completed"], len(outcome.errors))

    def _complete_shard(self, shard: Shard, outcome: ShardOutcome, key: str) -> bool:
        """Mark the shard completed; True when it was the job's last (the job went to finalizing)."""
        with self.sessions.begin() as session:
            job = self._job(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker "
                                 f"(token {row.claim_token}, ours {shard.claim_token})")
            errors = [FailedRow(job_id=job.id, shard=shard.index, row_index=e.row, custom_id=e.custom_id,
                                code=e.code, message=e.message) for e in outcome.errors]
            repo.complete_shard(session, row, outcome.totals(), key, errors)
            return claims.settle(job) == S.FINALIZING

    def _end_shard(self, shard: Shard, status: ShardStatus, error: str | None = None) -> bool:
        """A shard that stopped without completing: cancelled, or failed with its error (redone on a retry).
        False when its claim was taken over meanwhile (nothing is written)."""
        with self.sessions.begin() as session:
            job = self._job(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:
                log.warning("job %s: shard %d was claimed by another worker; not marking it %s", job.id,
                            shard.index, status)
                return False
            row.status, row.error, row.lease_expires_at, row.finished_at = status.value, error, None, utcnow()
            claims.settle(job)
        discard_if_ended(self.sessions, job)
        return True

    def refund_attempt(self, shard: Shard) -> None:
        """The shard failed for a transient fault (a service down), not for its work: the attempt does not count."""
        with self.sessions.begin() as session:
            self._job(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.status == ShardStatus.FAILED and row.attempts > 0 and row.claim_token == shard.claim_token:
                row.attempts -= 1

    def finish_cancel(self) -> Job:
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status == S.CANCELLING:
                claims.mark_cancelled(job)
            log.info("job %s cancelled; %d completed shard(s) kept", job.id,
                     sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED))
        discard_if_ended(self.sessions, job)
        return job

    # -- finalizing ---------------------------------------------------------------------------------

    def finalize(self) -> Job:
        """finalizing -> completed: the error file, the optional batch output, then the manifest, written only
        while this process still holds the step (and removed again should the job have ended otherwise
        meanwhile). Running it twice writes the same files; a job that is not `finalizing` is left as it is."""
        job = self.load()
        if job.status != S.FINALIZING:
            return job
        self.progress.phase("writing errors and manifest")
        with self.sessions() as session:
            shards = repo.shards(session, job.id)
        store = open_store(job.output_uri, job.settings.s3)
        finished_at = utcnow()
        with self.heartbeat:
            document = finalize_outputs(self.sessions, job, shards, store, finished_at)
            if not self._still_finalizing():
                return self.load()
            write_manifest(store, document)
            crash_point("during_finalize")
            with self.sessions.begin() as session:
                job = self._job(session)
                if self._holds_finalize(job):
                    transition(job, S.COMPLETED, at=finished_at)
                    return job
        discard_if_ended(self.sessions, job)  # the job ended otherwise meanwhile: no manifest stays
        return job

    def _still_finalizing(self) -> bool:
        with self.sessions() as session:
            return self._holds_finalize(self._job(session, lock=False))

    def _holds_finalize(self, job: Job) -> bool:
        return job.status == S.FINALIZING and self._step_is_ours(job) and self.heartbeat.holds(job_claim(job.id))


T = TypeVar("T")


def through_outages(step: Callable[[], T]) -> T:
    """Run one commit step, retrying it with backoff while the database or S3 is down (up to OUTAGE_WAIT_S).
    Each step is safe to repeat: the part key is the claim's own and the shard's commit replaces its rows."""
    deadline, delay = time.monotonic() + OUTAGE_WAIT_S, 1.0
    while True:
        try:
            return step()
        except Exception as error:
            if not is_transient(error) or time.monotonic() + delay > deadline:
                raise
            log.warning("a service is down (%s: %s); trying again in %.0f s", type(error).__name__,
                        str(error).splitlines()[0][:200], delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
