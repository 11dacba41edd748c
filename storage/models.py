"""SQLAlchemy models for job state: jobs, their shards (row ranges) and the rows that failed; and for the
service around them: nightly schedules and their runs, rejected Kafka messages, objects seen in the S3 inbox,
and the OpenAI Batch API's keys, files and batches.

Alembic owns the schema (see `migrations/`); these classes are what autogenerate compares against.
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from storage import clock
from storage.job_settings import JobSettings, JobSettingsJSON

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobStatus(enum.StrEnum):
    """The OpenAI Batch lifecycle."""

    VALIDATING = "validating"
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class ShardStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobSource(enum.StrEnum):
    KAFKA = "kafka"
    S3 = "s3"
    CLI = "cli"
    SCHEDULE = "schedule"
    API = "api"  # the OpenAI Batch REST API


def utcnow() -> datetime:
    return clock.utcnow()


def _one_of(column: str, values: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive, in UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: use timezone-aware UTC times")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


class Job(Base):
    """One batch job; one timestamp column per status (`<status>_at`), set by `storage.states.transition`."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_one_of("status", JobStatus), name="status"),
        CheckConstraint(_one_of("source", JobSource), name="source"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=lambda: str(uuid.uuid4()))
    idempotency_key: Mapped[str] = mapped_column(String(255), unique=True)
    source: Mapped[str] = mapped_column(String(16), default=JobSource.CLI.value)
    source_ref: Mapped[str | None] = mapped_column(Text)  # e.g. topic/partition/offset or bucket/key@etag
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.VALIDATING.value, index=True)
    model: Mapped[str] = mapped_column(String(512))
    input_uri: Mapped[str] = mapped_column(Text)
    output_uri: Mapped[str] = mapped_column(Text)
    settings: Mapped[JobSettings] = mapped_column(JobSettingsJSON, default=JobSettings)  # sampling, shard size...
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    error: Mapped[str | None] = mapped_column(Text)
    # the normalized output prefix while the job is live (NULL once terminal): one live job per prefix
    output_claim: Mapped[str | None] = mapped_column(String(2048), unique=True, index=True)
    claim_token: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # bumped per step claim
    # the step holder's lease (database clock); with no holder, when the sweep last resent the step
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    requests_total: Mapped[int] = mapped_column(BigInteger, default=0)
    requests_completed: Mapped[int] = mapped_column(BigInteger, default=0)
    requests_failed: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    spec_draft_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # speculative decoding
    spec_accepted_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # deadline; past it the job may expire
    validating_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    queued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    shards: Mapped[list[Shard]] = relationship(back_populates="job", order_by="Shard.index",
                                               cascade="all, delete-orphan", passive_deletes=True)

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, status={self.status!r})"


