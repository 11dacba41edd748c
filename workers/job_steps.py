"""The job-level steps of one job, each in its own transactions: claim a step, validate the input and plan
shards, finalize, finish a cancel. The Celery tasks (`workers.tasks`) run them as separate tasks on many
workers; `tokenmill run` (`workers.inprocess`) takes one job through them in one process. A job's shards are
claimed, run and committed by `workers.shard_step`.

Every step is a claim: a lease on the database's clock, renewed by a `LeaseHeartbeat` from claim to commit, and
a fencing token that each of the step's writes is conditional on. A job that ends without completing keeps only
its committed parts."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from storage import claims
from storage import repository as repo
from storage.faults import crash_point
from storage.formats import InputError, InputReader, Limits, open_input, write_manifest
from storage.liveness import LEASE, db_now, holder_alive, worker_id
from storage.models import FailedRow, Job, JobStatus, Shard, ShardStatus, utcnow
from storage.objectstore import InputChanged, ObjectStore, open_file_store, open_store
from storage.states import TERMINAL, transition
from workers.finalize import delete_uncommitted_parts, discard_outputs, finalize_outputs, remove_stray_parts
from workers.leases import HeldHere, LeaseHeartbeat, job_claim
from workers.progress import NoProgress, Progress

log = logging.getLogger("tokenmill.jobs")

S = JobStatus


@dataclass(eq=False)
class ValidatedInput:
    """An input read through once: its reader (indexed and checked, or `error` saying why it is not valid) and the
    pin of the version it read. `tokenmill run` reads its input so before the job is made (it picks the model from
    the rows) and hands it to the job's validating step, which then reads nothing again."""

    uri: str
    limits: Limits
    reader: InputReader | None
    fingerprint: dict[str, Any] | None = None
    error: Exception | None = None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def validate_input(store: ObjectStore, key: str, open_reader: Callable[[], InputReader]
                   ) -> tuple[InputReader, dict[str, Any]]:
    """The input's reader, validated in one read (a JSONL file is hashed on the way), and the pin of the version it
    read; FileNotFoundError when there is none, `InputChanged` when it was replaced meanwhile."""
    before = store.fingerprint(key)
    reader = open_reader()
    reader.validate()
    fingerprint = store.pin(key, reader.sha256)  # a Parquet file on a local disk is hashed here
    store.check_pin(key, before)  # not replaced while it was read
    return reader, fingerprint


def read_input(uri: str, s3, limits: Limits, task: str = "generate") -> ValidatedInput:
    """The input at `uri` validated in one read (`validate_input`); its errors are kept for the job to fail with."""
    readers: list[InputReader] = []

    def open_reader() -> InputReader:
        readers.append(open_input(store, key, limits, task=task))
        return readers[0]

    store, key = open_file_store(uri, s3)
    try:
        return ValidatedInput(uri, limits, *validate_input(store, key, open_reader))
    except (FileNotFoundError, InputError, InputChanged) as error:
        return ValidatedInput(uri, limits, readers[0] if readers else None, error=error)


def discard_if_ended(sessions: sessionmaker[Session], job: Job) -> None:
    """After a commit: a job that ended without completing keeps only its committed parts. `job` is the ended
    row as committed; the cleanup runs under the row's lock, and only while that ending stands (a retry since
    moved the token on: its parts are not this cleanup's)."""
    if job.status not in TERMINAL or job.status == S.COMPLETED or not job.output_uri:
        return
    try:
        with sessions.begin() as session:
            current = repo.get_job(session, job.id, for_update=True)
            if (current.status, current.claim_token) != (job.status, job.claim_token):
                log.info("job %s: no longer %s (token %s); its old cleanup does nothing", job.id, job.status,
                         job.claim_token)
                return
            discard_outputs(open_store(job.output_uri, job.settings.s3), current, repo.shards(session, job.id))
    except Exception as error:  # the store is down: the next step or retry of the job cleans up
        log.warning("job %s: could not remove its uncommitted outputs: %s", job.id, error)


