"""`tokenmill run`: one job taken through its steps (`workers.job_steps`) in this process. The process holds
the job by a lease on the database's clock for the whole run; its shards run K at a time through the same
engine loop and the same shard step as a Celery worker's, so the next shard's rows are admitted while the
current one's tail decodes. Completed shards are skipped, interrupted ones redone."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.faults import is_transient
from storage.formats import InputError
from storage.liveness import db_now, runner_alive
from storage.models import Job, JobStatus, Shard, ShardStatus
from storage.objectstore import InputChanged
from storage.states import is_terminal
from workers.engine_loop import shards_in_flight
from workers.job_steps import JobSteps, Progress

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.jobs")

S = JobStatus
EngineProvider = Callable[[dict[str, Any]], "LLMEngine"]  # engine settings of the job -> engine
VALIDATE_TRIES = 6  # a store that times out or throttles while validating: 1, 2, 4, 8, 16 s apart
NO_ATTEMPT_LIMIT = 1 << 30  # in-process, an error fails the job at once; attempts only count


class JobBusy(RuntimeError):
    """Another live process is running this job."""


class JobRunner(JobSteps):
    """Takes one job as far as it goes in this process: claim it, validate, run the unfinished shards
    through the engine loop (several in flight), finalize."""

    def __init__(self, sessions: sessionmaker[Session], job_id: str, engine_provider: EngineProvider,
                 progress: Progress) -> None:
        super().__init__(sessions, job_id, progress)
        self.engine_provider = engine_provider
        self._engine: LLMEngine | None = None

    def run(self) -> Job:
        job = self._claim()
        try:
            with self.heartbeat:
                steps = {S.VALIDATING: self._validate_with_retries, S.QUEUED: lambda: self.set_status(S.IN_PROGRESS),
                         S.IN_PROGRESS: self._run_shards, S.CANCELLING: self.finish_cancel,
                         S.FINALIZING: self.finalize}
                while (step := steps.get(JobStatus(job.status))) is not None:
                    job = step()
                    if not self._still_ours():
                        break
            return self.load()
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
            if job.worker != self.worker and runner_alive(job, db_now(session)):
                raise JobBusy(f"job {job.id} is being run by {job.worker}")
            self._take_step(job, db_now(session))
            reset = repo.reset_unfinished_shards(session, job.id)
            done = sum(1 for s in job.shards if s.status == ShardStatus.COMPLETED)
            if job.attempts > 1:
                log.info("job %s: resuming (attempt %d, status %s): %d of %d shards already completed, "
                         "%d interrupted shard(s) will be redone", job.id, job.attempts, job.status, done,
                         len(job.shards), reset)
            return job

    def _still_ours(self) -> bool:
        with self.sessions() as session:
            job = self._job(session, lock=False)
        return is_terminal(job.status) or self._step_is_ours(job)

    def _validate_with_retries(self) -> Job:
        for attempt in range(VALIDATE_TRIES):
            try:
                return self.validate()
            except Exception as error:
                if not is_transient(error) or attempt == VALIDATE_TRIES - 1:
                    raise
                log.warning("job %s: the input's store failed while validating (%s); trying again in %d s",
                            self.job_id, error, 2 ** attempt)
                self.close()
                time.sleep(2 ** attempt)
        raise AssertionError("unreachable")

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
        """The unfinished shards, K at a time, each claimed, run in the engine loop, written and committed as
        soon as its own last row finishes. The first error stops new shards from starting and is raised once
        the shards in flight ended."""
        in_flight = shards_in_flight(engine.config.max_num_seqs, job.settings.shard_size)
        failed: list[BaseException] = []
        stop = threading.Event()

        def run_one(shard: Shard) -> None:
            if stop.is_set():
                return
            claim = self.claim_shard(shard.id, NO_ATTEMPT_LIMIT)
            if claim.decision != "run":
                return
            try:
                self.execute_shard(claim.job, claim.shard, lambda: engine)
            except BaseException as error:
                stop.set()
                failed.append(error)

        with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="shard") as pool:
            list(pool.map(run_one, todo))
        if failed:
            raise failed[0]