class Shard(Base):
    """Rows [row_start, row_end) of a job's input, run and written as one part file."""

    __tablename__ = "shards"
    __table_args__ = (
        UniqueConstraint("job_id", "index"),
        CheckConstraint(_one_of("status", ShardStatus), name="status"),
        CheckConstraint("row_end >= row_start", name="row_range"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    row_start: Mapped[int] = mapped_column(BigInteger)
    row_end: Mapped[int] = mapped_column(BigInteger)  # exclusive
    status: Mapped[str] = mapped_column(String(16), default=ShardStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    claim_token: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # bumped per claim (fencing)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rows_completed: Mapped[int] = mapped_column(Integer, default=0)
    rows_failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    spec_draft_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # speculative decoding
    spec_accepted_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_key: Mapped[str | None] = mapped_column(String(1024))  # relative to the job's output URI
    error: Mapped[str | None] = mapped_column(Text)

    job: Mapped[Job] = relationship(back_populates="shards")

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    def __repr__(self) -> str:
        return f"Shard(job_id={self.job_id!r}, index={self.index}, status={self.status!r})"


class FailedRow(Base):
    """A row that failed on its own (bad value, prompt too long); written with its shard, exported to errors.jsonl."""

    __tablename__ = "row_errors"
    __table_args__ = (UniqueConstraint("job_id", "row_index"), Index("ix_row_errors_job_id_shard", "job_id", "shard"))

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    shard: Mapped[int] = mapped_column(Integer)
    row_index: Mapped[int] = mapped_column(BigInteger)
    custom_id: Mapped[str | None] = mapped_column(Text)  # None when the row had no usable custom_id
    code: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)


class Schedule(Base):
    """A recurring job: at each `cron` time (UTC) a job is made from the patterns, `{date}` being that day."""

    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    cron: Mapped[str] = mapped_column(String(255))
    input_pattern: Mapped[str] = mapped_column(Text)  # e.g. s3://bucket/daily/{date}/prompts.parquet
    output_pattern: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(512))
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # job settings: sampling, shard_size...
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    runs: Mapped[list[ScheduleRun]] = relationship(back_populates="schedule", cascade="all, delete-orphan",
                                                   passive_deletes=True)


class ScheduleRun(Base):
    """The job a schedule made for one date; unique per (schedule, date), however often beat fires."""

    __tablename__ = "schedule_runs"
    __table_args__ = (UniqueConstraint("schedule_id", "run_date"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    run_date: Mapped[date] = mapped_column(Date)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    fired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    schedule: Mapped[Schedule] = relationship(back_populates="runs")


class RejectedMessage(Base):
    """A job-topic message that was not JSON or not a valid job spec, kept with where it came from."""

    __tablename__ = "rejected_messages"
    __table_args__ = (UniqueConstraint("topic", "partition", "offset"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(255))
    partition: Mapped[int] = mapped_column(Integer)
    offset: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[str] = mapped_column(Text)  # UTF-8 with replacement characters, truncated
    error: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class InboxObject(Base):
    """An object seen under the S3 inbox: the job it became, or why it could not become one."""

    __tablename__ = "inbox_objects"
    __table_args__ = (UniqueConstraint("bucket", "key", "etag"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    bucket: Mapped[str] = mapped_column(String(255))
    key: Mapped[str] = mapped_column(String(1024))
    etag: Mapped[str] = mapped_column(String(255))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    error: Mapped[str | None] = mapped_column(Text)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ServiceMarker(Base):
    """A named value the service keeps, e.g. the broker marker (`workers.broker_marker`)."""

    __tablename__ = "service_markers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[str] = mapped_column(String(255))


class ApiKey(Base):
    """A bearer token of the OpenAI Batch API, stored as its SHA-256 only, and the tenant it acts for."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str | None] = mapped_column(String(255))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))  # the token's first characters, to tell keys apart
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ApiFile(Base):
    """A file of the API: an uploaded batch input (its object in the bucket), or a batch's output or error file
    (`batch_output` / `batch_error`: the lines of the job's batch_output.jsonl with or without an error)."""

    __tablename__ = "api_files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), index=True)
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    kind: Mapped[str] = mapped_column(String(16), default="upload")  # upload | batch_output | batch_error
    filename: Mapped[str] = mapped_column(String(1024))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)  # then the cleanup deletes it
    lines: Mapped[int | None] = mapped_column(Integer)  # a batch's output or error file: its lines
    # None while an upload is written: its bytes are reserved, it is not served (migration 0008)
    ready_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ApiBatch(Base):
    """A job made through the API: who owns it and what its batch object carries beyond the job row. OpenAI's
    batches have their endpoint; Anthropic's message batches have `/v1/messages`."""

    __tablename__ = "api_batches"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    input_file_id: Mapped[str] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    output_expires_after: Mapped[int | None] = mapped_column(Integer)  # seconds its result files live
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # lines refused at creation
    # the error lines of its ended results by code ({"batch_cancelled": 3, ...}), counted when they were written
    error_codes: Mapped[dict[str, int] | None] = mapped_column(JSON)
    # its prompt tokens as estimated at creation: counted against the tenant's queue until its job ends
    enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)

    job: Mapped[Job] = relationship()
