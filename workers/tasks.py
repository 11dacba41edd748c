"""Celery tasks. Each takes ids, opens its own sessions and runs one step of a job (`workers.job_steps.JobSteps`,
`workers.shard_step.ShardStep`):

    plan_job(job_id)              control queue: validate the input, plan shards, queue one run_shard per shard
    run_shard(job_id, shard_id)   the model's GPU queue: claim the shard (attempt counter, lease), run it
                                  through this process's engine, write its part file; the shard that completes
                                  the job queues finalize_job
    prefill_shard(job_id, shard_id)  the model's prefill queue (TOKENMILL_KV_DISAGGREGATION): a producer worker
                                  claims the shard, saves its prompts' KV, hands it to run_shard (`workers.disagg`)
    finalize_job(job_id)          control queue: errors.jsonl, batch output, manifest.json; completed
    sweep()                       beat: requeue shards of dead workers, finish cancels, resend lost steps
    fire_schedules(at=None)       beat: create the jobs of schedules that are due (one per schedule and date)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from celery import Task
from kombu.exceptions import ChannelError

from ingest.intake import Intake
from storage import repository as repo
from storage.faults import crash_point, is_transient
from storage.models import Job, JobStatus, ShardStatus
from workers.adapters import AdapterSource, worker_adapters
from workers.celery_app import app, config, tasks_process, worker_process
from workers.disagg import PrefillStep, disaggregated, kv_transfer_summary, prefill_queue
from workers.finalize import remove_stray_parts
from workers.job_steps import JobSteps, discard_if_ended
from workers.shard_step import ShardStep, through_outages

log = logging.getLogger("tokenmill.tasks")

S = JobStatus
SHARD_RETRY_DELAY_S = 5
TRANSIENT_RETRY_DELAY_S = float(os.environ.get("TOKENMILL_TRANSIENT_RETRY_S") or 15)  # a service down: retry
FINALIZE_RETRIES = 3
PROGRESS_EVERY_S = 1.0


def sessions():
    """This process's session factory (job events installed), owned by its Celery app (`TasksProcess`)."""
    return tasks_process().sessions()


def worker_lora_modules() -> dict[str, AdapterSource]:
    """The LoRA adapters this worker serves to every job of its model (`tokenmill worker --lora-modules`): its
    `WorkerProcess`'s."""
    return worker_adapters(worker_process().spec.lora_modules, config.s3)


# ---- sending ---------------------------------------------------------------------------------------

def dispatch_job(job_id: str) -> None:
    """Hand a new job to the workers: validation and planning first."""
    plan_job.apply_async((job_id,), queue=config.control_queue)


def intake() -> Intake:
    """How this process turns job specs into jobs handed to the workers."""
    return Intake(sessions(), config.s3, dispatch_job, config.inline_uri, config.policy)


def finalize_later(job_id: str) -> None:
    """Send the finalize task of a job that just went finalizing, through a broker outage (retried up to
    TOKENMILL_OUTAGE_WAIT_S). Failing that, the sweep sends it: a finalize step that no one holds and no task
    waits for is resent at the next sweep but one (`workers.sweep`)."""
    try:
        through_outages(lambda: send_finalize(job_id))
    except Exception:
        log.exception("job %s: could not send its finalize task; the sweep will", job_id)


def send_finalize(job_id: str) -> None:
    finalize_job.apply_async((job_id,), queue=config.control_queue)


def enqueue_shards(job_id: str, model: str, shard_ids: Iterable[int], countdown: float | None = None,
                   head: bool = False, job_priority: int | None = None, prefill: bool = False) -> None:
    """Send shards' tasks. `head`: at the front of the job's priority band (a retry after a failure), whatever the
    shard's index; then, with `job_priority` given, the database is not asked (it may be down). `prefill`: to the
    model's producer workers first (`workers.disagg`), else to its queue."""
    indices: dict[int, int] = {}
    if job_priority is None or not head:
        job_priority, indices = _ordering(job_id)
    task, queue = (prefill_shard, prefill_queue(config, model)) if prefill else (run_shard, config.model_queue(model))
    for shard_id in shard_ids:
        rank = 0 if head else indices.get(shard_id, 0)
        task.apply_async((job_id, shard_id), queue=queue, countdown=countdown,
                         priority=message_priority(job_priority, rank, config.broker_url))


