"""The steps of one job, each in its own transactions: validate the input and plan shards, run one shard
through an engine, finalize. `JobSteps` holds them; the in-process `JobRunner` below takes a job through
them in order, and the Celery tasks (`workers.tasks`) run them as separate tasks on many workers.

Completed shards are skipped, interrupted ones redone. The shard that completes a job's last row range moves
it to `finalizing` in the same transaction that holds the job row's lock, so exactly one finisher sees it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.faults import is_transient
from storage.formats import InputError, InputReader, open_input, write_part
from storage.liveness import runner_alive, shard_runner_alive, worker_alive, worker_id
from storage.models import FailedRow, Job, JobStatus, Shard, ShardStatus, utcnow
from storage.objectstore import InputChanged, ObjectStore, open_file_store, open_store
from storage.states import is_terminal, transition
from workers.finalize import finalize_outputs
from workers.shards import ShardExecution, ShardOutcome, ShardsExecution, ShardWork, engine_priority

__all__ = ["engine_priority"]  # where callers have found it

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.jobs")

LEASE = timedelta(seconds=float(os.environ.get("TOKENMILL_LEASE_S") or 120))  # renewed every quarter
RUNNING_HERE: set[int] = set()  # the shards this process is running now
STATUS_POLL_SECONDS = 1.0
S = JobStatus
EngineProvider = Callable[[dict[str, Any]], "LLMEngine"]  # engine settings of the job -> engine


class JobBusy(RuntimeError):
    """Another live process is running this job."""


class StaleClaim(RuntimeError):
    """The shard was claimed again (its token moved on): this worker must stop it and write nothing."""


def mark_cancelled(job: Job) -> None:
    """End the job `cancelled`: shards caught running or not yet started are marked cancelled, completed ones
    are kept (a retry of the job runs the cancelled ones again)."""
    for shard in job.shards:
        if shard.status in (ShardStatus.RUNNING, ShardStatus.PENDING):
            shard.status = ShardStatus.CANCELLED.value
            shard.lease_expires_at = None
    transition(job, S.CANCELLED)


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


class JobSteps:
    """The steps of one job. Each opens its own transactions and locks the job row before it changes it."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, progress: Progress | None = None) -> None:
        self.sessions, self.job_id = sessions, job_id
        self.progress = progress or NoProgress()
        self.worker = worker_id()
        self.step_token: int | None = None  # the job's claim token while this holds a step (claim_step)
        self._reader: InputReader | None = None

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
                transition(job, status, error=error)
            return job

    def fail(self, error: str) -> Job:
        """End the job `failed` with error, unless it already ended."""
        with self.sessions.begin() as session:
            job = self._job(session)
            if not is_terminal(job.status):
                transition(job, S.FAILED, error=error)
            return job

    def claim_step(self, status: JobStatus, max_attempts: int | None = None) -> bool:
        """Hold the job for one step (validating, finalizing) unless it is past that step or another live
        process holds it. Each claim bumps the job's token (the step's writes are conditional on it) and its
        attempts: a step started `max_attempts` times without finishing (its worker died each time) fails the
        job. `release` lets go."""
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status != status or (job.worker not in (None, self.worker) and worker_alive(job.worker)):
                return False
            if max_attempts is not None and job.attempts >= max_attempts:
                transition(job, S.FAILED, error=f"{status} was started {job.attempts} time(s) without finishing "
                                                f"(the limit; its worker died or it kept failing)")
                log.error("job %s: %s", job.id, job.error)
                return False
            job.worker, job.attempts = self.worker, job.attempts + 1
            job.claim_token = (job.claim_token or 0) + 1
            self.step_token = job.claim_token
            return True

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
        with self.sessions.begin() as session:
            job = self._job(session)
            if not self._step_is_ours(job):
                return
            if job.worker == self.worker:
                job.worker = None
            if finished:
                job.attempts = 0
            elif refund and job.attempts > 0:
                job.attempts -= 1

    # -- validating ---------------------------------------------------------------------------------

    def _reader_for(self, job: Job) -> InputReader:
        """The job's input; once validated, the pinned version only (else `InputChanged`)."""
        if self._reader is None:
            self._reader = open_input(*self._input_location(job), job.settings.limits,
                                      pin=job.settings.input_fingerprint if job.status != S.VALIDATING else None)
        return self._reader

    def _check_input(self, job: Job) -> None:
        """After reading a shard: the input is still the validated version (a local file checks size, mtime)."""
        if job.settings.input_fingerprint is not None:
            store, key = self._input_location(job)
            store.check_pin(key, job.settings.input_fingerprint)

    def _input_location(self, job: Job) -> tuple[ObjectStore, str]:
        return open_file_store(job.input_uri, job.settings.s3)

    def validate(self) -> Job:
        """validating -> queued with the shards planned, or -> failed with a message naming the problem."""
        self.progress.phase("validating input")
        with self.sessions() as session:
            job = self._job(session, lock=False)
            started = any(s.attempts for s in job.shards)
        try:
            store, key = self._input_location(job)
            fingerprint = store.pin(key)
            reader = self._reader_for(job)
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
                mark_cancelled(job)
                return job
            if started and job.settings.input_fingerprint != fingerprint:
                transition(job, S.FAILED, error=f"input {job.input_uri} changed since this job started "
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
        """For a worker of many: take the shard unless it is done, runs on a live worker, or its job is not
        running. A shard that already used `max_attempts` (its workers died, or it raised) fails the job."""
        with self.sessions.begin() as session:
            job = self._job(session)
            shard = repo.get_shard_by_id(session, shard_id, for_update=True)
            if job.status not in (S.QUEUED, S.IN_PROGRESS):
                _settle(job)
                return ShardClaim("stopped", shard, job)
            if shard.status == ShardStatus.COMPLETED:
                return ShardClaim("done", shard, job)
            if shard.status == ShardStatus.RUNNING and shard_runner_alive(shard) and not self._left_here(shard):
                return ShardClaim("busy", shard, job)
            if shard.attempts >= max_attempts:
                give_up(job, shard)
                return ShardClaim("gave_up", shard, job)
            if job.status == S.QUEUED:
                transition(job, S.IN_PROGRESS)
            repo.start_shard(shard, self.worker, utcnow() + LEASE)
            return ShardClaim("run", shard, job)

    def _left_here(self, shard: Shard) -> bool:
        """Marked running by this process, which no longer runs it (its end was not recorded: the database
        was down then)."""
        return shard.worker == self.worker and shard.id not in RUNNING_HERE

    def execute_shard(self, job: Job, shard: Shard, engine: Callable[[], LLMEngine]) -> ShardOutcome:
        """Run a shard this process has started (status running, its lease ours): generate, write the part
        file, mark it completed. A stop request ends it `cancelled`; an error (loading the engine included)
        ends it `failed` and is raised."""
        started = time.perf_counter()
        heartbeat = LeaseHeartbeat(self.sessions, {shard.id: shard.claim_token})
        RUNNING_HERE.add(shard.id)
        try:
            with heartbeat:
                outcome = self._execute(job, shard, engine(), heartbeat)
            if heartbeat.lost:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
            if outcome.cancelled:
                self._end_shard(shard, ShardStatus.CANCELLED)
                return outcome
            self._check_input(job)
            key = self._write_part(job, shard, outcome)
            self._record_shard(job, shard, outcome, key, started)
        except StaleClaim as lost:
            log.warning("%s; this worker stops it and writes nothing", lost)
            return ShardOutcome(lost=True)
        except InputChanged as changed:  # not the shard's fault, nor a retry's cure: the job fails with why
            self._end_shard(shard, ShardStatus.FAILED, str(changed))
            self.fail(str(changed))
            log.error("job %s: %s", job.id, changed)
            return ShardOutcome(cancelled=True)
        except Exception as error:
            self._end_shard(shard, ShardStatus.FAILED, f"{type(error).__name__}: {error}")
            raise
        finally:
            RUNNING_HERE.discard(shard.id)
        return outcome

    def _write_part(self, job: Job, shard: Shard, outcome: ShardOutcome) -> str:
        """The part under this claim's own key, once the claim is checked to be still ours."""
        with self.sessions() as session:
            if session.scalar(select(Shard.claim_token).where(Shard.id == shard.id)) != shard.claim_token:
                raise StaleClaim(f"job {job.id}: shard {shard.index} was claimed by another worker")
        return write_part(open_store(job.output_uri, job.settings.s3), shard.index, outcome.records,
                          shard.claim_token)

    def _record_shard(self, job: Job, shard: Shard, outcome: ShardOutcome, key: str, started: float) -> None:
        outcome.completed_job = self._complete_shard(shard, outcome, key)
        log.info("job %s: shard %d (rows %d-%d) completed in %.1f s: %d ok, %d failed", job.id, shard.index,
                 shard.row_start, shard.row_end - 1, time.perf_counter() - started,
                 outcome.totals()["rows_completed"], len(outcome.errors))

    def _execute(self, job: Job, shard: Shard, engine: LLMEngine, heartbeat: LeaseHeartbeat) -> ShardOutcome:
        engine.set_speculative_config(job.settings.speculative_config)
        watch = StatusWatch(self.sessions, job.id, heartbeat)
        execution = ShardsExecution.for_job(engine, job, should_stop=watch.should_stop,
                                            on_progress=self.progress.advance)
        rows = self._reader_for(job).read(shard.row_start, shard.row_end)
        return ShardExecution(execution, f"{job.id[:8]}-{shard.index}-").run(rows)

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
            return _settle(job) == S.FINALIZING

    def _end_shard(self, shard: Shard, status: ShardStatus, error: str | None = None) -> None:
        """A shard that stopped without completing: cancelled, or failed with its error (redone on a retry)."""
        with self.sessions.begin() as session:
            job = self._job(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token:
                log.warning("job %s: shard %d was claimed by another worker; not marking it %s", job.id,
                            shard.index, status)
                return
            row.status, row.error, row.lease_expires_at, row.finished_at = status.value, error, None, utcnow()
            _settle(job)

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
                mark_cancelled(job)
            log.info("job %s cancelled; %d completed shard(s) kept", job.id,
                     sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED))
            return job

    # -- finalizing ---------------------------------------------------------------------------------

    def finalize(self) -> Job:
        """finalizing -> completed: the error file, the optional batch output, then the manifest. Running it
        twice writes the same files; a job that is not `finalizing` is left as it is."""
        job = self.load()
        if job.status != S.FINALIZING:
            return job
        self.progress.phase("writing errors and manifest")
        with self.sessions() as session:
            shards = repo.shards(session, job.id)
        store = open_store(job.output_uri, job.settings.s3)
        finished_at = utcnow()
        finalize_outputs(self.sessions, job, shards, store, finished_at)
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status == S.FINALIZING and self._step_is_ours(job):
                transition(job, S.COMPLETED, at=finished_at)
            return job


def _settle(job: Job) -> JobStatus | None:
    """After a shard changed (job row locked): the last completed shard moves the job to `finalizing`; a
    cancel request whose last running shard stopped ends `cancelled`. Returns the new status, if any."""
    if job.status == S.IN_PROGRESS and job.shards and all(s.status == ShardStatus.COMPLETED for s in job.shards):
        transition(job, S.FINALIZING)
        return S.FINALIZING
    if job.status == S.CANCELLING and not any(s.status == ShardStatus.RUNNING for s in job.shards):
        mark_cancelled(job)
        return S.CANCELLED
    return None


def give_up(job: Job, shard: Shard) -> None:
    """The shard used all its attempts: it fails, and the job with it (job row locked)."""
    cause = shard.error or f"its worker ({shard.worker}) died while running it"
    message = (f"shard {shard.index} (rows {shard.row_start}-{shard.row_end - 1}) failed {shard.attempts} "
               f"attempt(s), the limit; last: {cause}")
    shard.status, shard.error, shard.lease_expires_at, shard.finished_at = (
        ShardStatus.FAILED.value, message, None, utcnow())
    log.error("job %s: %s", job.id, message)
    if not is_terminal(job.status):
        transition(job, S.FAILED, error=message)


class JobRunner(JobSteps):
    """Takes one job as far as it goes in this process: claim it, validate, run the unfinished shards
    through one engine stream (several in flight), finalize."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, engine_provider: EngineProvider,
                 progress: Progress) -> None:
        super().__init__(sessions, job_id, progress)
        self.engine_provider = engine_provider
        self._engine: LLMEngine | None = None

    def run(self) -> Job:
        job = self._claim()
        try:
            steps = {S.VALIDATING: self.validate, S.QUEUED: lambda: self.set_status(S.IN_PROGRESS),
                     S.IN_PROGRESS: self._run_shards, S.CANCELLING: self.finish_cancel, S.FINALIZING: self.finalize}
            while (step := steps.get(JobStatus(job.status))) is not None:
                job = step()
            return job
        except (InputError, InputChanged) as error:  # e.g. a corrupt row group found mid-job, a replaced input
            return self.set_status(S.FAILED, error=str(error))
        except Exception as error:
            self.set_status(S.FAILED, error=f"{type(error).__name__}: {error}")
            raise
        finally:
            self.release()

    def _claim(self) -> Job:
        with self.sessions.begin() as session:
            job = self._job(session)
            if is_terminal(job.status):
                return job
            if job.worker not in (None, self.worker) and runner_alive(job):
                raise JobBusy(f"job {job.id} is being run by {job.worker}")
            job.worker, job.attempts = self.worker, job.attempts + 1
            reset = repo.reset_unfinished_shards(session, job.id)
            done = sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED)
            if job.attempts > 1:
                log.info("job %s: resuming (attempt %d, status %s): %d of %d shards already completed, "
                         "%d interrupted shard(s) will be redone", job.id, job.attempts, job.status, done,
                         len(job.shards), reset)
            return job

    def _run_shards(self) -> Job:
        with self.sessions() as session:
            job = self._job(session, lock=False)
            shards = repo.shards(session, job.id)
        todo = [s for s in shards if s.status != ShardStatus.COMPLETED]
        if todo and self._engine is None:
            self.progress.phase(f"loading {job.model}")
            self._engine = self.engine_provider(job.settings.engine)
        self.progress.phase("generating")
        self.progress.start(job.requests_total,
                            sum(s.rows_completed + s.rows_failed for s in shards if s not in todo))
        if todo:
            self._stream_shards(job, todo, self._engine)
        job = self.load()
        return self.set_status(S.FINALIZING) if job.status == S.IN_PROGRESS else job

    def _stream_shards(self, job: Job, todo: list[Shard], engine: LLMEngine) -> None:
        """All unfinished shards through one engine stream: the next shard's rows are admitted while the
        current one's tail decodes. Each shard is marked running when its first row is fed, and its part is
        written and the shard completed as soon as its last row finishes; a stop request or an error ends the
        shards still in flight cancelled or failed (a resume redoes them)."""
        engine.set_speculative_config(job.settings.speculative_config)
        heartbeat = LeaseHeartbeat(self.sessions, {})
        watch = StatusWatch(self.sessions, job.id, heartbeat)
        execution = ShardsExecution.for_job(engine, job, should_stop=watch.should_stop,
                                            on_progress=self.progress.advance)
        reader = self._reader_for(job)
        started: dict[int, float] = {}

        def on_start(work: ShardWork) -> None:
            with self.sessions.begin() as session:
                row = repo.get_shard_by_id(session, work.key.id, for_update=True)
                repo.start_shard(row, self.worker, utcnow() + LEASE)
            work.key.claim_token = row.claim_token
            heartbeat.add(work.key.id, row.claim_token)
            started[work.key.id] = time.perf_counter()

        def on_done(work: ShardWork) -> None:
            shard = work.key
            heartbeat.discard(shard.id)
            self._check_input(job)
            self._record_shard(job, shard, work.outcome, self._write_part(job, shard, work.outcome),
                               started[shard.id])

        works = (ShardWork(s, reader.read(s.row_start, s.row_end), f"{job.id[:8]}-{s.index}-") for s in todo)
        try:
            with heartbeat:
                cancelled = execution.run(works, on_start, on_done)
        except Exception as error:
            for work in execution.in_flight:
                self._end_shard(work.key, ShardStatus.FAILED, f"{type(error).__name__}: {error}")
            raise
        if cancelled:
            for work in execution.in_flight:
                self._end_shard(work.key, ShardStatus.CANCELLED)


class LeaseHeartbeat:
    """Renews the leases of the shards it holds ({shard id: claim token}) on its own thread, every quarter
    lease, whatever the engine is doing (a long step, a rescan of the input). A renewal that finds the claim
    gone (another claim bumped the token) sets `lost`: the shard must stop and write nothing."""

    def __init__(self, sessions: sessionmaker[Session], claims: dict[int, int], every_s: float | None = None) -> None:
        self.sessions, self.claims = sessions, dict(claims)
        self.every_s = every_s if every_s is not None else LEASE.total_seconds() / 4
        self.lost = False
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, shard_id: int, token: int) -> None:
        with self._lock:
            self.claims[shard_id] = token

    def discard(self, shard_id: int) -> None:
        with self._lock:
            self.claims.pop(shard_id, None)

    def __enter__(self) -> LeaseHeartbeat:
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.beat()

    def beat(self) -> None:
        with self._lock:
            claims = dict(self.claims)
        try:
            with self.sessions.begin() as session:
                for shard_id, token in claims.items():
                    if not repo.renew_lease(session, shard_id, token, utcnow() + LEASE):
                        log.warning("shard id %d: its claim (token %d) was taken over; stopping it", shard_id, token)
                        self.lost = True
        except Exception as error:  # the database is down: try again next beat (the lease has 4 beats)
            log.warning("could not renew the shard leases: %s", error)


class StatusWatch:
    """Between engine steps: is the job still in progress, and does this worker still hold its shards? Asks
    the database at most once a second (the leases are renewed by a `LeaseHeartbeat`)."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, heartbeat: LeaseHeartbeat) -> None:
        self.sessions, self.job_id, self.heartbeat = sessions, job_id, heartbeat
        self.checked = float("-inf")  # the first call always asks: a shard never starts on a cancelled job

    def should_stop(self) -> bool:
        if self.heartbeat.lost:
            return True
        now = time.monotonic()
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
        return status != S.IN_PROGRESS
