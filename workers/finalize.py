"""The last step of a job: `errors.jsonl`, the optional OpenAI Batch output, then `manifest.json`."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from storage import repository as repo
from storage.formats import (
    BATCH_OUTPUT_KEY,
    ERRORS_KEY,
    MANIFEST_KEY,
    batch_output_line,
    part_key,
    read_part,
    write_jsonl,
)
from storage.liveness import db_now
from storage.models import Job, Shard, ShardStatus
from storage.objectstore import ObjectStore, open_store

log = logging.getLogger("tokenmill.jobs")
# how long a removed stray part's note is kept, its key deleted again by each sweep (`remove_stray_parts`): far
# longer than a PUT and its client's retries take (5 tries of at most 70 s), and than a pause a lease outlives
STRAY_QUARANTINE = timedelta(hours=6)


class RowCountMismatch(RuntimeError):
    pass


def check_row_counts(job: Job, shards: list[Shard]) -> None:
    """Every input row is in exactly one part file or the error file, or the job must not complete."""
    done = sum(s.rows_completed + s.rows_failed for s in shards)
    planned = sum(s.num_rows for s in shards)
    if not done == planned == job.requests_total:
        raise RowCountMismatch(f"job {job.id}: {done} rows written, {planned} planned, {job.requests_total} in input")


def error_records(sessions: sessionmaker[Session], job_id: str, shard: int) -> list[dict[str, Any]]:
    with sessions() as session:
        return [{"custom_id": e.custom_id, "row_index": e.row_index, "code": e.code, "message": e.message}
                for e in repo.failed_rows(session, job_id, shard)]


def all_error_records(sessions: sessionmaker[Session], job_id: str, shards: list[Shard]) -> Iterator[dict[str, Any]]:
    for shard in shards:  # one short read per shard, in input order
        yield from error_records(sessions, job_id, shard.index)


def batch_output_lines(sessions: sessionmaker[Session], job: Job, shards: list[Shard],
                       store: ObjectStore) -> Iterator[dict[str, Any]]:
    """Results and errors merged back into input order, as OpenAI Batch output lines."""
    for shard in shards:
        results = read_part(store, shard.output_key).to_pylist()
        errors = error_records(sessions, job.id, shard.index)
        merged = heapq.merge(results, errors, key=lambda r: r["row_index"])
        for _, records in itertools.groupby(merged, key=lambda r: r["row_index"]):  # a row's n choices: one line
            yield batch_output_line(job.id, job.model, list(records))


def manifest(job: Job, shards: list[Shard], files: dict[str, Any], finished_at: datetime) -> dict[str, Any]:
    started = job.in_progress_at or job.created_at
    duration = max((finished_at - started).total_seconds(), 0.0)
    return {
        "job_id": job.id,
        "status": "completed",
        "model": job.model,
        "input_uri": job.input_uri,
        "output_uri": job.output_uri,
        "created_at": job.created_at.isoformat(),
        "started_at": started.isoformat(),
        "finished_at": finished_at.isoformat(),
        "duration_s": round(duration, 3),
        "counts": {"total": job.requests_total, "completed": job.requests_completed, "failed": job.requests_failed},
        "tokens": {"prompt": job.prompt_tokens, "completion": job.completion_tokens, "cached": job.cached_tokens},
        "completion_tokens_per_s": round(job.completion_tokens / duration, 3) if duration else None,
        "speculative_decoding": {
            "draft_tokens": job.spec_draft_tokens, "accepted_tokens": job.spec_accepted_tokens,
            "acceptance_rate": round(job.spec_accepted_tokens / job.spec_draft_tokens, 4)
            if job.spec_draft_tokens else None},
        "settings": job.settings.model_dump(mode="json", exclude={"s3"}),
        "files": files,
    }


def finalize_outputs(sessions: sessionmaker[Session], job: Job, shards: list[Shard], store: ObjectStore,
                     finished_at: datetime) -> dict[str, Any]:
    """Write the error file and the optional batch output. Returns the manifest, which the caller writes (after
    deleting the uncommitted parts) under the job row's lock, once it has checked that it still holds the step."""
    check_row_counts(job, shards)
    files: dict[str, Any] = {
        "parts": [{"key": s.output_key, "shard": s.index, "row_start": s.row_start, "row_end": s.row_end,
                   "rows": s.rows_completed} for s in shards],
        "errors": {"key": ERRORS_KEY, "rows": write_jsonl(store, ERRORS_KEY, all_error_records(sessions, job.id,
                                                                                                 shards))},
    }
    if job.settings.openai_output:
        lines = write_jsonl(store, BATCH_OUTPUT_KEY, batch_output_lines(sessions, job, shards, store))
        files["batch_output"] = {"key": BATCH_OUTPUT_KEY, "rows": lines}
    return manifest(job, shards, files, finished_at)


