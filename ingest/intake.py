"""What every front door does with a valid job spec: store inline rows as a Parquet file, create the job once
(a second arrival with the same idempotency key finds it and changes nothing), and hand a job that still
waits for validation to the workers through the `dispatch` function it is given (ingest imports no workers).

`submit` is the one way a job row is made, for the front doors and for `tokenmill run` alike."""

from __future__ import annotations

import hashlib
import io
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, object_session, sessionmaker

from ingest.job_request import JobRequest, JobRequestError, NewJob
from ingest.policy import OPEN, FrontDoorPolicy
from storage import repository as repo
from storage.claims import mark_cancelled
from storage.job_settings import CELERY, JobSettings, window_seconds
from storage.liveness import db_now, runner_alive
from storage.models import Job, JobSource, JobStatus, utcnow
from storage.objectstore import S3Options, normalize_uri, open_store
from storage.states import is_terminal, output_claim, transition

log = logging.getLogger("tokenmill.jobs")

S = JobStatus
OUTPUT_CLAIMS_LOCK = 0x746D_6F75  # PostgreSQL advisory lock id of the output claims ("tmou")


class OutputClaimed(ValueError):
    """Another live job writes to this output prefix, to one holding it or to one under it."""

    def __init__(self, output_uri: str, owner: str) -> None:
        super().__init__(f"output {output_uri} is taken by live job {owner} (its output is this prefix, holds it "
                         f"or lies under it); wait for it to end, cancel it, or choose another output")
        self.owner = owner


def claim_owner(session: Session, output_uri: str, but: str | None = None) -> str | None:
    """A live job, other than `but`, whose output prefix is this one, holds it or lies under it (segment-wise:
    `out/a` and `out/a/x` overlap, `out/a` and `out/ab` do not). On PostgreSQL the check takes a lock held to the
    transaction's end, so two overlapping claims cannot both pass it at once (SQLite's write lock does that)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(OUTPUT_CLAIMS_LOCK)))
    claim = output_claim(output_uri)
    holders = [claim, *claim_ancestors(claim)]
    below = claim + "/"
    overlapping = or_(Job.output_claim.in_(holders), func.substr(Job.output_claim, 1, len(below)) == below)
    query = select(Job.id).where(Job.output_claim.is_not(None), overlapping)
    if but is not None:
        query = query.where(Job.id != but)
    return session.scalar(query.order_by(Job.output_claim).limit(1))


def claim_ancestors(claim: str) -> list[str]:
    """The prefixes holding a claim: s3://b and s3://b/out for s3://b/out/x (file:///a for file:///a/b)."""
    scheme, _, path = claim.partition("://")
    parts = path.split("/")
    start = 2 if scheme == "file" else 1  # file:///a/b splits as ['', 'a', 'b']: the root holds nothing
    return [f"{scheme}://{'/'.join(parts[:end])}" for end in range(start, len(parts))]


@dataclass
class Submission:
    job: Job
    outcome: str  # created | resumed | retried | finished | duplicate


def idempotency_key(input_uri: str, output_uri: str) -> str:
    """Same input and output means same job: the CLI resumes it instead of starting another."""
    canonical = f"{normalize_uri(input_uri)}\n{normalize_uri(output_uri)}"
    return "cli-" + hashlib.sha256(canonical.encode()).hexdigest()[:40]


