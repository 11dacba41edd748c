"""What the service's front doors (Kafka, the S3 inbox, schedules) let a job spec do, on top of its validation:
read only under the allowed input prefixes, write only under the allowed output prefixes, and share
prefix-cache blocks only with jobs of the same tenant (models by name only: `JobRequest.to_job`).
`tokenmill run`, a user's own process, uses none of this.

    TOKENMILL_ALLOWED_INPUT_PREFIXES=s3://tokenmill,file:///srv/prompts    # default: the service's bucket
    TOKENMILL_ALLOWED_OUTPUT_PREFIXES=s3://tokenmill/outputs               # default: the service's bucket
    TOKENMILL_CACHE_ISOLATION=source | spec | job                          # default: source

A `*` in a list allows anything. Whatever the lists say, the OpenAI API's areas in its bucket (`files/`: its
uploads, `results/`: its batches' outputs) are the API's alone: no other front door's spec may name a URI in them,
or one holding them, as input, output or adapter (`check_outside_api_areas`).

Cache isolation `source`: a job's cache salt is derived from its tenant (the inbox folder, the Kafka message key,
the schedule) and the spec's own `cache_salt`, so no tenant can pick a salt that shares another's blocks; `spec`:
the spec's `cache_salt` as given (none: the shared cache); `job`: every job its own salt.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from storage.objectstore import (
    ALLOWED_INPUT_PREFIXES_ENV,
    ALLOWED_OUTPUT_PREFIXES_ENV,
    UnsafeURI,
    allowed_prefixes,
    check_allowed,
    is_under,
    normalize_uri,
)

CACHE_ISOLATION_ENV = "TOKENMILL_CACHE_ISOLATION"
ISOLATION_MODES = ("source", "spec", "job")
API_UPLOADS, API_RESULTS = "files", "results"  # the OpenAI API's folders in its bucket


def api_bucket(bucket_uri: str | None) -> str:
    """The bucket the OpenAI API keeps its files in: the service's, else the local default folder."""
    from storage.db import data_dir

    return normalize_uri(bucket_uri or str(data_dir() / "bucket"))


def api_areas_of(bucket_uri: str) -> tuple[str, ...]:
    root = normalize_uri(bucket_uri)
    return tuple(f"{root}/{folder}" for folder in (API_UPLOADS, API_RESULTS))


def _resolved(uri: str) -> str:
    """A local path with its symlinks followed (a link elsewhere must not reach into an area)."""
    normalized = normalize_uri(uri)
    if normalized.startswith("file://"):
        return "file://" + os.path.realpath(normalized[len("file://"):])
    return normalized


@dataclass(frozen=True)
class FrontDoorPolicy:
    inputs: tuple[str, ...] | None = None  # None: anywhere
    outputs: tuple[str, ...] | None = None
    cache_isolation: str = "spec"
    api_areas: tuple[str, ...] = ()  # the OpenAI API's alone, whatever the lists say

    @classmethod
    def from_env(cls, bucket_uri: str | None) -> FrontDoorPolicy:
        """The service's policy: unless the environment lists prefixes, only the service's bucket."""
        default = (bucket_uri,) if bucket_uri else ()
        isolation = os.environ.get(CACHE_ISOLATION_ENV) or "source"
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"{CACHE_ISOLATION_ENV} must be one of {', '.join(ISOLATION_MODES)}, got {isolation!r}")
        return cls(inputs=tuple(allowed_prefixes(ALLOWED_INPUT_PREFIXES_ENV) or default),
                   outputs=tuple(allowed_prefixes(ALLOWED_OUTPUT_PREFIXES_ENV) or default),
                   cache_isolation=isolation, api_areas=api_areas_of(api_bucket(bucket_uri)))

    def check_input(self, uri: str) -> str:
        return self._check(uri, self.inputs, "input_uri", ALLOWED_INPUT_PREFIXES_ENV)

    def check_output(self, uri: str) -> str:
        return self._check(uri, self.outputs, "output_uri", ALLOWED_OUTPUT_PREFIXES_ENV)

    def check_outside_api_areas(self, uri: str, field: str) -> None:
        """UnsafeURI when the URI is in one of the API's areas or holds one; the message names only the URI given."""
        if not self.api_areas:
            return
        target = _resolved(uri)
        for area in map(_resolved, self.api_areas):
            if is_under(target, area) or is_under(area, target):
                raise UnsafeURI(f"{field}: {uri!r} lies in the OpenAI Batch API's storage, which only the API's "
                                f"own batches may read or write; name an input, output or adapter elsewhere")

    @staticmethod
    def _check(uri: str, prefixes: tuple[str, ...] | None, field: str, env: str) -> str:
        try:
            return check_allowed(uri, prefixes, field, env)
        except UnsafeURI as error:
            raise UnsafeURI(f"{field}: {error}") from None

    def cache_salt(self, spec_salt: str | None, tenant: str, job_key: str) -> str | None:
        """The salt a job's rows run with: see the module's docstring."""
        if self.cache_isolation == "spec":
            return spec_salt
        identity = f"job\n{job_key}" if self.cache_isolation == "job" else f"tenant\n{tenant}\n{spec_salt or ''}"
        return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]


OPEN = FrontDoorPolicy()  # no restriction: tests and embedded use
