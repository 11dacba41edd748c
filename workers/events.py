"""Job events: every status change of a job is published as one JSON message on the events topic (key: the
job id) once the transaction that made it commits. Installed by each service process when Kafka is
configured; without it nothing is published. Publishing never fails the change itself: a broker that is down
costs the events, not the job.

    {"job_id": "...", "status": "in_progress", "previous_status": "queued", "at": "2026-12-06T10:00:00+00:00",
     "source": "kafka", "source_ref": "tokenmill.jobs/0/41", "idempotency_key": "...", "model": "...",
     "output_uri": "...", "requests": {"total": 8, "completed": 0, "failed": 0},
     "tokens": {"prompt": 0, "completion": 0, "cached": 0}, "error": null}
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from typing import Any

from sqlalchemy import event, inspect
from sqlalchemy.orm import Session

from storage.models import Job

log = logging.getLogger("tokenmill.events")

PENDING = "tokenmill_job_events"  # session.info key: the events of the open transaction, in order


class EventPublisher:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self._producer = None
        self._pid = None

    def producer(self):
        if self._producer is None or self._pid != os.getpid():  # a forked worker child makes its own
            from kafka import KafkaProducer

            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap,
                                           value_serializer=lambda v: json.dumps(v).encode(),
                                           key_serializer=str.encode)
            self._pid = os.getpid()
        return self._producer

    def publish(self, payload: dict[str, Any]) -> None:
        try:
            self.producer().send(self.topic, key=payload["job_id"], value=payload)
        except Exception as error:  # noqa: BLE001 - events are best effort, never fatal to the job
            log.warning("could not publish the event of job %s (%s): %s", payload["job_id"], payload["status"],
                        error)

    def flush(self) -> None:
        if self._producer is not None and self._pid == os.getpid():
            self._producer.flush(timeout=5)


_publisher: EventPublisher | None = None


def install(bootstrap: str | None, topic: str) -> None:
    """Publish job status changes from this process (once; a no-op without a bootstrap server)."""
    global _publisher
    if not bootstrap or _publisher is not None:
        return
    _publisher = EventPublisher(bootstrap, topic)
    event.listen(Session, "after_flush", _collect)
    event.listen(Session, "after_commit", _send)
    event.listen(Session, "after_rollback", _discard)
    atexit.register(_publisher.flush)


def flush() -> None:
    if _publisher is not None:
        _publisher.flush()


def _collect(session: Session, _context) -> None:
    for obj in list(session.new) + list(session.dirty):
        if isinstance(obj, Job):
            history = inspect(obj).attrs.status.history
            if history.added:
                previous = history.deleted[0] if history.deleted else None
                session.info.setdefault(PENDING, []).append(job_event(obj, previous, history.added[0]))


def _send(session: Session) -> None:
    for payload in session.info.pop(PENDING, []):
        _publisher.publish(payload)


def _discard(session: Session) -> None:
    session.info.pop(PENDING, None)


def job_event(job: Job, previous: str | None, status: str) -> dict[str, Any]:
    at = getattr(job, f"{status}_at", None)
    return {
        "job_id": job.id, "status": status, "previous_status": previous, "at": at.isoformat() if at else None,
        "source": job.source, "source_ref": job.source_ref, "idempotency_key": job.idempotency_key,
        "model": job.model, "output_uri": job.output_uri,
        "requests": {"total": job.requests_total, "completed": job.requests_completed,
                     "failed": job.requests_failed},
        "tokens": {"prompt": job.prompt_tokens, "completion": job.completion_tokens, "cached": job.cached_tokens},
        "error": job.error,
    }
