"""Takes one job as far as it goes in this process: claim it, validate the input and plan shards, run
the unfinished shards in order, finalize. Completed shards are skipped, interrupted ones redone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.formats import InputError, InputReader, Limits, open_input, write_part
from storage.models import FailedRow, Job, JobStatus, Shard, ShardStatus, utcnow
from storage.objectstore import ObjectStore, S3Options, open_file_store, open_store
from storage.states import is_terminal, transition
from workers.finalize import finalize_outputs
from workers.liveness import worker_alive, worker_id
from workers.shards import ShardExecution, ShardOutcome

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.jobs")

LEASE = timedelta(minutes=2)
STATUS_POLL_SECONDS = 1.0
S = JobStatus
EngineProvider = Callable[[dict[str, Any]], "LLMEngine"]  # engine settings of the job -> engine


class JobBusy(RuntimeError):
    """Another live process is running this job."""


def runner_alive(job: Job) -> bool:
    """Is some process still running this job (its worker process, or an unexpired shard lease)?"""
    leases = [s.lease_expires_at for s in job.shards if s.status == ShardStatus.RUNNING and s.lease_expires_at]
    return worker_alive(job.worker, max(leases, default=None))


def mark_cancelled(job: Job) -> None:
    """End the job `cancelled`; shards caught running are marked cancelled, completed ones are kept."""
    for shard in job.shards:
        if shard.status == ShardStatus.RUNNING:
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


class JobRunner:
    def __init__(self, sessions: sessionmaker[Session], job_id: str, engine_provider: EngineProvider,
                 progress: Progress) -> None:
        self.sessions, self.job_id = sessions, job_id
        self.engine_provider, self.progress = engine_provider, progress
        self.worker = worker_id()
        self._reader: InputReader | None = None
        self._engine: LLMEngine | None = None

    def run(self) -> Job:
        job = self._claim()
        try:
            steps = {S.VALIDATING: self._validate, S.QUEUED: lambda: self._set_status(S.IN_PROGRESS),
                     S.IN_PROGRESS: self._run_shards, S.CANCELLING: self._finish_cancel, S.FINALIZING: self._finalize}
            while (step := steps.get(JobStatus(job.status))) is not None:
                job = step()
            return job
        except InputError as error:  # e.g. a corrupt row group found mid-job
            return self._set_status(S.FAILED, error=str(error))
        except Exception as error:
            self._set_status(S.FAILED, error=f"{type(error).__name__}: {error}")
            raise
        finally:
            self._release()

    # -- state ------------------------------------------------------------------------------------

    def _job(self, session: Session, lock: bool = True) -> Job:
        return repo.get_job(session, self.job_id, for_update=lock)

    def _set_status(self, status: JobStatus, error: str | None = None) -> Job:
        """Transition, unless a cancel request came first (then only cancelled or failed may follow)."""
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status == S.CANCELLING and status not in (S.CANCELLED, S.FAILED):
                return job
            if job.status != status:
                transition(job, status, error=error)
            return job

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

    def _release(self) -> None:
        if self._reader is not None:
            self._reader.close()
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.worker == self.worker:
                job.worker = None

    # -- validating ---------------------------------------------------------------------------------

    def _reader_for(self, job: Job) -> InputReader:
        if self._reader is None:
            self._reader = open_input(*self._input_location(job), Limits.from_dict(job.settings.get("limits")))
        return self._reader

    def _input_location(self, job: Job) -> tuple[ObjectStore, str]:
        return open_file_store(job.input_uri, S3Options.from_dict(job.settings.get("s3")))

    def _validate(self) -> Job:
        self.progress.phase("validating input")
        with self.sessions() as session:
            job = self._job(session, lock=False)
            started = any(s.attempts for s in job.shards)
        try:
            reader = self._reader_for(job)
            reader.validate()
            store, key = self._input_location(job)
            fingerprint = store.fingerprint(key)
            if not started:
                self._check_output_empty(job)
        except InputError as error:
            log.warning("job %s failed validation: %s", job.id, error)
            return self._set_status(S.FAILED, error=str(error))
        return self._plan(reader.num_rows, reader.format, fingerprint, started)

    def _check_output_empty(self, job: Job) -> None:
        existing = open_store(job.output_uri, S3Options.from_dict(job.settings.get("s3"))).list()
        if existing:
            raise InputError(f"output {job.output_uri} already holds {len(existing)} file(s) (e.g. {existing[0]}) "
                             f"from another job; choose an empty --output")

    def _plan(self, num_rows: int, input_format: str, fingerprint: dict, started: bool) -> Job:
        with self.sessions.begin() as session:
            job = self._job(session)
            if job.status == S.CANCELLING:
                mark_cancelled(job)
                return job
            if started and job.settings.get("input_fingerprint") != fingerprint:
                transition(job, S.FAILED, error=f"input {job.input_uri} changed since this job started; "
                                                "write to a new --output to run it as a new job")
                return job
            if not started:
                session.execute(delete(Shard).where(Shard.job_id == job.id))
                session.execute(delete(FailedRow).where(FailedRow.job_id == job.id))
                size = job.settings["shard_size"]
                repo.add_shards(session, job, ((s, min(s + size, num_rows)) for s in range(0, num_rows, size)))
            job.requests_total = num_rows
            job.settings = {**job.settings, "input_fingerprint": fingerprint, "input_format": input_format}
            transition(job, S.QUEUED)
            log.info("job %s: %d rows of %s in %d shard(s)", job.id, num_rows, input_format,
                     -(-num_rows // job.settings["shard_size"]))
            return job

    # -- in progress --------------------------------------------------------------------------------

    def _run_shards(self) -> Job:
        with self.sessions() as session:
            job = self._job(session, lock=False)
            shards = repo.shards(session, job.id)
        todo = [s for s in shards if s.status != ShardStatus.COMPLETED]
        if todo and self._engine is None:
            self.progress.phase(f"loading {job.model}")
            self._engine = self.engine_provider(job.settings.get("engine", {}))
        self.progress.phase("generating")
        self.progress.start(job.requests_total,
                            sum(s.rows_completed + s.rows_failed for s in shards if s not in todo))
        for shard in todo:
            if self._run_shard(job, shard).cancelled:
                break
        with self.sessions() as session:
            if self._job(session, lock=False).status != S.IN_PROGRESS:
                return self._job(session, lock=False)
        return self._set_status(S.FINALIZING)

    def _run_shard(self, job: Job, shard: Shard) -> ShardOutcome:
        with self.sessions.begin() as session:
            row = repo.get_shard(session, job.id, shard.index)
            repo.start_shard(row, self.worker, utcnow() + LEASE)
        started = time.perf_counter()
        try:
            outcome = self._execute(job, shard, row.id)
            if outcome.cancelled:
                self._end_shard(job.id, shard.index, ShardStatus.CANCELLED)
                return outcome
            store = open_store(job.output_uri, S3Options.from_dict(job.settings.get("s3")))
            key = write_part(store, shard.index, outcome.records)
        except Exception as error:
            self._end_shard(job.id, shard.index, ShardStatus.FAILED, f"{type(error).__name__}: {error}")
            raise
        with self.sessions.begin() as session:
            row = repo.get_shard(session, job.id, shard.index)
            errors = [FailedRow(job_id=job.id, shard=shard.index, row_index=e.row, custom_id=e.custom_id,
                                code=e.code, message=e.message) for e in outcome.errors]
            repo.complete_shard(session, row, outcome.totals(), key, errors)
        log.info("job %s: shard %d (rows %d-%d) completed in %.1f s: %d ok, %d failed", job.id, shard.index,
                 shard.row_start, shard.row_end - 1, time.perf_counter() - started, len(outcome.records),
                 len(outcome.errors))
        return outcome

    def _execute(self, job: Job, shard: Shard, shard_id: int) -> ShardOutcome:
        watch = StatusWatch(self.sessions, job.id, shard_id)
        execution = ShardExecution(self._engine, job.settings.get("sampling", {}), f"{job.id[:8]}-{shard.index}-",
                                   should_stop=watch.should_stop, on_progress=self.progress.advance)
        return execution.run(self._reader_for(job).read(shard.row_start, shard.row_end))

    def _end_shard(self, job_id: str, index: int, status: ShardStatus, error: str | None = None) -> None:
        """A shard that stopped without completing: cancelled, or failed with its error (redone on a retry)."""
        with self.sessions.begin() as session:
            row = repo.get_shard(session, job_id, index)
            row.status, row.error, row.lease_expires_at, row.finished_at = status.value, error, None, utcnow()

    def _finish_cancel(self) -> Job:
        with self.sessions.begin() as session:
            job = self._job(session)
            mark_cancelled(job)
            log.info("job %s cancelled; %d completed shard(s) kept", job.id,
                     sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED))
            return job

    # -- finalizing ---------------------------------------------------------------------------------

    def _finalize(self) -> Job:
        self.progress.phase("writing errors and manifest")
        with self.sessions() as session:
            job = self._job(session, lock=False)
            shards = repo.shards(session, job.id)
        store = open_store(job.output_uri, S3Options.from_dict(job.settings.get("s3")))
        finished_at = utcnow()
        finalize_outputs(self.sessions, job, shards, store, finished_at)
        with self.sessions.begin() as session:
            job = self._job(session)
            transition(job, S.COMPLETED, at=finished_at)
            return job


class StatusWatch:
    """Between engine steps: is the job still in progress? Asks the database at most once a second and
    renews the shard's lease while it runs."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, shard_id: int) -> None:
        self.sessions, self.job_id, self.shard_id = sessions, job_id, shard_id
        self.checked = float("-inf")  # the first call always asks: a shard never starts on a cancelled job
        self.renewed = time.monotonic()

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now - self.checked < STATUS_POLL_SECONDS:
            return False
        self.checked = now
        renew = now - self.renewed > LEASE.total_seconds() / 4
        with self.sessions.begin() as session:
            status = repo.job_status(session, self.job_id)
            if renew:
                session.get(Shard, self.shard_id).lease_expires_at = utcnow() + LEASE
                self.renewed = now
        return status != S.IN_PROGRESS
