"""The invariants, checked once the faults stopped and the fleet settled (numbers as in issue #55):

1. a completed job's output (its parts and error file) holds each custom_id of its input exactly once, each row's
   text the engine's for that row;
2. a cancelled, expired or failed job keeps only committed parts, no row twice and no manifest; an API batch
   that was cancelled or expired has result files that hold each custom_id exactly once (`workers.sim.api`);
3. no job is left non-terminal (checked by the run: within `world.SETTLE_BOUND_S` after the faults stop);
4. no object under a job's output prefix lies outside its manifest (completed) or its committed parts (others);
5. nothing a job still needs was deleted: every committed part of a job is still there, a completed job keeps its
   manifest, error file and batch output, and no API result file is deleted before its `output_expires_after`
   from its creation;
6. (deadline) a job expires no earlier than its completion window after it arrived, and at most
   `LATE_EXPIRY_S` later, on the database's clock (whatever the hosts' clocks say);
7. (lost work, checked by the run as it goes: `World._check_lost_work`) once the faults stopped and the last
   pause or outage they drew ended, no shard waits with no task for longer than the grace and two sweeps."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
from sqlalchemy.orm import Session, sessionmaker

from storage.formats import BATCH_OUTPUT_KEY, ERRORS_KEY, MANIFEST_KEY
from storage.job_settings import window_seconds
from storage.models import Job, JobStatus, ShardStatus
from storage.objectstore import normalize_uri
from workers.sim.api import check_batch, check_lifetimes, check_orphans
from workers.sim.engine import expected_text

if TYPE_CHECKING:
    from workers.sim.api import SimApi
    from workers.sim.kernel import Kernel
    from workers.sim.plan import JobPlan

S = JobStatus
LATE_EXPIRY_S = 900.0


def check(kernel: Kernel, sessions: sessionmaker[Session], plans: list[JobPlan], api: SimApi | None = None
          ) -> list[str]:
    violations: list[str] = []
    by_prefix: dict[str, list[tuple[JobPlan, Job]]] = {}
    with sessions() as session:
        for plan in plans:
            if plan.rejected:
                continue
            job = session.get(Job, plan.job_id) if plan.job_id else None
            if job is None:
                violations.append(f"job {plan.index}: never recorded")
                continue
            violations += check_deadline(plan, job.status)
            by_prefix.setdefault(normalize_uri(plan.output_uri), []).append((plan, job))
        for prefix, jobs in by_prefix.items():
            violations += check_prefix(kernel.objects.get(prefix, {}), jobs)
    if api is not None:  # after the stores are checked: the lifetime check runs the cleanup
        batches = [plan for plan in plans if plan.api and plan.job_id]
        for plan in batches:
            violations += check_batch(api, plan)
        violations += check_orphans(api)
        violations += check_lifetimes(api, batches)
    return violations


def check_prefix(objects: dict[str, tuple[bytes, int]], jobs: list[tuple[JobPlan, Job]]) -> list[str]:
    """One output prefix and the jobs that wrote to it (one, or several one after another)."""
    problems: list[str] = []
    parts = {key for key in objects if key.startswith("part-")}
    owned: set[str] = set()
    for plan, job in jobs:
        label = f"job {plan.index} ({job.status})"
        mine = {key for key in parts if f"-{job.id}-c" in key}
        owned |= mine
        committed = {s.output_key for s in job.shards if s.status == ShardStatus.COMPLETED and s.output_key}
        problems += [f"invariant 5: {label}: committed part {key} was deleted" for key in sorted(committed - parts)]
        if job.status == S.COMPLETED:
            problems += check_completed(plan, job, objects, mine)
        elif job.status in (S.CANCELLED, S.EXPIRED, S.FAILED):
            problems += [f"invariant 4: {label}: {key} was never committed" for key in sorted(mine - committed)]
            rows, _ = read_objects(objects, committed)
            problems += [f"invariant 2: {label}: {problem}" for problem in id_problems(plan, rows, [], False)]
    problems += [f"invariant 4: {key} belongs to no job of its prefix" for key in sorted(parts - owned)]
    if MANIFEST_KEY in objects and not any(job.status == S.COMPLETED for _, job in jobs):
        ended = ", ".join(f"job {plan.index} ({job.status})" for plan, job in jobs)
        problems.append(f"invariant 4: a manifest under the prefix of {ended}, none of them completed")
    return problems


def read_objects(objects: dict[str, tuple[bytes, int]], keys) -> tuple[list[dict], list[dict]]:
    """(part rows, error records) of these part keys and the error file, where present."""
    rows = [row for key in sorted(keys) if key in objects
            for row in pq.read_table(io.BytesIO(objects[key][0])).to_pylist()]
    errors = []
    if ERRORS_KEY in objects:
        errors = [json.loads(line) for line in objects[ERRORS_KEY][0].decode().splitlines() if line.strip()]
    return rows, errors


def id_problems(plan: JobPlan, rows: list[dict], errors: list[dict], complete: bool) -> list[str]:
    counts = Counter([r["custom_id"] for r in rows] + [e["custom_id"] for e in errors])
    problems = []
    if duplicated := sorted(k for k, n in counts.items() if n > 1):
        problems.append(f"custom_id more than once: {duplicated[:5]}")
    if unknown := sorted(set(counts) - set(plan.custom_ids)):
        problems.append(f"custom_id not in the input: {unknown[:5]}")
    if complete and (missing := sorted(set(plan.custom_ids) - set(counts))):
        problems.append(f"custom_id missing: {missing[:5]}")
    if wrong := sorted(r["custom_id"] for r in rows if r["text"] != expected_text(r["custom_id"])):
        problems.append(f"text not the engine's for its row: {wrong[:5]}")
    return problems


def check_completed(plan: JobPlan, job: Job, objects: dict[str, tuple[bytes, int]], mine: set[str]) -> list[str]:
    label = f"job {plan.index} ({job.status})"
    if MANIFEST_KEY not in objects:
        return [f"invariant 5: {label}: its manifest is gone"]
    manifest = json.loads(objects[MANIFEST_KEY][0])
    if manifest.get("job_id") != job.id:
        return [f"invariant 1: {label}: the manifest under its prefix is another job's"]
    listed = {part["key"] for part in manifest["files"]["parts"]}
    problems = [f"invariant 4: {label}: {key} lies outside the manifest" for key in sorted(mine - listed)]
    problems += [f"invariant 5: {label}: {key} listed in the manifest is gone" for key in sorted(listed - mine)]
    if ERRORS_KEY not in objects:
        problems.append(f"invariant 5: {label}: its error file is gone")
    rows, errors = read_objects(objects, listed)
    problems += [f"invariant 1: {label}: {problem}" for problem in id_problems(plan, rows, errors, complete=True)]
    if plan.openai_output and not plan.api:  # an API batch's output is checked by `check_batch`
        if BATCH_OUTPUT_KEY not in objects:
            problems.append(f"invariant 5: {label}: its batch output is gone")
        else:
            lines = [json.loads(line) for line in objects[BATCH_OUTPUT_KEY][0].decode().splitlines() if line.strip()]
            problems += [f"invariant 1: {label}: batch output: {problem}" for problem in id_problems(
                plan, [], [{"custom_id": line["custom_id"]} for line in lines], complete=True)]
    return problems




def check_deadline(plan: JobPlan, status: str) -> list[str]:
    """The job was made between its request's start and its answer: it expires no earlier than its window after
    the one, and no later than its window and LATE_EXPIRY_S after the other."""
    if status != S.EXPIRED or plan.expired_at is None or plan.arrived_at is None:
        return []
    window = window_seconds(plan.window)
    requested = plan.arrived_at if plan.requested_at is None else plan.requested_at
    earliest, latest = plan.expired_at - requested, plan.expired_at - plan.arrived_at
    if earliest >= window and latest <= window + LATE_EXPIRY_S:
        return []
    lived = earliest if earliest < window else latest
    return [f"invariant 6: job {plan.index} expired {lived:.0f} s after it arrived; its completion window is "
            f"{plan.window} ({window} s)"]
