"""Job events: every status change of a job is published as one JSON message on the events topic (key: the
job id). Installed on a service process's session factory when Kafka is configured (`install`); without it
nothing is published.

A transaction's events reach the broker just before it commits, so no other process can see a status, and
publish the next one, before that status's own event is on the topic: a job's events keep their order even
when each comes from a different process (the CLI's `cancelling`, then a worker's `cancelled`). The price is
an event for a change whose commit then fails, which is rare. Publishing never fails the change itself: a
broker that is down costs the events (after a wait of at most a few seconds), not the job.

    {"job_id": "...", "status": "in_progress", "previous_status": "queued", "at": "2026-12-06T10:00:00+00:00",
     "source": "kafka", "source_ref": "tokenmill.jobs/0/41", "idempotency_key": "...", "model": "...",
     "output_uri": "...", "requests": {"total": 8, "completed": 0, "failed": 0},
     "tokens": {"prompt": 0, "completion": 0, "cached": 0}, "error": null}

An OpenAI API batch's event (`"source": "api"`) has no `source_ref` and no `output_uri` (see `job_event`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from sqlalchemy import event, inspect
from sqlalchemy.orm import Session, sessionmaker

from storage.models import Job, JobSource
from storage.public_text import public_message

if TYPE_CHECKING:
    from ingest.config import ServiceConfig

log = logging.getLogger("tokenmill.events")

SEND_WAIT_MS = 5000
RECONNECT_BACKOFF_MAX_MS = 2000  # after a broker restart, back within seconds
PENDING = "tokenmill_job_events"  # session.info key: the events of the open transaction, in order
PUBLISHER = "tokenmill_event_publisher"  # session.info key: the publisher of its factory's sessions (`install`)


class EventPublisher:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self._producer = None
        self._pid = None

    def producer(self):
        if self._producer is None or self._pid != os.getpid():  # a forked worker child makes its own
            from kafka import KafkaProducer

            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap, max_block_ms=SEND_WAIT_MS,
                                           value_serializer=lambda v: json.dumps(v).encode(),
                                           key_serializer=str.encode, retries=5,
                                           reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS)
            self._pid = os.getpid()
        return self._producer

    def _drop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=0)
            except Exception:
                pass

    def publish(self, payloads: list[dict[str, Any]]) -> None:
        """Send the events and wait until the broker has them."""
        try:
            producer = self.producer()
            for payload in payloads:
                producer.send(self.topic, key=payload["job_id"], value=payload)
            producer.flush(timeout=SEND_WAIT_MS / 1000)
        except Exception as error:  # events are best effort, never fatal to the job
            self._drop()  # a fresh producer next time (the broker may have restarted)
            log.warning("could not publish the events %s: %s",
                        ", ".join(f"{p['job_id']} {p['status']}" for p in payloads), error)


def install(config: ServiceConfig, sessions: sessionmaker[Session]) -> EventPublisher | None:
    """Publish the job status changes made through `sessions` (a no-op without a Kafka broker configured). The
    publisher is the session factory's own: every session it makes carries it in its `info` (PUBLISHER), and the
    factory's listeners send through it, so no module-level publisher is kept. Installing again on the same factory
    returns the publisher it has."""
    info = sessions.kw.setdefault("info", {})
    if not config.kafka_bootstrap or PUBLISHER in info:
        return info.get(PUBLISHER)
    publisher = info[PUBLISHER] = EventPublisher(config.kafka_bootstrap, config.events_topic)
    event.listen(sessions, "after_flush", _collect)
    event.listen(sessions, "before_commit", _send)
    event.listen(sessions, "after_rollback", _discard)
    return publisher


def _collect(session: Session, _context) -> None:
    for obj in list(session.new) + list(session.dirty):
        if isinstance(obj, Job):
            history = inspect(obj).attrs.status.history
            if history.added:
                previous = history.deleted[0] if history.deleted else None
                session.info.setdefault(PENDING, []).append(job_event(obj, previous, history.added[0]))


def _send(session: Session) -> None:
    session.flush()  # commit would flush after this hook; the events of those changes go now too
    if payloads := session.info.pop(PENDING, []):
        session.info[PUBLISHER].publish(payloads)


def _discard(session: Session) -> None:
    session.info.pop(PENDING, None)


def job_event(job: Job, previous: str | None, status: str) -> dict[str, Any]:
    """The event of a status change. An OpenAI API batch's names no file and no URI (its tenant's, not the
    topic readers'): no `source_ref` (the input file's id), no `output_uri`, and its error as the API shows it.
    Every job's error is told without the service's inside (`storage.public_text`)."""
    at = getattr(job, f"{status}_at", None)
    payload = {
        "job_id": job.id, "status": status, "previous_status": previous, "at": at.isoformat() if at else None,
        "source": job.source, "source_ref": job.source_ref, "idempotency_key": job.idempotency_key,
        "model": job.model, "output_uri": job.output_uri,
        "requests": {"total": job.requests_total, "completed": job.requests_completed,
                     "failed": job.requests_failed},
        "tokens": {"prompt": job.prompt_tokens, "completion": job.completion_tokens, "cached": job.cached_tokens},
        "error": public_message(job.error, uris=True) if job.error else None,  # no exception text, no worker
    }
    if job.source == JobSource.API:
        del payload["source_ref"], payload["output_uri"]
        payload["error"] = public_message(job.error) if job.error else None
    return payload