def submit(sessions: sessionmaker[Session], new: NewJob, reopen: bool = True,
           with_job: Callable[[Session, Job], None] | None = None) -> Submission:
    """Create the job, or find it again by its idempotency key. With `reopen` (the CLI's resubmission) a failed
    or cancelled job is retried; without it (a redelivered message) the job found is left as it is. `with_job`
    writes what belongs with a created job (the API's batch row) in the transaction that creates it."""
    key = new.idempotency_key or idempotency_key(new.input_uri, new.output_uri)
    try:
        with sessions.begin() as session:
            job = repo.job_by_key(session, key)
            if job is not None:
                return Submission(job, _reopen(job, new) if reopen else "duplicate")
            _check_id_free(session, new.job_id)
            if owner := claim_owner(session, new.output_uri):
                if (job := repo.job_by_key(session, key)) is not None:  # a concurrent submit of it committed
                    return Submission(job, _reopen(job, new) if reopen else "duplicate")  # between the two reads
                raise OutputClaimed(new.output_uri, owner)
            now = utcnow()
            job = Job(id=new.job_id or str(uuid.uuid4()), idempotency_key=key, source=new.source,
                      source_ref=new.source_ref, status=S.VALIDATING.value, model=new.model,
                      input_uri=new.input_uri, output_uri=new.output_uri, settings=new.settings,
                      priority=new.priority, created_at=now, validating_at=now,
                      output_claim=output_claim(new.output_uri), expires_at=deadline(new.settings, db_now(session)))
            session.add(job)
            if with_job is not None:
                session.flush()
                with_job(session, job)
            return Submission(job, "created")
    except IntegrityError:  # submitted concurrently by someone else: that one wins
        with sessions() as session:
            job = repo.job_by_key(session, key)
        if job is None:  # the clash was on the job id or on the output prefix, not the key
            with sessions() as session:
                if owner := claim_owner(session, new.output_uri):
                    raise OutputClaimed(new.output_uri, owner) from None
            raise
        return Submission(job, "resumed" if reopen else "duplicate")


def deadline(settings: JobSettings, start: datetime) -> datetime:
    """`start` is on the database's clock (`db_now`), the one the sweep compares deadlines with."""
    return start + timedelta(seconds=window_seconds(settings.completion_window))


def _check_id_free(session: Session, job_id: str | None) -> None:
    if job_id is not None and session.get(Job, job_id) is not None:
        raise ValueError(f"job id {job_id} is taken by a job with another idempotency key")


def _reopen(job: Job, new: NewJob) -> str:
    if job.status == S.COMPLETED:
        return "finished"
    _update_settings(job, new)
    if job.status == S.CANCELLING and not runner_alive(job, db_now(object_session(job))):
        mark_cancelled(job)
    if is_terminal(job.status):
        if owner := claim_owner(object_session(job), job.output_uri, but=job.id):
            raise OutputClaimed(job.output_uri, owner)
        transition(job, S.VALIDATING)
        repo.fence(job)  # a cleanup of the ended attempt, still running late, must spare the retry's parts
        job.expires_at = deadline(job.settings, db_now(object_session(job)))
        return "retried"
    return "resumed"


def _update_settings(job: Job, new: NewJob) -> None:
    """Before any shard ran, a resubmission may change the settings; afterwards they are fixed."""
    wanted = new.settings.model_dump(exclude={"input_fingerprint", "input_format"})
    current = job.settings.model_dump()
    changed = sorted(k for k, v in wanted.items() if current[k] != v)
    if not changed and job.model == new.model:
        return
    if any(shard.attempts for shard in job.shards):
        log.warning("job %s keeps the settings it started with; ignoring changes to %s", job.id,
                    ", ".join(changed + (["model"] if job.model != new.model else [])))
        return
    job.settings = job.settings.model_copy(update={k: getattr(new.settings, k) for k in wanted})
    job.model = new.model