class JobSteps:
    """The steps of one job. Each opens its own transactions and locks the job row before it changes it. `held`:
    what this process runs now, shared by the steps of the process's owner (default: these steps' own)."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, progress: Progress | None = None,
                 validated: ValidatedInput | None = None, held: HeldHere | None = None) -> None:
        self.sessions, self.job_id = sessions, job_id
        self.held = held if held is not None else HeldHere()
        self.progress = progress or NoProgress()
        self.worker = worker_id()
        self.step_token: int | None = None  # the job's claim token while this holds its step (claim_step)
        self.heartbeat = LeaseHeartbeat(sessions)
        self._reader: InputReader | None = None
        self._reader_lock = threading.Lock()
        self._validated = validated  # the input read before the job was made (`tokenmill run`), for `validate`

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._validated is not None:
            self._validated.close()
            self._validated = None

    # -- state --------------------------------------------------------------------------------------

    def job_row(self, session: Session, lock: bool = True) -> Job:
        """The job in `session`, its row locked (for update) unless `lock` is False."""
        return repo.get_job(session, self.job_id, for_update=lock)

    def load(self) -> Job:
        with self.sessions() as session:
            return self.job_row(session, lock=False)

    def set_status(self, status: JobStatus, error: str | None = None) -> Job:
        """Transition, unless a cancel request came first (then only cancelled or failed may follow)."""
        with self.sessions.begin() as session:
            job = self.job_row(session)
            if not self.holds_step(job):  # fenced: another holder's step (or a cancel) decides now
                return job
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
        """End the job `failed` with error, unless it already ended or this step was fenced; its uncommitted
        outputs are removed."""
        with self.sessions.begin() as session:
            job = self.job_row(session)
            if not self.holds_step(job):
                return job
            claims.fail(job, error)
        discard_if_ended(self.sessions, job)
        return job

    def claim_step(self, status: JobStatus, max_attempts: int | None = None) -> bool:
        """Hold the job for one step (validating, finalizing) unless it is past that step or another live
        process holds it. Each claim bumps the job's token (the step's writes are conditional on it), takes a
        lease that `heartbeat` renews, and counts an attempt: a step started `max_attempts` times without
        finishing (its worker died each time) fails the job. `release` lets go."""
        with self.sessions.begin() as session:
            job, now = self.job_row(session), db_now(session)
            if job.status != status or self.held_by_another(job.worker, job.lease_expires_at, self.held.job(job.id),
                                                             now):
                return False
            if max_attempts is not None and job.attempts >= max_attempts:
                claims.fail(job, f"{status} was started {job.attempts} time(s) without finishing "
                                 f"(the limit; its worker died or it kept failing)")
                log.error("job %s: %s", job.id, job.error)
                ended = job
            else:
                self.take_step(job, now)
                ended = None
        if ended is not None:
            discard_if_ended(self.sessions, ended)
            return False
        return True

    def held_by_another(self, worker: str | None, lease_expires_at, running_here: bool, now) -> bool:
        """Is a claim held elsewhere? This process's own holds only while it still runs the work (else its end
        was never recorded); any other holder while its lease runs."""
        if worker == self.worker:
            return running_here
        return holder_alive(worker, lease_expires_at, now)

    def take_step(self, job: Job, now) -> None:
        """(job row locked) Hold the job's step from `now`: count an attempt, bump its fencing token, lease it."""
        job.worker, job.attempts = self.worker, job.attempts + 1
        repo.fence(job)
        job.lease_expires_at = now + LEASE
        self.step_token = job.claim_token
        self.held.hold(job_claim(job.id))
        self.heartbeat.add(job_claim(job.id), job.claim_token)

    def holds_step(self, job: Job) -> bool:
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
        self.held.let_go(job_claim(self.job_id))
        with self.sessions.begin() as session:
            job = self.job_row(session)
            if job.status in TERMINAL and job.worker == self.worker:  # ended (perhaps fenced by this very step)
                job.worker, job.lease_expires_at = None, None
                return
            if not self.holds_step(job):
                return
            if job.worker == self.worker:
                job.worker, job.lease_expires_at = None, None
            if finished:
                job.attempts = 0
            elif refund and job.attempts > 0:
                job.attempts -= 1

    # -- input and validating -----------------------------------------------------------------------

    def _reader_for(self, job: Job) -> InputReader:
        """The job's input; once validated, the pinned version only (else `InputChanged`)."""
        with self._reader_lock:
            if self._reader is None:
                pin = job.settings.input_fingerprint if job.status != S.VALIDATING else job.settings.inbox_pin
                self._reader = open_input(*self._input_location(job), job.settings.limits, pin=pin,
                                          task=job.settings.task)
            return self._reader

    def read_rows(self, job: Job, shard: Shard) -> list:
        """The shard's rows of the job's input."""
        reader = self._reader_for(job)
        with self._reader_lock:  # one reader per job, shared by the shards of this process
            return list(reader.read(shard.row_start, shard.row_end))

    def check_input_unchanged(self, job: Job) -> None:
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
            job = self.job_row(session, lock=False)
            started = any(s.attempts for s in job.shards)
        try:
            if (validated := self._take_validated(job)) is not None:  # read already, before the job was made
                if validated.error is not None:
                    raise validated.error
                reader, fingerprint = validated.reader, validated.fingerprint
            else:
                store, key = self._input_location(job)  # with an inbox pin, only the version the inbox listed
                reader, fingerprint = validate_input(store, key, lambda: self._reader_for(job))
            if not started:
                self._check_output_empty(job)
        except FileNotFoundError:
            return self.set_status(S.FAILED, error=f"input {job.input_uri} does not exist")
        except (InputError, InputChanged) as error:
            log.warning("job %s failed validation: %s", job.id, error)
            return self.set_status(S.FAILED, error=str(error))
        return self._plan(reader.num_rows, reader.format, fingerprint, started)

    def _take_validated(self, job: Job) -> ValidatedInput | None:
        """The input read before the job was made, when it is this job's (its URI and limits, no inbox pin); it
        becomes the reader of the job's shards in this process."""
        validated, self._validated = self._validated, None
        if validated is None:
            return None
        if (validated.uri, validated.limits) != (job.input_uri, job.settings.limits) or job.settings.inbox_pin:
            validated.close()
            return None
        if validated.reader is not None:
            with self._reader_lock:
                if self._reader is not None:
                    self._reader.close()
                self._reader = validated.reader
        return validated

    def _check_output_empty(self, job: Job) -> None:
        existing = open_store(job.output_uri, job.settings.s3).list()
        if existing:
            raise InputError(f"output {job.output_uri} already holds {len(existing)} file(s) (e.g. {existing[0]}) "
                             f"from another job; choose an empty --output")

    def _plan(self, num_rows: int, input_format: str, fingerprint: dict, started: bool) -> Job:
        with self.sessions.begin() as session:
            job = self.job_row(session)
            if not self.holds_step(job):
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

    # -- cancelling ---------------------------------------------------------------------------------

    def finish_cancel(self) -> Job:
        with self.sessions.begin() as session:
            job = self.job_row(session)
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
            with self.sessions.begin() as session:  # checked and written under the row lock: no fence between
                job = self.job_row(session)
                completed = self._holds_finalize(job)
                if completed:
                    delete_uncommitted_parts(store, job, repo.shards(session, job.id))
                    write_manifest(store, document)
                    crash_point("during_finalize")
                    transition(job, S.COMPLETED, at=finished_at)
        if completed:
            remove_stray_parts(self.sessions, job.id)  # a lost claim's part whose own cleanup failed
            return job
        discard_if_ended(self.sessions, job)  # the job ended otherwise meanwhile: no manifest stays
        return job

    def _holds_finalize(self, job: Job) -> bool:
        return job.status == S.FINALIZING and self.holds_step(job) and self.heartbeat.holds(job_claim(job.id))
