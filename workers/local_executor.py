"""Jobs run in this process, one after another, by a background thread with one engine loaded once: the
executor of `tokenmill api` when no Celery broker is configured (the embedded default)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage.job_settings import LOCAL
from storage.models import Job
from storage.states import TERMINAL
from workers.jobs import run_job

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.jobs")


class LocalExecutor:
    def __init__(self, sessions: sessionmaker[Session], engine_settings: dict[str, Any],
                 engine: LLMEngine | None = None) -> None:
        self.sessions, self.engine_settings = sessions, engine_settings
        self.jobs: queue.Queue[str | None] = queue.Queue()
        self._engine = engine  # loaded on first use when not given
        self._thread = threading.Thread(target=self._run, name="tokenmill-jobs", daemon=True)
        self._thread.start()

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
        self.jobs.put(None)
        self._thread.join(timeout_s)

    def engine(self, _job_engine_settings: dict[str, Any] | None = None) -> LLMEngine:
        """The process's engine, loaded on first use (a job's own engine settings are refused at intake)."""
        if self._engine is None:
            from engine import EngineConfig
            from engine.embedding_engine import create_engine

            self._engine = create_engine(EngineConfig.from_kwargs(**self.engine_settings))
        return self._engine

    def _run(self) -> None:
        while (job_id := self.jobs.get()) is not None:
            try:
                job = run_job(self.sessions, job_id, self.engine)
                log.info("job %s %s", job_id, job.status)
            except Exception:
                log.exception("job %s stopped with an error", job_id)
        log.info("in-process executor stopped")

