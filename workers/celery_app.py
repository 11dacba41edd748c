"""The Celery app: Redis broker by default (`TOKENMILL_BROKER_URL=amqp://...` for RabbitMQ), one GPU queue per
model plus a control queue, and beat's periodic tasks (the sweep and the schedule check).

Shards are long, so every task is acknowledged only when it ends (a worker that dies leaves its task to be
requeued), and task events are on for Flower. A worker runs its shards in a pool of K threads over one engine
(`workers.engine_loop`): up to K shards in flight, taken by their job's priority (the message priority). A thread
pool takes whatever task comes next, so the control tasks (plan, finalize, the sweep, schedules) have a node of
their own, which loads no engine: they never wait for a shard thread, however busy the shards keep them.

    tokenmill worker   two nodes, started and stopped together:
                       celery -A workers.celery_app worker -Q gpu.smollm2-135m --pool threads -c K -n NAME@host
                       celery -A workers.celery_app worker -Q control --pool threads -c 2 -n NAME-control@host
    celery -A workers.celery_app beat
    celery -A workers.celery_app flower --basic-auth=user:password
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from celery import Celery
from celery.signals import beat_init, worker_process_init, worker_ready
from celery.worker.control import inspect_command

from ingest.config import ServiceConfig

if TYPE_CHECKING:
    from workers.worker_engine import WorkerProcess

config = ServiceConfig.from_env()

app = Celery("tokenmill", broker=config.broker_url, backend=config.result_backend, include=["workers.tasks"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    result_expires=7 * 24 * 3600,
    timezone="UTC",
    task_acks_late=True,  # ack when the task ends: a dead worker's shard goes back to the queue
    task_reject_on_worker_lost=True,  # ... also when the pool process running it was killed
    worker_prefetch_multiplier=1,  # reserve no more shards than the K threads run; others stay for other workers
    task_default_queue=config.control_queue,  # run_shard is sent to its model's queue (workers.tasks)
    task_track_started=True,
    worker_send_task_events=True,  # for Flower
    task_send_sent_event=True,
    worker_proc_alive_timeout=120,  # a pool process loads its engine before it takes tasks
    worker_cancel_long_running_tasks_on_connection_loss=True,
    broker_connection_retry_on_startup=True,
    broker_connection_retry=True,
    broker_connection_max_retries=None,  # a broker down (restarting) is waited for, however long
    result_backend_always_retry=True,  # and so is the result backend (Redis) for task states
    redis_socket_keepalive=True,
    redis_backend_health_check_interval=10,  # a restarted Redis: stale connections are found and replaced
    # Redis hands an unacknowledged task to another worker after this; a dead worker's shard is found
    # sooner by the sweep (its process is gone), so this only needs to exceed the longest shard.
    # Redis keeps one list per priority level and takes the lowest level first (workers.tasks.message_priority).
    broker_transport_options={"visibility_timeout": 6 * 3600, "health_check_interval": 10,
                              "priority_steps": list(range(10)), "queue_order_strategy": "priority"},
    task_queue_max_priority=9 if config.broker_url.startswith("amqp") else None,  # RabbitMQ: x-max-priority
    beat_schedule={  # a firing no worker took before the next one is dropped, so busy workers find no pile
        "sweep": {"task": "tokenmill.sweep", "schedule": config.sweep_interval_s,
                  "options": {"expires": config.sweep_interval_s}},
        "fire-schedules": {"task": "tokenmill.fire_schedules", "schedule": config.schedule_interval_s,
                           "options": {"expires": config.schedule_interval_s}},
    },
)


class TasksProcess:
    """What the tasks of one process share, owned by the process's Celery app (`tasks_process`): the job database's
    session factory, made at first use (after a prefork pool forks), its job events published when Kafka is
    configured (`workers.events.install`); and, for a worker, its `workers.worker_engine.WorkerProcess` (its engine
    service and the claims it runs now). `tokenmill worker` makes it with the worker's engine and factory (`start`);
    elsewhere (a `celery -A workers.celery_app` worker, a front door sending tasks) it is made at first use, its
    worker's engine read from the environment."""

    def __init__(self, config: ServiceConfig, worker: WorkerProcess | None = None) -> None:
        self.config = config
        self._worker = worker
        self._sessions = None
        self._lock = threading.Lock()

    def sessions(self):
        with self._lock:
            if self._sessions is None:
                from storage import db
                from workers import events

                self._sessions = db.session_factory(db.make_engine(self.config.database_url))
                events.install(self.config, self._sessions)
            return self._sessions

    @property
    def worker(self) -> WorkerProcess:
        with self._lock:
            if self._worker is None:
                from workers.worker_engine import WorkerProcess

                self._worker = WorkerProcess()
            return self._worker


