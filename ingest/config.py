"""Where the service's parts are and how it behaves, read from the environment. `tokenmill stack up` writes
these variables into `stack.env`; every component (workers, beat, consumer, watcher) reads them here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ingest.job_request import MAX_JOB_REQUEST_BYTES
from ingest.policy import FrontDoorPolicy
from storage.db import resolve_url
from storage.objectstore import S3Options

DEFAULT_BROKER = "redis://127.0.0.1:6379/0"
CONTROL_QUEUE = "control"


def env_setting(name: str, default: str | None = None) -> str | None:
    """$TOKENMILL_<name>, or default when unset or empty."""
    return os.environ.get(f"TOKENMILL_{name}") or default


def _number(name: str, default: float) -> float:
    raw = env_setting(name)
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"TOKENMILL_{name} must be a number, got {raw!r}") from None


MAX_ENQUEUED_TOKENS = 2_000_000  # a tenant's prompt tokens per model in batches not yet ended


def max_enqueued_tokens() -> int:
    """$TOKENMILL_MAX_ENQUEUED_TOKENS (0: no limit), else MAX_ENQUEUED_TOKENS: the API's `--max-enqueued-tokens`."""
    limit = int(_number("MAX_ENQUEUED_TOKENS", MAX_ENQUEUED_TOKENS))
    if limit < 0:
        raise ValueError(f"TOKENMILL_MAX_ENQUEUED_TOKENS must be 0 (no limit) or more, got {limit}")
    return limit


@dataclass(frozen=True)
class ServiceConfig:
    database_url: str
    broker_url: str
    result_backend: str | None  # task states and progress; default: the broker when it is Redis
    kafka_bootstrap: str | None  # no Kafka: no job events are published
    jobs_topic: str
    events_topic: str
    consumer_group: str
    queue_prefix: str  # lets several stacks share one broker
    max_shard_attempts: int  # a shard that failed or killed its worker this often fails the job
    max_control_attempts: int  # validating or finalizing started this often without finishing fails the job
    sweep_interval_s: float
    sweep_grace_s: float  # work with no live task this long is handed out again by the sweep
    fair_share_shards: int  # each job's first shards go before other jobs' later ones (workers.tasks)
    max_spec_bytes: int  # a larger job message is rejected
    schedule_interval_s: float
    s3: S3Options
    bucket_uri: str | None  # the service's bucket: inbox/, outputs/, inline/ and uploads/ live under it
    inbox_uri: str | None  # watched for new input files; default: <bucket>/inbox
    policy: FrontDoorPolicy  # what the front doors let a spec read, write and share (ingest.policy)

    @classmethod
    def from_env(cls) -> ServiceConfig:
        broker = env_setting("BROKER_URL", DEFAULT_BROKER)
        bucket = (env_setting("BUCKET_URI") or "").rstrip("/") or None
        return cls(
            database_url=resolve_url(),
            broker_url=broker,
            result_backend=env_setting("RESULT_BACKEND", broker if broker.startswith("redis") else None),
            kafka_bootstrap=env_setting("KAFKA_BOOTSTRAP"),
            jobs_topic=env_setting("JOBS_TOPIC", "tokenmill.jobs"),
            events_topic=env_setting("EVENTS_TOPIC", "tokenmill.job-events"),
            consumer_group=env_setting("CONSUMER_GROUP", "tokenmill-ingest"),
            queue_prefix=env_setting("QUEUE_PREFIX", ""),
            max_shard_attempts=int(_number("MAX_SHARD_ATTEMPTS", 3)),
            max_control_attempts=int(_number("MAX_CONTROL_ATTEMPTS", 3)),
            sweep_interval_s=_number("SWEEP_INTERVAL_S", 30),
            sweep_grace_s=_number("SWEEP_GRACE_S", 600),
            fair_share_shards=int(_number("FAIR_SHARE_SHARDS", 4)),
            max_spec_bytes=int(_number("MAX_SPEC_BYTES", MAX_JOB_REQUEST_BYTES)),
            schedule_interval_s=_number("SCHEDULE_INTERVAL_S", 60),
            s3=S3Options(endpoint_url=env_setting("S3_ENDPOINT_URL")),
            bucket_uri=bucket,
            inbox_uri=env_setting("INBOX_URI", f"{bucket}/inbox" if bucket else None),
            policy=FrontDoorPolicy.from_env(bucket),
        )

    def in_bucket(self, folder: str) -> str | None:
        """outputs/ (of jobs that name none), inline/ (inline rows), uploads/ (files `submit` sends); files/ and
        results/ are the OpenAI API's (ingest.policy)."""
        return f"{self.bucket_uri}/{folder}" if self.bucket_uri else None

    @property
    def outputs_uri(self) -> str | None:
        """Where the jobs of `tokenmill submit` and the inbox write when they name no output."""
        return self.in_bucket("outputs")

    @property
    def inline_uri(self) -> str | None:
        return self.in_bucket("inline")

    @property
    def control_queue(self) -> str:
        return self.queue_prefix + CONTROL_QUEUE

    def model_queue(self, model: str) -> str:
        """The GPU queue of a model: workers that hold that model's engine consume it."""
        return f"{self.queue_prefix}gpu.{model_slug(model)}"


def model_slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-") or "model"
