"""The service tests run against a real stack (one per pytest process: `make test` runs them on two lanes,
tests/lanes.py), started the way a user starts it
(`tokenmill stack up --workers 2`, in a subprocess) on free ports, with a PostgreSQL cluster of its own
(`--postgres private`: the soak restarts and pauses it, never the machine's server), and stopped with
`tokenmill stack down`, which must leave no process and no open port behind.

The workers load the real model with small settings (1 thread each, 256 MiB of KV) through
tests/service/faulty_engine.py: the real engine, except that a prompt holding POISON kills its process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import text

from engine.config import DEFAULT_MODEL
from ingest.intake import Intake
from storage import db
from storage.faults import is_transient
from storage.objectstore import S3Options, open_store
from tests.fixtures_services import REPO, free_port_block, pg_databases  # noqa: F401 - fixtures
from tokenmill.options import sample_input

STACK_ENV = {
    "PYTHONPATH": str(REPO),  # stack processes run from their state directory; the engine hook lives in tests/
    "TOKENMILL_ENGINE_FACTORY": "tests.service.faulty_engine:load",
    "TOKENMILL_SWEEP_INTERVAL_S": "2",
    "TOKENMILL_SCHEDULE_INTERVAL_S": "2",
    "TOKENMILL_MAX_SHARD_ATTEMPTS": "2",
    "TOKENMILL_MAX_SPEC_BYTES": "262144",
    "TOKENMILL_SWEEP_GRACE_S": "10",
    "TOKENMILL_LEASE_S": "20",  # heartbeats every 5 s: a worker whose claim was taken stops within seconds
    "TOKENMILL_TRANSIENT_RETRY_S": "6",  # a service back: tasks find it within seconds (outage tests stay short)
}
TERMINAL = ("completed", "failed", "cancelled", "expired")


def tokenmill(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
              check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tokenmill", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"tokenmill {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


def stack_module():
    from tokenmill.stack import local_stack as stack

    return stack


@dataclass
class RunningStack:
    dir: Path
    state: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        """This process's environment pointed at the stack (for CLI subprocesses)."""
        return {**os.environ, **self.state["env"]}

    @property
    def database_url(self) -> str:
        return self.state["env"]["TOKENMILL_DATABASE_URL"]

    @property
    def s3(self) -> S3Options:
        return S3Options(endpoint_url=self.state["env"]["TOKENMILL_S3_ENDPOINT_URL"])

    @property
    def bucket(self) -> str:
        return self.state["env"]["TOKENMILL_BUCKET_URI"]

    @property
    def bootstrap(self) -> str:
        return self.state["env"]["TOKENMILL_KAFKA_BOOTSTRAP"]

    def store(self, uri: str):
        return open_store(uri, self.s3)

    def cli(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """`tokenmill ARGS --state-dir DIR` with this stack's environment (tables 200 columns wide)."""
        return tokenmill(*args, "--state-dir", str(self.dir), env={**self.env, "COLUMNS": "200"}, **kwargs)

    def reload(self) -> None:
        self.state = json.loads((self.dir / "stack.json").read_text())

    def worker_of(self, pid: int) -> str:
        """The stack's worker whose process group holds pid (a pool process)."""
        group = os.getpgid(pid)
        names = [name for name, pgid in self.state["processes"].items() if pgid == group]
        assert names, f"pid {pid} belongs to no process of the stack"
        return names[0]


@pytest.fixture(scope="package")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    state_dir = tmp_path_factory.mktemp("data") / "stack"  # $TOKENMILL_DATA/stack, as the README assumes
    with running_stack(state_dir, 2, STACK_ENV) as running:
        yield running


@contextlib.contextmanager
def running_stack(state_dir: Path, workers: int, env: dict[str, str]) -> Iterator[RunningStack]:
    """`tokenmill stack up` with `workers` workers (1 thread each) and `env`, its S3 keys in os.environ while it
    runs; then `stack down`, checked."""
    extra = [arg for name, value in env.items() for arg in ("--env", f"{name}={value}")]
    tokenmill("stack", "up", "--workers", str(workers), "--state-dir", str(state_dir), "--port-base",
              str(free_port_block(24)), "--postgres", "private", "--threads", "1", "--kv-cache-memory", "0.25", *extra,
              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    running = RunningStack(state_dir, json.loads((state_dir / "stack.json").read_text()))
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    os.environ.update({k: running.state["env"][k] for k in saved})
    try:
        yield running
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        _stop_and_check(running)


def _stop_and_check(running: RunningStack) -> None:
    """`stack down` must end every process group it started and free every port."""
    running.reload()
    groups = dict(running.state["processes"])
    down = tokenmill("stack", "down", "--state-dir", str(running.dir), check=False, timeout=180)
    assert down.returncode == 0, f"stack down reported problems:\n{down.stdout}\n{down.stderr}"
    module = stack_module()
    assert not [name for name, pgid in groups.items() if module.group_alive(pgid)], "orphan processes"
    ports = running.state["ports"]
    still_open = [p for p in [ports["kafka"], ports["redis"], ports["flower"], *range(ports["s3"], ports["s3"] + 8),
                              ports["postgres"]] if module.port_open(p)]
    assert not still_open, f"ports still open after stack down: {still_open}"
    assert not Path(running.state["postgres"]["dir"]).exists(), "the stack's own PostgreSQL cluster was left behind"


@pytest.fixture
def local_intake(sqlite_sessions, tmp_path: Path) -> tuple[Intake, list[str]]:
    """An intake into sqlite_sessions (inline rows under tmp_path/inline) and the job ids it hands out."""
    handed_out: list[str] = []
    return Intake(sqlite_sessions, S3Options(), handed_out.append, inline_uri=str(tmp_path / "inline")), handed_out


@pytest.fixture(scope="package")
def sessions(stack: RunningStack):
    factory = db.session_factory(db.make_engine(stack.database_url))
    yield factory
    factory.kw["bind"].dispose()


# ---- waiting on the stack -------------------------------------------------------------------------------

def stop_process_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process's group (started with start_new_session), SIGKILL if it outlives `timeout`."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_until(check, what: str, timeout: float = 120, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_row(sessions, job_id: str) -> dict | None:
    with sessions() as session:
        row = session.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}).mappings().one_or_none()
        return dict(row) if row else None