_starting = threading.Lock()  # guards the one attribute below, on the app


def tasks_process() -> TasksProcess:
    """This process's `TasksProcess`, held by its Celery app (`app.tokenmill`), made at first use unless `start`
    gave it."""
    with _starting:
        process = getattr(app, "tokenmill", None)
        if process is None:
            process = app.tokenmill = TasksProcess(config)
        return process


def start(process: TasksProcess) -> None:
    """Give the app the process's state before its worker starts (`tokenmill worker`: its engine, typed)."""
    with _starting:
        app.tokenmill = process


def worker_process() -> WorkerProcess:
    """What this process holds as a worker (its engine service, the claims it runs now): a
    `workers.worker_engine.WorkerProcess` owned by the process's Celery app, made when the process starts (or by the
    first task that needs it, where no worker started it)."""
    return tasks_process().worker


@worker_process_init.connect
def _start_worker_process(**_kwargs) -> None:
    """Each prefork pool process: publish job events, and load the engine now rather than at the first shard."""
    _start_tasks_process(background=False)


@worker_ready.connect
def _start_thread_pool(sender=None, **_kwargs) -> None:
    """A threads pool runs the tasks in the worker's own process: the same, the engine loaded in the background
    (the worker answers pings meanwhile; a shard that comes first waits for it)."""
    from celery.concurrency.thread import TaskPool

    if isinstance(getattr(sender, "pool", None), TaskPool):
        _start_tasks_process(background=True)


def _start_tasks_process(background: bool) -> None:
    import logging
    import os
    import threading

    tasks_process().sessions()  # its job events published from now on
    process = worker_process()
    if not os.environ.get("TOKENMILL_WORKER_PRELOAD"):
        return

    def load() -> None:
        try:
            process.engine_loop()
        except Exception:  # the first shard will raise it again, as the shard's error
            logging.getLogger("tokenmill.worker").exception("could not load the engine")

    threading.Thread(target=load, name="engine-load", daemon=True).start() if background else load()


@inspect_command()
def tokenmill_served(state) -> dict:
    """What this node serves, for `tokenmill model list`: its model, its role (engine or control), whether its
    engine runs LoRA adapters (a job's own too), its own adapters, and those in its machine's adapter cache."""
    import os

    from workers.adapters import cached_adapters

    role = os.environ.get("TOKENMILL_WORKER_CHILD", "")
    if role == "control":  # no engine
        return {"role": role}
    spec = worker_process().spec
    lora = bool(spec.settings.get("enable_lora"))
    if lora:
        from engine.embedding_engine import is_embedding_model

        lora = not is_embedding_model(spec.model)  # an embedding engine serves no adapters, whatever its settings
    return {"model": spec.model, "role": role, "lora": lora, "max_loras": spec.settings.get("max_loras"),
            "adapters": spec.lora_modules, "cached": [entry["uri"] for entry in cached_adapters()]}


@beat_init.connect
def _serve_job_metrics(**_kwargs) -> None:
    """Beat serves the job-level gauges, so queued jobs still show when every worker is down."""
    import os

    if port := os.environ.get("TOKENMILL_JOB_METRICS_PORT"):
        from storage import db
        from workers.job_metrics import serve_job_metrics

        sessions = db.session_factory(db.make_engine(config.database_url))
        serve_job_metrics(db.sql_query(sessions), int(port), os.environ.get("TOKENMILL_METRICS_ADDR", "127.0.0.1"))
