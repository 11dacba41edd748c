"""A job run in this process, without Celery: `run_job` takes it through its steps (`workers.job_steps`,
`workers.shard_step`) to completed, failed or cancelled; `cancel_job` stops it; `LocalExecutor` runs jobs one
after another on a background thread (the executor of `tokenmill api` when no Celery broker is configured), and
tries a job that another live process holds again once that process's lease lapsed.
Jobs are made by `ingest.intake.submit`.

The process holds the job by a lease on the database's clock for the whole run; its shards run K at a time
through the same engine service (`workers.engine_loop.EngineLoop`, which the runner starts over the engine its
provider gives and closes when the job's run ends) and the same shard step as a Celery worker's, so the next
shard's rows are admitted while the current one's tail decodes. A completed shard is never run again, an
interrupted one is redone from scratch (its part file is overwritten atomically), so every input row lands
exactly once in a part file or in the error file."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage import clock
from storage import repository as repo
from storage.claims import mark_cancelled
from storage.faults import is_transient
from storage.formats import InputError
from storage.job_settings import LOCAL
from storage.liveness import db_now, runner_alive
from storage.models import Job, JobStatus, Shard, ShardStatus
from storage.objectstore import InputChanged
from storage.states import CANCELLABLE, TERMINAL, is_terminal, transition
from workers.engine_loop import EngineLoop, shards_in_flight
from workers.job_steps import JobSteps, ValidatedInput, discard_if_ended
from workers.leases import HeldHere
from workers.progress import NoProgress, Progress
from workers.shard_step import ShardStep
from workers.sweep import expire_overdue
from workers.worker_engine import EngineFactory, load_engine

if TYPE_CHECKING:
    from engine import LLMEngine
    from engine.settings import EngineSettings

__all__ = ["JobBusy", "JobRunner", "LocalExecutor", "cancel_job", "run_job"]

log = logging.getLogger("tokenmill.jobs")

S = JobStatus
VALIDATE_TRIES = 6  # a store that times out or throttles while validating: 1, 2, 4, 8, 16 s apart
SHARD_TRIES = 3  # a shard that fails this often in one run ends with its rows as errors (`workers.shard_step`)
BUSY_RETRY_MARGIN_S = 1.0  # a busy job is tried again this long after its holder's lease lapses
EXPIRY_CHECK_S = 60.0  # how often the in-process executor looks for jobs past their deadline


class JobBusy(RuntimeError):
    """Another live process is running this job; its lease (the longest of its holder's and its running shards')
    lapses `lapses_in` from now unless renewed."""

    def __init__(self, message: str, lapses_in: timedelta = timedelta(0)) -> None:
        super().__init__(message)
        self.lapses_in = lapses_in


def run_job(sessions: sessionmaker[Session], job_id: str, engine_provider: EngineFactory,
            progress: Progress | None = None, validated: ValidatedInput | None = None,
            held: HeldHere | None = None) -> Job:
    """Take the job as far as it goes in this process: to completed, failed or cancelled. `engine_provider`
    turns the job's engine settings into the engine its shards run on. `validated`: its input, read before the
    job was made (`tokenmill run`), which its validating step takes instead of reading it again. `held`: what
    this process runs now, when the caller runs more than this job (default: this run's own)."""
    return JobRunner(sessions, job_id, engine_provider, progress or NoProgress(), validated, held).run()


def cancel_job(sessions: sessionmaker[Session], ref: str) -> Job:
    """Ask the job to stop. A live runner stops at its next engine step and ends it `cancelled`, keeping the
    finished shards; with no live runner the job is cancelled here and now."""
    with sessions.begin() as session:
        job = repo.get_job(session, repo.find_job(session, ref).id, for_update=True)  # no racing a finalizer
        if job.status in (S.CANCELLING, S.CANCELLED):
            return job
        if JobStatus(job.status) not in CANCELLABLE:
            raise ValueError(f"job {job.id} is {job.status}; only validating, queued or in_progress jobs can be "
                             f"cancelled")
        alive = runner_alive(job, db_now(session))
        if job.status == S.IN_PROGRESS or alive:
            transition(job, S.CANCELLING)
        if not alive:
            mark_cancelled(job)
    discard_if_ended(sessions, job)
    return job


class JobRunner:
    """Takes one job as far as it goes in this process: claim it, validate, run the unfinished shards
    through the engine loop (several in flight), finalize."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, engine_provider: EngineFactory,
                 progress: Progress, validated: ValidatedInput | None = None, held: HeldHere | None = None) -> None:
        self.steps = JobSteps(sessions, job_id, progress, validated, held)
        self.shard_step = ShardStep(self.steps)
        self.engine_provider = engine_provider
        self._loop: EngineLoop | None = None  # the engine service of this run, started at its first shard

    def run(self) -> Job:
        steps = self.steps
        job = self._claim()
        try:
            with steps.heartbeat:
                next_step = {S.VALIDATING: self._validate_with_retries,
                             S.QUEUED: lambda: steps.set_status(S.IN_PROGRESS), S.IN_PROGRESS: self._run_shards,
                             S.CANCELLING: steps.finish_cancel, S.FINALIZING: steps.finalize}
                while (step := next_step.get(JobStatus(job.status))) is not None:
                    job = step()
                    if not self._still_ours():
                        break
            return steps.load()
        except (InputError, InputChanged) as error:  # e.g. a corrupt row group found mid-job, a replaced input
            return steps.set_status(S.FAILED, error=str(error))
        except Exception as error:
            steps.set_status(S.FAILED, error=f"{type(error).__name__}: {error}")
            raise
        finally:
            steps.release()
            if self._loop is not None:  # its thread would keep the engine alive
                self._loop.close()
                self._loop = None

    def _claim(self) -> Job:
        steps = self.steps
        with steps.sessions.begin() as session:
            job = steps.job_row(session)
            if is_terminal(job.status):
                return job
            now = db_now(session)
            if job.worker != steps.worker and runner_alive(job, now):
                raise JobBusy(f"job {job.id} is being run by {job.worker}", _lease_left(job, now))
            steps.take_step(job, now)
            reset = repo.reset_unfinished_shards(session, job.id)
            done = sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED)
            if job.attempts > 1:
                log.info("job %s: resuming (attempt %d, status %s): %d of %d shards already completed, "
                         "%d interrupted shard(s) will be redone", job.id, job.attempts, job.status, done,
                         len(job.shards), reset)
            return job

    def _still_ours(self) -> bool:
        job = self.steps.load()
        return is_terminal(job.status) or self.steps.holds_step(job)

    def _validate_with_retries(self) -> Job:
        for attempt in range(VALIDATE_TRIES):
            try:
                return self.steps.validate()
            except Exception as error:
                if not is_transient(error) or attempt == VALIDATE_TRIES - 1:
                    raise
                log.warning("job %s: the input's store failed while validating (%s); trying again in %d s",
                            self.steps.job_id, error, 2 ** attempt)
                self.steps.close()
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

    def _run_shards(self) -> Job:
        steps = self.steps
        with steps.sessions() as session:
            job = steps.job_row(session, lock=False)
            shards = repo.shards(session, job.id)
        todo = [s for s in shards if s.status != ShardStatus.COMPLETED]
        if todo and self._loop is None:
            steps.progress.phase(f"loading {job.model}")
            self._loop = EngineLoop(self.engine_provider(job_engine_settings(job)))
        steps.progress.phase("generating")
        steps.progress.start(job.requests_total,
                             sum(s.rows_completed + s.rows_failed for s in shards if s not in todo))
        if todo:
            self._stream_shards(job, todo, self._loop)
        job = steps.load()
        return steps.set_status(S.FINALIZING) if job.status == S.IN_PROGRESS else job

    def _stream_shards(self, job: Job, todo: list[Shard], loop: EngineLoop) -> None:
        """The unfinished shards, K at a time, each claimed, run in the engine loop, written and committed as
        soon as its own last row finishes. A shard whose work fails is tried again, SHARD_TRIES times in this run,
        then its rows end as errors. Any other error (the input, a service down) stops new shards from starting and
        is raised once the shards in flight ended."""
        in_flight = shards_in_flight(loop.engine.config.max_num_seqs, job.settings.shard_size)
        failed: list[BaseException] = []
        stop = threading.Event()

        def run_one(shard: Shard) -> None:
            limit = shard.attempts + SHARD_TRIES  # the attempts of runs before this one (interrupted) do not count
            while not stop.is_set():
                claim = self.shard_step.claim_shard(shard.id, limit)
                if claim.decision not in ("run", "exhausted"):
                    return
                try:
                    self.shard_step.execute_shard(claim.job, claim.shard, lambda: loop, claim.exhausted)
                    return
                except Exception as error:
                    if not _shards_fault(error):
                        stop.set()
                        failed.append(error)
                        return
                    log.warning("job %s: shard %d failed (attempt %d of %d): %s: %s", job.id, shard.index,
                                claim.shard.attempts, limit, type(error).__name__, error)
                except BaseException as error:
                    stop.set()
                    failed.append(error)
                    return

        with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="shard") as pool:
            list(pool.map(run_one, todo))
        if failed:
            raise failed[0]


def _shards_fault(error: Exception) -> bool:
    """Did the shard's own work fail (its rows, the engine on them), so that trying it again may help and its rows
    may end as errors? Not for a bad or replaced input, nor for a service that is down."""
    return not isinstance(error, (InputError, InputChanged)) and not is_transient(error)


def _lease_left(job: Job, now: datetime) -> timedelta:
    leases = [job.lease_expires_at, *(s.lease_expires_at for s in job.shards if s.status == ShardStatus.RUNNING)]
    return max([lease - now for lease in leases if lease is not None], default=timedelta(0))


def job_engine_settings(job: Job) -> EngineSettings:
    """The job's stored engine settings, typed (ValueError naming the setting for a stored value of a wrong type)."""
    from engine.settings import EngineSettings  # here: this module loads without the engine

    return EngineSettings.from_json(job.settings.engine, f"job {job.id}'s engine settings")


class LocalExecutor:
    """Runs the jobs it is handed one after another on a background thread, with one engine (built from
    `engine_settings` on first use unless given) for all of them. Every `expiry_check_s` it ends `expired` the
    in-process jobs past their deadline, queued or running, as the Celery sweep does for the workers' jobs."""

    def __init__(self, sessions: sessionmaker[Session], engine_settings: EngineSettings | dict[str, Any],
                 engine: LLMEngine | None = None, expiry_check_s: float = EXPIRY_CHECK_S) -> None:
        self.sessions, self.engine_settings = sessions, engine_settings
        self.jobs: queue.Queue[str | None] = queue.Queue()
        self._engine = engine
        self.held = HeldHere()  # the job steps and shards its runs hold now
        self._retries: list[threading.Timer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-jobs", daemon=True)
        self._thread.start()
        clock.periodic(expiry_check_s, self.expire_overdue, self._stop, "tokenmill-job-expiry")

    def expire_overdue(self) -> list[str]:
        """End the in-process jobs past their deadline `expired` (a running one stops at its next engine step,
        keeping its completed shards); their ids."""
        try:
            with self.sessions.begin() as session:
                expired = expire_overdue(session, db_now(session), LOCAL)
            for job_id in expired:
                discard_if_ended(self.sessions, JobSteps(self.sessions, job_id).load())
            return expired
        except Exception as error:  # the database is down: the next check tries again
            log.warning("the check of in-process jobs' deadlines failed: %s", error)
            return []

    def dispatch(self, job_id: str) -> None:
        self.jobs.put(job_id)

    def resume(self, source: str) -> int:
        """Queue the live jobs of this source that run in process (after a restart); how many."""
        with self.sessions() as session:
            jobs = session.scalars(select(Job).where(Job.source == source, Job.status.not_in(list(TERMINAL)))
                                   .order_by(Job.created_at))
            live = [job.id for job in jobs if job.settings.executor == LOCAL]
        for job_id in live:
            self.dispatch(job_id)
        return len(live)

    def close(self, timeout_s: float = 30) -> None:
        self._stop.set()
        for retry in self._retries:
            retry.cancel()
        self.jobs.put(None)
        self._thread.join(timeout_s)

    def engine(self, _job_engine_settings: EngineSettings | None = None) -> LLMEngine:
        """The process's engine, loaded on first use (a job's own engine settings are refused at intake)."""
        if self._engine is None:
            self._engine = load_engine(self.engine_settings)
        return self._engine

    def _run(self) -> None:
        while (job_id := self.jobs.get()) is not None:
            try:
                job = run_job(self.sessions, job_id, self.engine, held=self.held)
                log.info("job %s %s", job_id, job.status)
            except JobBusy as busy:  # e.g. held by this API's previous process, restarted within its lease
                delay = busy.lapses_in.total_seconds() + BUSY_RETRY_MARGIN_S
                log.info("%s; trying again in %.0f s, once its lease lapsed", busy, delay)
                self._retry_later(job_id, delay)
            except Exception:
                log.exception("job %s stopped with an error", job_id)
        log.info("in-process executor stopped")

    def _retry_later(self, job_id: str, delay_s: float) -> None:
        retry = threading.Timer(delay_s, self.dispatch, (job_id,))
        retry.daemon = True
        self._retries = [*(r for r in self._retries if r.is_alive()), retry]
        retry.start()
