"""Jobs that come through the OpenAI Batch API (`ingest.openai_api.app`): an uploaded input file, `create_batch`,
the client's polls (`retrieve_batch`, which adds a batch's result files once it ended), `cancel_batch`, and the
API's cleanup of expired files. Called as the API's handlers are, without HTTP, from the front door's host."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import exists, select
from sqlalchemy.orm import Session, sessionmaker

from ingest.intake import Intake
from ingest.openai_api.app import ApiService, BatchCreate, ExpiresAfter, cancel_batch, create_batch, retrieve_batch
from ingest.openai_api.objects import ApiError
from ingest.openai_api.results import UPLOAD, content, delete_expired_files
from ingest.policy import API_UPLOADS
from storage.models import ApiBatch, ApiFile, Job, JobSource, utcnow
from storage.objectstore import S3Options
from storage.states import is_terminal
from workers.sim.plan import API_BUCKET

if TYPE_CHECKING:
    from workers.sim.kernel import Kernel
    from workers.sim.plan import JobPlan

TENANT = "sim-tenant"
ENDPOINT = "/v1/completions"
S3 = S3Options()


class SimApi:
    def __init__(self, kernel: Kernel, sessions: sessionmaker[Session], model: str, dispatch, cancel) -> None:
        self.kernel, self.sessions = kernel, sessions
        self.service = ApiService(sessions, API_BUCKET, Intake(sessions, S3, dispatch), cancel, model,
                                  max_completion_window="24h")

    def upload(self, plan: JobPlan, rows: list[tuple[str, str | None]]) -> str:
        """The batch's input as `POST /v1/files` stores it; returns the file id."""
        lines = [json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                             "body": {"model": self.service.model, "prompt": prompt or "empty", "max_tokens": 4}})
                 for custom_id, prompt in rows]
        data = ("\n".join(lines) + "\n").encode()
        file_id = f"file-sim{plan.index:04d}"
        store = self.kernel.store(f"{API_BUCKET}/{API_UPLOADS}")
        store.objects[f"{file_id}.jsonl"] = (data, next(self.kernel.versions))
        with self.sessions.begin() as db:
            db.add(ApiFile(id=file_id, tenant=TENANT, purpose="batch", kind=UPLOAD, bytes=len(data),
                           created_at=utcnow(), ready_at=utcnow(), filename="input.jsonl",
                           uri=store.uri_of(f"{file_id}.jsonl")))
        return file_id

    def create(self, plan: JobPlan, file_id: str) -> str:
        """`POST /v1/batches`: the batch's (and its job's) id; ApiError when refused."""
        service = dataclasses.replace(self.service, shard_size=plan.shard_size)
        expires = ExpiresAfter(anchor="created_at", seconds=plan.output_expires_after) \
            if plan.output_expires_after else None
        batch = create_batch(service, TENANT, BatchCreate(input_file_id=file_id, endpoint=ENDPOINT,
                                                          completion_window=plan.window,
                                                          output_expires_after=expires))
        return batch["id"]

    def cancel(self, job_id: str) -> None:
        try:
            cancel_batch(self.service, TENANT, job_id)
        except ApiError:  # ended already
            pass

    def poll(self, job_id: str) -> bool:
        """The client's `GET /v1/batches/{id}`; True once the batch ended and has its result files."""
        batch = retrieve_batch(self.service, TENANT, job_id)
        return is_terminal(batch["status"]) and bool(batch.get("output_file_id") or batch.get("error_file_id"))

    def cleanup(self) -> int:
        return delete_expired_files(self.sessions, S3)


def check_batch(api: SimApi, plan: JobPlan) -> list[str]:
    """Invariants 1 and 2 over the batch's result files: its output and error files together hold each
    custom_id exactly once, unfinished rows of an ended batch as batch_cancelled / batch_expired errors."""
    label = f"batch {plan.index}"
    try:
        api.poll(plan.job_id)
    except Exception as error:  # the API itself fails: that is a finding too
        return [f"invariant 2: {label}: retrieving it raised {type(error).__name__}: {error}"]
    with api.sessions() as db:
        batch = db.get(ApiBatch, plan.job_id)
        if batch is None:
            return [f"invariant 2: {label}: its job exists but the batch does not"]
        status = batch.job.status
        files = [db.get(ApiFile, file_id) for file_id in (batch.output_file_id, batch.error_file_id) if file_id]
    label = f"batch {plan.index} ({status})"
    if not is_terminal(status):
        return []
    if status == "failed":
        return []
    ids: list[str] = []
    for row in files:
        try:
            ids += [json.loads(line)["custom_id"] for line in b"".join(content(row, S3)).splitlines() if line.strip()]
        except FileNotFoundError:
            return [f"invariant 5: {label}: its {row.kind} file {row.id} lost its object"]
    number = "1" if status == "completed" else "2"
    problems = []
    if duplicated := sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"invariant {number}: {label}: custom_id more than once in its result files: "
                        f"{duplicated[:5]}")
    if missing := sorted(set(plan.custom_ids) - set(ids)):
        problems.append(f"invariant {number}: {label}: custom_id in neither its output nor its error file: "
                        f"{missing[:5]}")
    return problems


def check_orphans(api: SimApi) -> list[str]:
    """Path 8's mark: a job of the API with no batch (its `create_batch` failed for the client after it had
    handed the job to the workers): it runs, and its rows reach no batch's files."""
    with api.sessions() as db:
        orphans = db.scalars(select(Job.id).where(Job.source == JobSource.API.value, ~exists().where(
            ApiBatch.job_id == Job.id))).all()
    return [f"invariant 2: job {job_id} of the API has no batch: the client saw its create fail, yet it was "
            f"handed to the workers" for job_id in orphans]


def check_lifetimes(api: SimApi, plans: list[JobPlan]) -> list[str]:
    """Invariant 5 for result files: the API's cleanup, run just before each one's lifetime (from its creation)
    ends, in that order, leaves it there."""
    ends = []
    with api.sessions() as db:
        for plan in plans:
            batch = db.get(ApiBatch, plan.job_id)
            if batch is None or not batch.output_expires_after:
                continue
            for file_id in (batch.output_file_id, batch.error_file_id):
                if file_id:
                    created = db.get(ApiFile, file_id).created_at
                    ends.append((created + timedelta(seconds=batch.output_expires_after), file_id, plan.index,
                                 batch.output_expires_after, created))
    problems = []
    for end, file_id, index, lifetime, created in sorted(ends):
        delete_expired_files(api.sessions, S3, now=end - timedelta(seconds=1))
        with api.sessions() as db:
            row = db.get(ApiFile, file_id)
        if row.deleted_at is not None:
            label = f"batch {index}"
            problems.append(f"invariant 5: {label}: its {row.kind} file was deleted before {lifetime} s from its "
                            f"creation (expires_at {row.expires_at:%H:%M:%S}, created {created:%H:%M:%S})")
    return problems
