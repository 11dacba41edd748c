"""The job spec that arrives on the job topic, in an S3 sidecar (`NAME.job.json`) or from `tokenmill submit`:

    {"input_uri": "s3://bucket/in/prompts.parquet",   # or "rows": [{"custom_id": "a", "prompt": "..."}, ...]
     "output_uri": "s3://bucket/out/run-1",
     "model": "smollm2-135m", "sampling": {"max_tokens": 64, "temperature": 0},
     "shard_size": 500, "priority": 0, "openai_output": false,
     "idempotency_key": "...", "job_id": "<uuid>",                  # both optional
     "completion_window": "24h",                                      # the deadline (s, m, h or d; <= 30 days)
     "served_model_names": ["gpt-4o-mini"],                           # aliases an OpenAI row's model may name
     "lora_modules": {"sql": "s3://bucket/adapters/sql"},             # LoRA adapters a row's model may name
     "batch_invariant": true,                                         # outputs independent of the batch (slower)
     "task": "embed", "truncate_inputs": false}                       # embedding jobs (see below)

`task` is `generate` (the default) or `embed`: an embedding model's job, whose Parquet input has a `text` column
(OpenAI JSONL rows say `/v1/embeddings` themselves); `truncate_inputs` cuts inputs longer than the model's
max_seq_length instead of failing their rows.

`lora_modules` names LoRA adapters (PEFT directories; for the service, s3:// prefixes): a row whose `model` (an
OpenAI body's, or a Parquet `model` column) names one runs with it (docs/lora.md).

Only `output_uri` and one of `input_uri` / `rows` are required (the S3 inbox supplies both). Unknown fields
are refused, so a typo does not silently run with defaults.

A job exists in three forms: this JSON, the `JobRequest` that validates it (once, here; `tokenmill run` builds
one too), and the `storage.job_settings.JobSettings` stored on the job row. `JobRequest.to_job` wraps the
settings with where the job reads and writes and who sent it (`NewJob`), which `ingest.intake.submit` creates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from engine.config import DEFAULT_MODEL
from engine.settings import EngineSettings
from engine.spec_decode.config import SpeculativeConfig
from ingest.row_checks import MODEL_NAME, model_name_problem
from ingest.sampling import sampling_params
from storage.formats import Limits
from storage.job_settings import (
    CELERY,
    DEFAULT_COMPLETION_WINDOW,
    DEFAULT_SHARD_SIZE,
    CompletionWindow,
    JobSettings,
    ShardSize,
    window_seconds,
)
from storage.models import JobSource
from storage.objectstore import S3Options, check_output_uri, normalize_uri

MAX_INLINE_ROWS = 10_000
MAX_JOB_REQUEST_BYTES = 1 << 20  # default of TOKENMILL_MAX_SPEC_BYTES (a message or a sidecar)
MAX_DEPTH = 32  # nesting of arrays and objects in a spec
PRIORITY_BOUND = 2**31  # priorities are 32-bit in the database
MAX_CACHE_SALT = 256
MAX_LORA_MODULES = 64  # adapters one job may name
# bounds of the speculative settings a job may set (the engine checks the rest)
SPECULATIVE_BOUNDS = {"prompt_lookup_max": (1, 64), "prompt_lookup_min": (1, 64), "max_verify_tokens": (1, 1024),
                      "probe_every": (1, 1_000_000), "draft_layers": (1, 1024)}


class JobRequestError(ValueError):
    """A message or sidecar that is not a valid job spec; the message says which field and why."""


@dataclass
class NewJob:
    """A validated job ready to be created: where it reads and writes, who sent it, and its settings."""

    input_uri: str
    output_uri: str
    model: str
    settings: JobSettings
    source: str = JobSource.CLI.value
    source_ref: str | None = None
    priority: int = 0
    idempotency_key: str | None = None  # default: derived from the input and output URIs
    job_id: str | None = None  # default: a new UUID


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_uri: str | None = None
    rows: list[dict[str, Any]] | None = Field(default=None, min_length=1, max_length=MAX_INLINE_ROWS)
    output_uri: str | None = None
    model: str = Field(default=DEFAULT_MODEL, min_length=1, max_length=512)
    sampling: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=dict)  # only `tokenmill run` honours these (see to_job)
    speculative_config: dict[str, Any] | None = None  # {"method": "ngram", "num_speculative_tokens": 5, ...}
    # each row's output bit-identical however it is batched or sharded (None: the engine's own setting)
    batch_invariant: StrictBool | None = None
    shard_size: ShardSize = DEFAULT_SHARD_SIZE
    priority: int = Field(default=0, gt=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    openai_output: bool = False
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    job_id: uuid.UUID | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)  # see ingest.policy
    completion_window: CompletionWindow = DEFAULT_COMPLETION_WINDOW  # the job's deadline (OpenAI Batch's)
    # other names an OpenAI row's `model` may give for this job's model (vLLM's --served-model-name)
    served_model_names: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list,
                                                                                         max_length=16)
    # LoRA adapters a row's `model` may name: name -> PEFT directory or s3:// prefix (vLLM's --lora-modules)
    lora_modules: dict[str, str] = Field(default_factory=dict, max_length=MAX_LORA_MODULES)
    task: Literal["generate", "embed"] = "generate"
    truncate_inputs: bool = False

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_seconds(value)
        return value

    @field_validator("input_uri")
    @classmethod
    def _input_uri(cls, value: str | None) -> str | None:
        return None if value is None else normalize_uri(value)

    @field_validator("output_uri")
    @classmethod
    def _output_uri(cls, value: str | None) -> str | None:
        return None if value is None else check_output_uri(value)

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            sampling_params(value, {})
        except TypeError as error:  # an unknown parameter name
            raise ValueError(str(error).replace("SamplingParams.__init__()", "sampling")) from None
        return value

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: dict[str, Any]) -> dict[str, Any]:
        EngineSettings.from_json(value).config()  # ValueError naming the setting: unknown, of a wrong type, or bad
        return value

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _check_types(value, SpeculativeConfig)
            for name, (low, high) in SPECULATIVE_BOUNDS.items():
                if value.get(name) is not None and not low <= value[name] <= high:
                    raise ValueError(f"{name} must be in [{low}, {high}], got {value[name]!r}")
            if isinstance(value.get("min_acceptance"), float) and not math.isfinite(value["min_acceptance"]):
                raise ValueError(f"min_acceptance must be finite, got {value['min_acceptance']!r}")
            SpeculativeConfig.from_dict(value)  # ValueError names the bad key or value
        return value

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not MODEL_NAME.fullmatch(name):
                raise ValueError(f"adapter name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        return {name: normalize_uri(uri) for name, uri in value.items()}

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.input_uri is None) == (self.rows is None):
            raise ValueError("give exactly one of input_uri or rows")
        return self

    @model_validator(mode="after")
    def _adapter_names(self) -> JobRequest:
        if taken := sorted(set(self.lora_modules) & {self.model, *self.served_model_names}):
            raise ValueError(f"lora_modules: {', '.join(map(repr, taken))} already names the base model; an "
                             f"adapter needs a name of its own")
        if self.lora_modules and self.task == "embed":
            raise ValueError("lora_modules: LoRA adapters serve generation jobs, not embeddings")
        return self

    def named_uris(self) -> dict[str, str]:
        """Every URI the spec names, by its field: what the front doors' policy checks."""
        named = {"output_uri": self.output_uri, "input_uri": self.input_uri,
                 **{f"lora_modules.{name}": uri for name, uri in self.lora_modules.items()}}
        return {field: uri for field, uri in named.items() if uri is not None}

    def to_job(self, *, executor: str, source: str = JobSource.CLI.value, source_ref: str | None = None,
               default_key: str | None = None, limits: Limits | None = None, s3: S3Options | None = None) -> NewJob:
        """The job to create; the input must be a URI by now (inline rows stored first). The Celery workers run
        the engine they loaded, so a job for them that sets engine settings is refused, not silently run
        without them."""
        if self.input_uri is None or self.output_uri is None:
            raise JobRequestError("the job needs an input_uri and an output_uri")
        if executor == CELERY and self.engine:
            raise JobRequestError(f"engine: the service's workers run the engine they loaded (tokenmill worker "
                            f"--kv-cache-memory ...), so a job cannot set {', '.join(sorted(self.engine))}; "
                            f"a job may set speculative_config")
        if executor == CELERY:  # the workers load models by name only, never a path a spec names
            check_model_name("model", self.model)
            if (self.speculative_config or {}).get("model") is not None:
                check_model_name("speculative_config.model", self.speculative_config["model"])
            if local := sorted(name for name, uri in self.lora_modules.items() if not uri.startswith("s3://")):
                raise JobRequestError(f"lora_modules: the service's workers read adapters from object storage only; "
                                f"{', '.join(map(repr, local))} names a local path (tokenmill submit uploads "
                                f"local adapter directories)")
        settings = JobSettings(sampling=self.sampling, engine=self.engine, speculative_config=self.speculative_config,
                               batch_invariant=self.batch_invariant,
                               shard_size=self.shard_size, limits=limits or Limits.from_env(), s3=s3 or S3Options(),
                               openai_output=self.openai_output, executor=executor, cache_salt=self.cache_salt,
                               completion_window=self.completion_window,
                               served_model_names=self.served_model_names, lora_modules=self.lora_modules,
                               task=self.task, truncate_inputs=self.truncate_inputs)
        return NewJob(input_uri=self.input_uri, output_uri=self.output_uri, model=self.model, settings=settings,
                      source=source, source_ref=source_ref, priority=self.priority,
                      idempotency_key=self.idempotency_key or default_key,
                      job_id=str(self.job_id) if self.job_id else None)