def delete_uncommitted_parts(store: ObjectStore, job: Job, shards: list[Shard]) -> None:
    """The job's parts of claims that were taken over or stopped: the database never committed them. Only this
    job's own keys are touched (they carry its id), and never the part a running claim may be writing."""
    kept = {s.output_key for s in shards if s.status == ShardStatus.COMPLETED}
    kept |= {part_key(s.index, job.id, s.claim_token) for s in shards if s.status == ShardStatus.RUNNING}
    for key in store.list("part-"):
        if f"-{job.id}-c" in key and key not in kept:
            store.delete(key)


def remove_stray_parts(sessions: sessionmaker[Session], job_id: str | None = None) -> int:
    """Parts recorded before their upload (`repo.note_upload`) whose claim neither committed nor can still
    commit: a lost claim's, whose own cleanup failed or never ran. Removes them (of one job with `job_id`); a part
    its shard's current claim may still commit is left for later. Returns how many it removed.

    A stray's note is kept `STRAY_QUARANTINE` after its removal, and each sweep deletes the key again meanwhile:
    the claim's writer may be paused inside its upload (its client library retries it once it resumes), and the
    part lands after the first delete. A writer that resumes later still removes its own part (it finds its claim
    lost after the upload, notes the key again and deletes it); only a writer paused in its upload for longer
    than the quarantine that then dies before that could leave one."""
    try:
        with sessions() as session:
            notes, now = repo.upload_notes(session, job_id), db_now(session)
    except Exception as error:  # the database is down: the next sweep tries again
        log.warning("could not read the recorded part uploads: %s", error)
        return 0
    removed = 0
    for owner, key, removed_at in notes:
        with sessions() as session:
            job = session.get(Job, owner)
            fate = "stray" if job is None else _fate(job, key)
        if fate == "pending":
            continue
        try:
            if fate == "stray" and job is not None:
                open_store(job.output_uri, job.settings.s3).delete(key)
                removed += removed_at is None
            with sessions.begin() as session:
                if fate == "stray" and job is not None and removed_at is None:
                    repo.set_aside_upload(session, owner, key, now)
                elif fate != "stray" or removed_at is None or now >= removed_at + STRAY_QUARANTINE:
                    repo.forget_upload(session, owner, key)
        except Exception as error:  # the store or the database is down: the next sweep tries again
            log.warning("job %s: could not remove the stray part %s: %s", owner, key, error)
    return removed


def _fate(job: Job, key: str) -> str:
    """A noted part: `committed` (a shard's output), `pending` (its shard's current claim may still commit it)
    or `stray` (its claim was fenced, or ended without committing)."""
    for shard in job.shards:
        if shard.status == ShardStatus.COMPLETED and shard.output_key == key:
            return "committed"
        if part_key(shard.index, job.id, shard.claim_token) == key and shard.status in (
                ShardStatus.RUNNING, ShardStatus.PENDING):
            return "pending"
    return "stray"


def discard_outputs(store: ObjectStore, job: Job, shards: list[Shard]) -> None:
    """A job that ended without completing (failed, cancelled, expired) keeps only its committed parts: no
    manifest, error file or batch output, and no part that nothing committed. A job that never passed
    validation owned no file in the prefix: it touches none.

    The manifest, error file and batch output have fixed names, which a later job on the prefix writes too, and a
    late cleanup (a zombie) may run at any time: they are deleted only for a job that reached `finalizing`, the
    one step that writes them. Such a job committed every shard and keeps those parts, so no later job passes
    validation on its prefix (`JobSteps._check_output_empty`): the files under those names can only be its own."""
    if job.queued_at is None:
        return
    if job.finalizing_at is not None:
        for key in (MANIFEST_KEY, ERRORS_KEY, BATCH_OUTPUT_KEY):
            store.delete(key)
    delete_uncommitted_parts(store, job, shards)
