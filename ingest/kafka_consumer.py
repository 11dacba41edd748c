"""The job topic's consumer: each message is a JSON job spec (see `ingest.job_request`).

At-least-once: a message is first recorded durably (its job created, or the message stored as rejected), and
only then is its offset committed. A message delivered again, or a duplicate of one (same content or same
idempotency key), finds its job and changes nothing. A message that is not JSON or not a valid spec is kept in
`rejected_messages` with its topic, partition, offset and the error, and the consumer goes on: so is any
message whose handling fails for a reason of its own (a null value, too large, nested too deep, a wrong type).
Only a transient error (`storage.faults.is_transient`: the database, S3 or the Celery broker down) retries the
message, from the same offset, until the service is back.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from ingest.intake import Intake, content_key
from ingest.job_request import MAX_JOB_REQUEST_BYTES, JobRequestError, NewJob, parse_request
from storage.faults import crash_point, is_transient
from storage.models import JobSource, RejectedMessage

log = logging.getLogger("tokenmill.consumer")

PAYLOAD_LIMIT = 64 << 10  # characters of a rejected message kept
RETRY_DELAY_S = 2.0
RECONNECT_BACKOFF_MAX_MS = 2000  # a restarted broker is found again within seconds


def kafka_consumer(bootstrap: str, topic: str, group: str):
    from kafka import KafkaConsumer

    # short poll interval and session: group joins and rebalances stay quick (tansu needs it too)
    return KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                         auto_offset_reset="earliest", max_poll_records=20, max_poll_interval_ms=10_000,
                         session_timeout_ms=10_000, heartbeat_interval_ms=1_000,
                         reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS)


class JobConsumer:
    def __init__(self, intake: Intake, bootstrap: str, topic: str, group: str,
                 max_bytes: int = MAX_JOB_REQUEST_BYTES) -> None:
        self.intake, self.bootstrap, self.topic, self.group = intake, bootstrap, topic, group
        self.max_bytes = max_bytes

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        consumer = kafka_consumer(self.bootstrap, self.topic, self.group)
        log.info("consuming %s on %s as group %s", self.topic, self.bootstrap, self.group)
        try:
            while not stop.is_set():
                taken = [self._take_all(consumer, records) for records in consumer.poll(timeout_ms=1000).values()]
                if not all(taken):
                    stop.wait(RETRY_DELAY_S)
        finally:
            consumer.close()

    def _take_all(self, consumer, records) -> bool:
        """Record then commit one partition's messages in order; on a failure, rewind the partition to the
        message and return False."""
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        for record in records:
            partition = TopicPartition(record.topic, record.partition)
            try:
                self.handle(record)
            except Exception:  # handle() raises only transient errors: try this message again
                log.exception("could not record %s/%d/%d; retrying", record.topic, record.partition, record.offset)
                consumer.seek(partition, record.offset)
                return False
            crash_point("after_consumer_insert")
            consumer.commit({partition: OffsetAndMetadata(record.offset + 1, "", -1)})
        return True

    def handle(self, record) -> str:
        """Record one message durably: the job's id, or 'rejected'. Raises only transient errors."""
        ref = f"{record.topic}/{record.partition}/{record.offset}"
        try:
            submission = self.intake.record(self.job_of(record))
        except JobRequestError as error:
            return self._rejected(record, ref, str(error))
        except Exception as error:
            if is_transient(error):
                raise
            log.exception("%s cannot become a job", ref)
            return self._rejected(record, ref, f"cannot become a job: {type(error).__name__}: {error}")
        log.info("%s: job %s (%s)", ref, submission.job.id, submission.outcome)
        return submission.job.id

    def job_of(self, record) -> NewJob:
        """The job a message asks for, short of the database; JobRequestError names why it cannot run."""
        request = parse_request(record.value, max_bytes=self.max_bytes)
        return self.intake.prepare(request, source=JobSource.KAFKA.value,
                                   source_ref=f"{record.topic}/{record.partition}/{record.offset}",
                                   default_key=content_key("kafka", request.model_dump_json()),
                                   tenant=f"{record.topic}/{_text(record.key or b'')[:PAYLOAD_LIMIT]}")

    def _rejected(self, record, ref: str, error: str) -> str:
        self._reject(record, error)
        log.warning("rejected %s: %s", ref, error[:500])
        return "rejected"

    def _reject(self, record, error: str) -> None:
        key = _text(record.key[:PAYLOAD_LIMIT]) if record.key else None
        payload, error = _text((record.value or b"")[:PAYLOAD_LIMIT]), _text(error[:PAYLOAD_LIMIT])
        try:
            with self.intake.sessions.begin() as session:
                if session.scalar(select(RejectedMessage.id).where(
                        RejectedMessage.topic == record.topic, RejectedMessage.partition == record.partition,
                        RejectedMessage.offset == record.offset)) is None:
                    session.add(RejectedMessage(topic=record.topic, partition=record.partition, offset=record.offset,
                                                key=key, payload=payload, error=error))
        except IntegrityError:  # stored by a consumer that had this partition before a rebalance
            pass


def _text(data: bytes | str) -> str:
    """Storable text: UTF-8 with replacement characters, no NUL (PostgreSQL text refuses it)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text.replace("\x00", "\ufffd")


def run_forever(consumer: JobConsumer) -> None:
    """Run until interrupted; a broker that is down, not up yet or restarted is waited for with a fresh
    consumer (uncommitted messages are read again: recording one is idempotent)."""
    while True:
        try:
            consumer.run()
            return
        except Exception as error:  # KafkaError, a socket error mid-commit, the database down while recording
            log.warning("Kafka at %s: %s: %s; reconnecting", consumer.bootstrap, type(error).__name__, error)
            time.sleep(RETRY_DELAY_S)