def _ordering(job_id: str) -> tuple[int, dict[int, int]]:
    """The job's priority and its shards' indices; (0, {}) when the database cannot tell (a task must still be
    sent: its place in the queue matters less)."""
    try:
        with sessions()() as session:
            job = session.get(Job, job_id)
            return job.priority or 0, {s.id: s.index for s in job.shards}
    except Exception as error:
        log.warning("job %s: cannot read its priority (%s); sending its shards at priority 0", job_id, error)
        return 0, {}


PRIORITY_BANDS = 3  # job priority > 0, == 0, < 0
RANK_BANDS = 3  # a job's first FAIR_SHARE_SHARDS shards, the next as many, the rest


def message_priority(job_priority: int, shard_index: int, broker_url: str) -> int:
    """The broker priority of a shard's task. Higher job priorities first; within one, every job's first shards
    (`config.fair_share_shards` of them) go before the next ones, and those before the rest, so a job sent
    while a large one of equal priority waits starts within about one shard's time. Redis takes the lowest
    level first, RabbitMQ the highest."""
    band = 0 if job_priority > 0 else 1 if job_priority == 0 else 2
    level = band * RANK_BANDS + min(shard_index // max(1, config.fair_share_shards), RANK_BANDS - 1)  # 0..8
    return level if broker_url.startswith(("redis", "rediss")) else PRIORITY_BANDS * RANK_BANDS - 1 - level


def _summary(job: Job, **extra: Any) -> dict[str, Any]:
    return {"job_id": job.id, "status": job.status, **extra}


class TaskProgress:
    """`workers.progress.Progress` for a task: its state (PROGRESS, with the job id and row counts) in the result
    backend and a `task-progress` event for Flower, at most once a second."""

    def __init__(self, task: Task, job_id: str, shard_id: int | None = None) -> None:
        self.task, self.meta = task, {"job_id": job_id, "shard_id": shard_id, "rows_done": 0, "tokens": 0}
        self.reported = 0.0

    def phase(self, description: str) -> None:
        self._report(phase=description, force=True)

    def start(self, total_rows: int, done_rows: int) -> None:
        self._report(rows_total=total_rows, force=True)

    def advance(self, rows: int, tokens: int) -> None:
        self.meta["rows_done"] += rows
        self.meta["tokens"] += tokens
        self._report()

    def flush(self) -> None:
        """Report the counts now (a short shard's only advance may have fallen within the throttle)."""
        self._report(force=True)

    def _report(self, force: bool = False, **changes: Any) -> None:
        self.meta.update(changes)
        if not self.task.request.id or (not force and time.monotonic() - self.reported < PROGRESS_EVERY_S):
            return
        self.reported = time.monotonic()
        if config.result_backend:
            self.task.update_state(state="PROGRESS", meta=self.meta)
        self.task.send_event("task-progress", **self.meta)


# ---- tasks -----------------------------------------------------------------------------------------

@app.task(name="tokenmill.plan_job", bind=True, soft_time_limit=1800)
def plan_job(self: Task, job_id: str) -> dict[str, Any]:
    steps = JobSteps(sessions(), job_id, TaskProgress(self, job_id), held=worker_process().held)
    if not _or_retry(self, lambda: steps.claim_step(S.VALIDATING, config.max_control_attempts)):
        return _summary(steps.load(), skipped=True)
    finished = transient = False
    try:
        job = steps.validate()
        finished = True
    except Exception as error:
        if transient := is_transient(error):  # S3 down, timing out or throttling: try again later
            raise self.retry(exc=error, countdown=backoff(self), max_retries=None) from error
        job = steps.fail(f"{type(error).__name__}: {error}")
        raise
    finally:
        _release(steps, finished, transient)
    pending = _unfinished_shards(job_id) if job.status == S.QUEUED else []
    if pending:
        enqueue_shards(job.id, job.model, pending, prefill=disaggregated(job.model))
    elif job.status == S.QUEUED:  # an empty input: nothing to run
        steps.set_status(S.IN_PROGRESS)
        job = steps.set_status(S.FINALIZING)
        finalize_later(job_id)
    return _summary(job, shards=len(pending))


def _unfinished_shards(job_id: str) -> list[int]:
    with sessions()() as session:
        return [s.id for s in repo.shards(session, job_id) if s.status != ShardStatus.COMPLETED]


@app.task(name="tokenmill.run_shard", bind=True)
def run_shard(self: Task, job_id: str, shard_id: int) -> dict[str, Any]:
    process = worker_process()
    steps = JobSteps(sessions(), job_id, TaskProgress(self, job_id, shard_id), held=process.held)
    shard_step = ShardStep(steps, worker_lora_modules())
    claim = _or_retry(self, lambda: shard_step.claim_shard(shard_id, config.max_shard_attempts))
    if claim.decision not in ("run", "exhausted"):
        log.info("job %s: shard %d not run: %s", job_id, claim.shard.index, claim.decision)
        return _summary(claim.job, shard=claim.shard.index, decision=claim.decision)
    job, shard = claim.job, claim.shard
    try:  # an exhausted claim writes its rows as errors, without the engine
        outcome = shard_step.execute_shard(job, shard, lambda: process.engine_loop(job.model), claim.exhausted)
    except Exception as error:  # the shard is marked failed; its next claim counts the attempt
        log.exception("job %s: shard %d failed (attempt %d)", job_id, shard.index, shard.attempts)
        delay = SHARD_RETRY_DELAY_S
        if is_transient(error):  # a service was down: wait it out without using up the shard's attempts
            delay = TRANSIENT_RETRY_DELAY_S
            try:  # waits for the database, which the same outage may have taken
                shard_step.refund_attempt(shard, error)
            except Exception:  # down past REFUND_WAIT_S: the attempt counts; the sweep resends the shard
                log.exception("job %s: shard %d: could not refund its attempt", job_id, shard.index)
        enqueue_shards(job_id, job.model, [shard_id], countdown=delay, head=True, job_priority=job.priority or 0)
        return _summary(job, shard=shard.index, decision="failed", error=f"{type(error).__name__}: {error}")
    finally:
        steps.close()
    if outcome.completed_job:
        finalize_later(job_id)
    if process.spec.kv_role and (kv := kv_transfer_summary(process.engine())):  # what it loaded so far
        log.info("job %s: shard %d done; KV connector totals: %s", job_id, shard.index, kv)
    decision = "lost" if outcome.lost else "cancelled" if outcome.cancelled else "completed"
    rows = outcome.totals()["rows_completed"] + len(outcome.errors)  # a row of n choices is one row
    return _summary(steps.load(), shard=shard.index, decision=decision, rows=rows)


@app.task(name="tokenmill.prefill_shard", bind=True)
def prefill_shard(self: Task, job_id: str, shard_id: int) -> dict[str, Any]:
    """A producer worker's step: prefill the shard's prompts (their KV saved), then hand it to run_shard."""
    process = worker_process()
    steps = JobSteps(sessions(), job_id, TaskProgress(self, job_id, shard_id), held=process.held)
    shard_step = ShardStep(steps, worker_lora_modules())
    claim = _or_retry(self, lambda: shard_step.claim_shard(shard_id, config.max_shard_attempts, count_attempt=False))
    if claim.decision != "run":
        log.info("job %s: shard %d not prefilled: %s", job_id, claim.shard.index, claim.decision)
        return _summary(claim.job, shard=claim.shard.index, decision=claim.decision)
    job, shard = claim.job, claim.shard
    try:
        handed = PrefillStep(shard_step).run(job, shard, lambda: process.engine_loop(job.model))
    finally:
        steps.close()
    if handed:
        try:
            through_outages(lambda: enqueue_shards(job_id, job.model, [shard_id]))
        except Exception:  # pending with no task: the sweep's reconciler sends it
            log.exception("job %s: shard %d: could not hand it to the decode workers; the sweep will", job_id,
                          shard.index)
    return _summary(steps.load(), shard=shard.index, decision="prefilled" if handed else "lost")


@app.task(name="tokenmill.finalize_job", bind=True, soft_time_limit=1800)
def finalize_job(self: Task, job_id: str) -> dict[str, Any]:
    steps = JobSteps(sessions(), job_id, TaskProgress(self, job_id), held=worker_process().held)
    if not _or_retry(self, lambda: steps.claim_step(S.FINALIZING, config.max_control_attempts + FINALIZE_RETRIES)):
        return _summary(steps.load(), skipped=True)
    finished = transient = False
    try:
        job = steps.finalize()
        finished = True
        return _summary(job)
    except Exception as error:
        if transient := is_transient(error):  # S3 or the database down: wait it out, without using up the retries
            raise self.retry(exc=error, countdown=TRANSIENT_RETRY_DELAY_S, max_retries=None) from error
        if self.request.retries < FINALIZE_RETRIES:
            raise self.retry(exc=error, countdown=SHARD_RETRY_DELAY_S) from error
        return _summary(steps.fail(f"finalizing failed: {type(error).__name__}: {error}"))
    finally:
        _release(steps, finished, transient)


def backoff(task: Task) -> float:
    """Seconds before a transient fault's next try: doubling from 1 s up to TOKENMILL_TRANSIENT_RETRY_S."""
    return min(TRANSIENT_RETRY_DELAY_S, 2.0 ** task.request.retries)


def _or_retry(task: Task, claim):
    """A claim; the database down makes the task retry later instead of being lost (acknowledged as failed)."""
    try:
        return claim()
    except Exception as error:
        if is_transient(error):
            raise task.retry(exc=error, countdown=TRANSIENT_RETRY_DELAY_S, max_retries=None) from error
        raise


def _release(steps: JobSteps, finished: bool, transient: bool) -> None:
    """Let go of a control step: a finished one clears the job's attempts, a transient fault gives its back."""
    try:
        steps.release(finished=finished, refund=transient)
    except Exception:  # the database is down: the sweep resends the step once the worker is seen gone
        log.exception("job %s: could not release its step", steps.job_id)


@app.task(name="tokenmill.sweep")
def sweep() -> dict[str, Any]:
    from workers.broker_marker import broker_lost, restore_marker
    from workers.sweep import sweep as find_lost_work

    lost = broker_lost(sessions(), config.broker_url)
    found = find_lost_work(sessions(), stale=timedelta(seconds=config.sweep_grace_s), queued=queued_tasks,
                           broker_lost=lost, finalize_wait=timedelta(seconds=config.sweep_interval_s / 2))
    for job_id in found.cancelled + found.expired:
        discard_if_ended(sessions(), JobSteps(sessions(), job_id).load())
    remove_stray_parts(sessions())  # parts of lost claims whose own cleanup failed or never ran
    crash_point("before_sweep_sends")
    for model in dict.fromkeys(model for _, _, model in found.requeue):
        queued_tasks(model)  # declares the model's queue: bound again after the broker lost its state
    for job_id, shard_id, model in found.requeue:  # at the shard's own rank: one merely waiting, not lost, keeps
        enqueue_shards(job_id, model, [shard_id])  # its place behind other jobs' first shards
    for job_id in found.plan:
        dispatch_job(job_id)
    for job_id in found.finalize:
        send_finalize(job_id)
    if lost:  # only once the resend went out: a sweep that failed or died before leaves the loss to the next
        restore_marker(sessions(), config.broker_url)
    return {"requeued": [shard for _, shard, _ in found.requeue], "validating": found.plan, "broker_lost": lost,
            "finalizing": found.finalize, "cancelled": found.cancelled, "expired": found.expired}


def queued_tasks(model: str | None) -> int:
    """Tasks waiting in a model's queue (None: the control queue). Declaring it first also restores its binding
    after the broker lost its state (a Redis FLUSHALL or restart), so what the sweep sends arrives."""
    name = config.model_queue(model) if model else config.control_queue
    try:
        with app.connection_for_write() as connection:
            queue = app.amqp.queues[name](connection.default_channel)
            queue.declare()
            try:
                return queue.queue_declare(passive=True).message_count
            except ChannelError:  # Redis keeps no empty queue
                return 0
    except Exception as error:  # unknown: the sweep resends after the grace period anyway
        log.warning("could not count the tasks in queue %s: %s", name, error)
        return 0


@app.task(name="tokenmill.fire_schedules")
def fire_schedules(at: str | None = None) -> dict[str, Any]:
    """Create the jobs of due schedules; `at` (ISO time) fires as of that time instead of now."""
    from ingest.schedules import fire_due

    fired = fire_due(sessions(), intake(), datetime.fromisoformat(at) if at else None)
    return {"created": fired.created, "existing": fired.existing, "errors": fired.errors}
