"""The S3 inbox: every new object under the inbox prefix becomes a job. An object is known by (bucket, key,
ETag), so an object seen before is skipped and one replaced with new content is a new job. An object that
cannot become a job is recorded in `inbox_objects` with its error and the scan goes on; only a transient error
(S3 or the database down) ends the scan, to be tried again at the next one.

An optional sidecar `NAME.job.json` next to `NAME.parquet` (or `NAME.jsonl`) carries the job's settings as in
`ingest.job_request` (output_uri, model, sampling, ...; not input_uri). Without an output_uri the results go to
`<results prefix>/NAME-<etag>`. Objects younger than `settle_s` wait for the next scan, so a sidecar uploaded
just after its input file is still seen; upload the sidecar first to be sure.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from ingest.intake import Intake, Submission
from ingest.job_request import MAX_JOB_REQUEST_BYTES, JobRequestError, parse_request
from storage.faults import is_transient
from storage.models import InboxObject, JobSource, utcnow
from storage.objectstore import TMP_PREFIX, S3Store, normalize_uri

log = logging.getLogger("tokenmill.watcher")

SIDECAR_SUFFIX = ".job.json"
MAX_NAME = 100  # characters of an input's name kept in the output folder derived from it


@dataclass(frozen=True)
class InboxEntry:
    key: str  # the full object key in the bucket
    etag: str
    modified: datetime

    @property
    def stem(self) -> str:
        """prompts for inbox/prompts.parquet."""
        return posixpath.splitext(posixpath.basename(self.key))[0]

    @property
    def sidecar_key(self) -> str:
        return posixpath.join(posixpath.dirname(self.key), self.stem + SIDECAR_SUFFIX)

    @property
    def output_name(self) -> str:
        """The folder of results derived from the key: the name (shortened when long) and the ETag."""
        name = self.stem
        if len(name) > MAX_NAME:
            digest = hashlib.sha256(self.key.encode("utf-8", "surrogatepass")).hexdigest()
            name = f"{name[:MAX_NAME - 13]}-{digest[:12]}"
        return f"{name}-{self.etag[:12]}"


class InboxWatcher:
    def __init__(self, intake: Intake, inbox_uri: str, results_uri: str, settle_s: float = 5.0,
                 max_bytes: int = MAX_JOB_REQUEST_BYTES) -> None:
        self.intake = intake
        inbox = normalize_uri(inbox_uri)
        if not inbox.startswith("s3://"):
            raise ValueError(f"the inbox must be an s3:// prefix, got {inbox_uri!r}")
        self.store = S3Store(*_bucket_and_prefix(inbox), options=intake.s3)
        self.results_uri = normalize_uri(results_uri)
        self.settle = timedelta(seconds=settle_s)
        self.max_bytes = max_bytes

    def run(self, stop: threading.Event | None = None, interval_s: float = 2.0) -> None:
        stop = stop or threading.Event()
        log.info("watching %s every %.0f s", self.store.uri, interval_s)
        while not stop.is_set():
            try:
                self.scan()
            except Exception:  # S3 or the database is down: the next scan tries again
                log.exception("scan of %s failed", self.store.uri)
            stop.wait(interval_s)

    def scan(self) -> list[str]:
        """One pass over the inbox: the ids of the jobs made from new objects."""
        entries = [e for e in self._list() if utcnow() - e.modified >= self.settle]
        seen = self._seen(entries)
        made = []
        for entry in entries:
            if (stored_key(entry.key), entry.etag) in seen:
                continue
            try:
                job_id = self._take(entry)
            except Exception as error:
                if is_transient(error):
                    raise
                log.exception("could not record %s; the next scan tries again", entry.key[:300])  # never blocks
                continue
            if job_id is not None:
                made.append(job_id)
        return made

    def _list(self) -> Iterator[InboxEntry]:
        prefix = f"{self.store.prefix}/" if self.store.prefix else ""
        pages = self.store.client.get_paginator("list_objects_v2").paginate(Bucket=self.store.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                name = posixpath.basename(obj["Key"])
                if name and not name.endswith(SIDECAR_SUFFIX) and not name.startswith((TMP_PREFIX, ".")):
                    yield InboxEntry(obj["Key"], obj["ETag"].strip('"'), obj["LastModified"])

    def _seen(self, entries: list[InboxEntry]) -> set[tuple[str, str]]:
        if not entries:
            return set()
        with self.intake.sessions() as session:
            rows = session.execute(select(InboxObject.key, InboxObject.etag).where(
                InboxObject.bucket == self.store.bucket, InboxObject.key.in_([stored_key(e.key) for e in entries])))
            return {(key, etag) for key, etag in rows}

    def _take(self, entry: InboxEntry) -> str | None:
        uri = f"s3://{self.store.bucket}/{entry.key}"
        try:
            job = self.accept(entry, self._sidecar(entry)).job
        except Exception as error:
            if is_transient(error):  # S3 or the database is down: the next scan tries again
                raise
            message = str(error) if isinstance(error, JobRequestError) else f"{type(error).__name__}: {error}"
            log.warning("%s cannot become a job: %s", uri, message)
            self._remember(entry, None, message.replace("\x00", "\ufffd"))
            return None
        log.info("%s (ETag %s): job %s", uri, entry.etag, job.id)
        self._remember(entry, job.id, None)
        return job.id

    def accept(self, entry: InboxEntry, sidecar: bytes) -> Submission:
        """The job of an inbox object with its sidecar's bytes; JobRequestError (or UnsafeURI) when it cannot be one."""
        uri = f"s3://{self.store.bucket}/{entry.key}"
        request = parse_request(sidecar, max_bytes=self.max_bytes, input_uri=uri,
                                output_uri=f"{self.results_uri}/{entry.output_name}")
        if request.input_uri != normalize_uri(uri):
            raise JobRequestError(f"{entry.sidecar_key}: a sidecar cannot name another input_uri or give rows")
        return self.intake.accept(request, source=JobSource.S3.value, source_ref=f"{uri}@{entry.etag}",
                                  default_key=f"s3-{self.store.bucket}/{entry.key}@{entry.etag}",
                                  tenant=f"{self.store.bucket}/{posixpath.dirname(entry.key)}",
                                  input_pin={"etag": entry.etag})

    def _sidecar(self, entry: InboxEntry) -> bytes:
        key = entry.sidecar_key
        relative = key[len(self.store.prefix) + 1:] if self.store.prefix else key
        if not self.store.exists(relative):
            return b"{}"
        size = self.store.size(relative)
        if size > self.max_bytes:  # not read: refused by its size alone
            raise JobRequestError(f"sidecar {key} is too large: {size} bytes, the limit is {self.max_bytes} "
                            f"(TOKENMILL_MAX_SPEC_BYTES)")
        return self.store.get_bytes(relative)

    def _remember(self, entry: InboxEntry, job_id: str | None, error: str | None) -> None:
        try:
            with self.intake.sessions.begin() as session:
                session.add(InboxObject(bucket=self.store.bucket, key=stored_key(entry.key), etag=entry.etag,
                                        job_id=job_id, error=error))
        except IntegrityError:  # another watcher took it first; its job is the same (same idempotency key)
            pass


def stored_key(key: str) -> str:
    """The key as `inbox_objects` keeps it: PostgreSQL text holds no NUL."""
    return key.replace("\x00", "\ufffd")


def _bucket_and_prefix(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    return bucket, prefix
