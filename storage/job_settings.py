"""`JobSettings`: how a job runs, typed. Built once on the way in (`ingest.job_request.JobRequest.to_job`, which
validates the parts only the engine knows: sampling, speculative decoding, engine settings), stored as JSON in
`jobs.settings`, and read by attribute (`job.settings.shard_size`) everywhere after."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_serializer
from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from storage.formats.rows import Limits
from storage.objectstore import S3Options

DEFAULT_SHARD_SIZE = 500
LOCAL, CELERY = "local", "celery"  # who runs a job: `tokenmill run` in process, or the Celery workers
MAX_SHARD_SIZE = 1_000_000  # Limits.max_rows's default: a shard is never larger than a job may be
ShardSize = Annotated[int, Field(ge=1, le=MAX_SHARD_SIZE)]  # rows per shard
DEFAULT_COMPLETION_WINDOW = "24h"
# OpenAI Batch's deadline: a number and s, m, h or d (at most 30 days)
CompletionWindow = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,6}[smhd]$", max_length=8)]
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 30 * 86400


def window_seconds(window: str) -> int:
    """'24h' -> 86400; ValueError beyond 30 days."""
    seconds = int(window[:-1]) * WINDOW_UNITS[window[-1]]
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"completion_window {window!r} is longer than 30 days")
    return seconds


class JobSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sampling: dict[str, Any] = Field(default_factory=dict)  # SamplingParams defaults; rows may override
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig settings (local jobs only)
    speculative_config: dict[str, Any] | None = None  # the job's speculative decoding (None: the engine's own)
    batch_invariant: StrictBool | None = None  # outputs independent of the batch (None: the engine's own setting)
    shard_size: ShardSize = DEFAULT_SHARD_SIZE
    limits: Limits = Field(default_factory=Limits)
    s3: S3Options = Field(default_factory=S3Options)
    openai_output: bool = False
    executor: Literal["local", "celery"] = LOCAL
    cache_salt: str | None = None  # rows share prefix-cache blocks only with rows of the same salt
    served_model_names: list[str] = Field(default_factory=list)  # aliases an OpenAI row's `model` may name
    lora_modules: dict[str, str] = Field(default_factory=dict)  # LoRA adapters a row's `model` may name: name -> URI
    completion_window: CompletionWindow = DEFAULT_COMPLETION_WINDOW  # past it the sweep ends the job `expired`
    task: Literal["generate", "embed"] = "generate"  # embed: a Parquet input's `text` column is embedded
    truncate_inputs: bool = False  # embedding inputs over the model's max_seq_length are cut (else the row fails)
    input_fingerprint: dict[str, Any] | None = None  # set when the input is validated
    inbox_pin: dict[str, Any] | None = None  # the version the inbox listed (its ETag): validation reads only it
    input_format: str | None = None

    @field_serializer("s3")
    def _s3(self, value: S3Options) -> dict[str, Any]:
        return value.to_dict()

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class JobSettingsJSON(TypeDecorator):
    """A JSON column holding a `JobSettings`."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: JobSettings | dict | None, dialect: Dialect) -> dict | None:
        if value is None:
            return None
        return (value if isinstance(value, JobSettings) else JobSettings.model_validate(value)).to_json()

    def process_result_value(self, value: dict | None, dialect: Dialect) -> JobSettings | None:
        return None if value is None else JobSettings.model_validate(value)