def shard_rows(sessions, job_id: str) -> list[dict]:
    with sessions() as session:
        rows = session.execute(text('SELECT * FROM shards WHERE job_id = :id ORDER BY "index"'), {"id": job_id})
        return [dict(r) for r in rows.mappings()]


def job_events(stack: RunningStack, job_id: str) -> list[dict]:
    """The events published for one job so far, in order."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer("tokenmill.job-events", bootstrap_servers=stack.bootstrap,
                             auto_offset_reset="earliest", consumer_timeout_ms=3000)
    try:
        return [json.loads(m.value) for m in consumer if m.key == job_id.encode()]
    finally:
        consumer.close()


def wait_for_job(sessions, job_id: str, timeout: float = 180) -> dict:
    """The job row once it reached a final status."""
    return wait_until(lambda: (row := job_row(sessions, job_id)) and row["status"] in TERMINAL and row,
                      f"job {job_id} to end", timeout)


def worker_pid(worker: str) -> int:
    """The PID in a claim's `worker` (`host:pid@boot.pidns.nonce`)."""
    from storage.liveness import WorkerIdentity

    identity = WorkerIdentity.parse(worker)
    assert identity is not None, f"not a worker identity: {worker!r}"
    return identity.pid


def wait_for_workers(stack: RunningStack, count: int = 2, timeout: float = 120) -> None:
    """Until `count` workers answer a ping: `count` shard nodes and as many control nodes (NAME-control), each
    `tokenmill worker` running one of each (the shard node answers while it still loads the model)."""
    from celery import Celery

    app = Celery(broker=stack.state["env"]["TOKENMILL_BROKER_URL"])
    suffix = f"{stack_module().CONTROL_NODE_SUFFIX}@"

    def answered() -> bool:
        try:
            nodes = [node for reply in app.control.ping(timeout=1.0) for node in reply]
            control = sum(suffix in node for node in nodes)
            return control >= count and len(nodes) - control >= count
        except Exception as error:  # Redis closed this client's connection (it just restarted): ask again
            if not is_transient(error):
                raise
            return False

    try:
        wait_until(answered, f"{count} workers", timeout, every=0.5)
    finally:
        app.close()