@dataclass
class Intake:
    sessions: sessionmaker[Session]
    s3: S3Options
    dispatch: Callable[[str], None]  # job id -> queued for validation (the workers' dispatch_job)
    inline_uri: str | None = None  # where inline rows are stored
    policy: FrontDoorPolicy = OPEN  # allowed prefixes and cache isolation (ingest.policy)

    def accept(self, request: JobRequest, *, source: str, source_ref: str, default_key: str,
               tenant: str = "", executor: str = CELERY, input_pin: dict | None = None) -> Submission:
        """The job for this request, created or found again; raises JobRequestError for a spec that cannot run.
        `tenant` names who sent it (the inbox folder, the message key, the API key's tenant), for its cache
        salt; `executor` is who runs it (the Celery workers, or this process: `tokenmill api` alone);
        `input_pin` is the version of the input the front door saw (the inbox's listed ETag), the only one the
        job may read."""
        return self.record(self.prepare(request, source=source, source_ref=source_ref, default_key=default_key,
                                        tenant=tenant, executor=executor, input_pin=input_pin))

    def prepare(self, request: JobRequest, *, source: str, source_ref: str, default_key: str,
                tenant: str = "", executor: str = CELERY, input_pin: dict | None = None) -> NewJob:
        """`accept` short of the database: the job this request asks for (its inline rows stored); else a
        JobRequestError."""
        request, key = self.admit(request, source=source, default_key=default_key, tenant=tenant)
        if request.rows is not None:
            request = request.model_copy(update={"input_uri": self._store_rows(request.rows, key), "rows": None})
        try:
            new = request.to_job(executor=executor, source=source, source_ref=source_ref, default_key=key, s3=self.s3)
        except ValueError as error:  # e.g. an unsafe output URI
            raise JobRequestError(str(error)) from None
        if input_pin is not None:
            new.settings = new.settings.model_copy(update={"inbox_pin": input_pin})
        return new

    def record(self, new: NewJob, with_job: Callable[[Session, Job], None] | None = None) -> Submission:
        """Store a prepared job (or find it again by its key) and, once that committed, hand it to the workers;
        JobRequestError for a job id already taken. `with_job`: see `submit`."""
        try:
            submission = submit(self.sessions, new, reopen=False, with_job=with_job)
        except ValueError as error:
            raise JobRequestError(str(error)) from None
        if submission.job.status == JobStatus.VALIDATING:  # also when an earlier arrival was not handed out
            self.dispatch(submission.job.id)
        return submission

    def admit(self, request: JobRequest, *, source: str, default_key: str, tenant: str = "") -> tuple[JobRequest, str]:
        """The policy's part of `accept`, touching nothing: JobRequestError for a URI outside the allow-lists, or in the
        OpenAI API's areas unless the API sent it; else the request with its cache salt, and its idempotency key
        (made to fit its column)."""
        key = bounded_key(request.idempotency_key or default_key)
        try:
            if source != JobSource.API.value:  # the API's areas are its own batches' alone
                for field, uri in request.named_uris().items():
                    self.policy.check_outside_api_areas(uri, field)
            if request.output_uri is not None:
                self.policy.check_output(request.output_uri)
            if request.input_uri is not None:
                self.policy.check_input(request.input_uri)
            for adapter_uri in request.lora_modules.values():  # workers read adapters as they read inputs
                self.policy.check_input(adapter_uri)
        except ValueError as error:
            raise JobRequestError(str(error)) from None
        salt = self.policy.cache_salt(request.cache_salt, f"{source}:{tenant}", key)
        return request.model_copy(update={"cache_salt": salt}), key

    def _store_rows(self, rows: list[dict], key: str) -> str:
        if not self.inline_uri:
            raise JobRequestError("inline rows are not accepted here (no TOKENMILL_INLINE_URI); give an input_uri")
        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowException, TypeError, ValueError) as error:
            raise JobRequestError(f"rows: not a table of rows: {error}") from None
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        name = f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.parquet"  # the same message, the same file
        store = open_store(self.inline_uri, self.s3)
        store.put_bytes(name, buffer.getvalue())
        return store.uri_of(name)


def bounded_key(key: str, limit: int = 255) -> str:
    """An idempotency key that fits its column: a longer one (e.g. derived from a long S3 key) is hashed."""
    if len(key) <= limit:
        return key
    return f"{key[:limit - 42]}#{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}"


def content_key(prefix: str, document: bytes | str) -> str:
    """An idempotency key from content: the same bytes arriving twice are one job."""
    data = document.encode() if isinstance(document, str) else document
    return f"{prefix}-{hashlib.sha256(data).hexdigest()[:40]}"