def check_model_name(field: str, name: Any) -> None:
    """JobRequestError unless name is a model registered here (`ingest.row_checks.model_name_problem`)."""
    if problem := model_name_problem(field, name):
        raise JobRequestError(problem)


_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}


def _check_types(settings: dict[str, Any], config: type) -> None:
    """ValueError naming the first setting whose JSON type does not match the config dataclass's field."""
    for field in dataclasses.fields(config):
        value = settings.get(field.name)
        wanted = _SCALARS.get(str(field.type).replace(" | None", ""))
        if value is None or wanted is None:
            continue
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise ValueError(f"{field.name} must be {str(field.type).replace(' | None', '')}, "
                             f"got {type(value).__name__} {value!r}")


def parse_request(payload: bytes | str | None, max_bytes: int = MAX_JOB_REQUEST_BYTES, **defaults: Any) -> JobRequest:
    """A JobRequest from JSON text; `defaults` fill fields the document leaves out. Raises JobRequestError for
    anything that is not a valid spec: no payload, too large, not UTF-8 JSON, nested too deep, wrong types."""
    if payload is None:
        raise JobRequestError("empty message (null value)")
    if len(payload) > max_bytes:
        raise JobRequestError(f"too large: {len(payload)} bytes, the limit is {max_bytes} (TOKENMILL_MAX_SPEC_BYTES)")
    try:
        document = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise JobRequestError(f"not JSON: {error}") from None
    except RecursionError:
        raise JobRequestError(f"nested too deep (the limit is {MAX_DEPTH} levels)") from None
    if not isinstance(document, dict):
        raise JobRequestError(f"a job spec is a JSON object, got {type(document).__name__}")
    if _depth(document) > MAX_DEPTH:
        raise JobRequestError(f"nested too deep (the limit is {MAX_DEPTH} levels)")
    return validate_request({**defaults, **document})


def _depth(document: Any) -> int:
    deepest, stack = 0, [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def validate_request(fields: dict[str, Any]) -> JobRequest:
    """A JobRequest from fields; JobRequestError names each bad field."""
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as error:
        raise JobRequestError(describe(error)) from None
    except (TypeError, ValueError, OverflowError, RecursionError) as error:  # raised inside a field's check
        raise JobRequestError(f"invalid job spec: {type(error).__name__}: {error}") from None


def describe(error: ValidationError) -> str:
    """One line per problem, each naming its field: `sampling: max_tokens must be an integer >= 1, got 0`."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "spec"
        problems.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "invalid job spec: " + "; ".join(problems)