class HeldShardQueue:
    """A model's shard queue that the stack's workers take nothing from (`shards_held`): the shards they run go on,
    the messages sent meanwhile wait in the broker's lists (Redis, one list per priority level)."""

    def __init__(self, broker_url: str, queue: str) -> None:
        import redis

        self.redis, self.queue = redis.Redis.from_url(broker_url), queue

    def messages(self) -> int:
        keys = [self.queue, *self.redis.scan_iter(match=f"{self.queue}\x06\x16*")]
        return sum(self.redis.llen(key) for key in keys)

    def wait_for(self, more: int, since: int) -> None:
        """Until `more` messages were sent to it after it held `since`."""
        wait_until(lambda: self.messages() >= since + more, f"{more} more messages in {self.queue}", every=0.1)


@contextlib.contextmanager
def shards_held(stack: RunningStack, model: str = DEFAULT_MODEL) -> Iterator[HeldShardQueue]:
    """While inside, the workers consuming `model`'s shard queue take no new shard (Celery's cancel_consumer); they
    consume it again on leaving. Lets a test queue a job's shards behind or ahead of another's, whatever the speed
    of the machine."""
    from celery import Celery

    from ingest.config import model_slug

    broker_url = stack.state["env"]["TOKENMILL_BROKER_URL"]
    queue = f"{stack.state['env'].get('TOKENMILL_QUEUE_PREFIX', '')}gpu.{model_slug(model)}"
    app = Celery(broker=broker_url)
    try:
        def consuming() -> list[str]:
            """The workers that answered consuming the queue; a worker busy in its engine may answer late."""
            consumers = app.control.inspect(timeout=2).active_queues() or {}
            return [node for node, queues in consumers.items() if any(q["name"] == queue for q in queues)]

        nodes = wait_until(consuming, f"a worker consuming {queue} to answer", timeout=30, every=0.5)
        replies = app.control.cancel_consumer(queue, destination=nodes, reply=True, timeout=5)
        assert len(replies) == len(nodes), f"not every worker stopped consuming {queue}: {replies}"
        try:
            yield HeldShardQueue(broker_url, queue)
        finally:
            replies = app.control.add_consumer(queue, destination=nodes, reply=True, timeout=5)
            assert len(replies) == len(nodes), f"not every worker consumes {queue} again: {replies}"
    finally:
        app.close()


# ---- the README walkthrough --------------------------------------------------------------------------

README_WALKTHROUGH = """\
set -euo pipefail
eval "$(tokenmill stack env --show-secrets)"
JOB=$(tokenmill submit --via kafka --shard-size 10 --max-tokens 16 --wait)
tokenmill status "$JOB" --json > status.json
curl -fsu "$TOKENMILL_FLOWER_AUTH" "$TOKENMILL_FLOWER_URL/api/workers?refresh=1" > workers.json
psql "${TOKENMILL_DATABASE_URL/+psycopg/}" \\
     -c "SELECT job_id, status, requests_completed, shards_completed, round(tokens_per_s) AS tok_s FROM job_status" \\
     > job_status.txt
echo "$JOB"
"""


@dataclass
class SubmittedJob:
    id: str
    custom_ids: list[str]
    output_uri: str
    folder: Path  # what the walkthrough wrote: status.json, workers.json, job_status.txt
    shard_workers: dict[int, str]  # shard index -> the stack worker that ran it, read when the job ended


def submit_file(stack: RunningStack, path: Path, *args: str, via: str = "kafka") -> str:
    """`tokenmill submit` (without --wait), greedy (tests time their faults by answer lengths); the job id it
    prints."""
    done = stack.cli("submit", str(path), "--via", via, "--temperature", "0", *args)
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="package")
def kafka_job(stack: RunningStack, sessions, tmp_path_factory) -> SubmittedJob:
    """The README walkthrough, run by bash as written (the stack's state in $TOKENMILL_DATA/stack, the
    default place): the bundled 40 prompts submitted via Kafka in shards of 10, waited for."""
    folder = tmp_path_factory.mktemp("walkthrough")
    env = {**os.environ, "TOKENMILL_DATA": str(stack.dir.parent), "COLUMNS": "200",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", README_WALKTHROUGH], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, f"the README walkthrough failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    job_id = done.stdout.strip().splitlines()[-1]
    custom_ids = pq.read_table(sample_input(), columns=["custom_id"]).column(0).to_pylist()
    shard_workers = {s["index"]: stack.worker_of(worker_pid(s["worker"]))
                     for s in shard_rows(sessions, job_id)}
    return SubmittedJob(job_id, custom_ids, job_row(sessions, job_id)["output_uri"], folder, shard_workers)
