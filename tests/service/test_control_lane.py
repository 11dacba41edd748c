"""Control tasks on a lane of their own: `tokenmill worker` runs its shards in one Celery node (NAME@host, K threads
over the engine) and plan, finalize and the sweep in another (NAME-control@host, threads of its own, no engine), so
a worker whose every shard thread is busy still validates, plans and finalizes at once. The two nodes are children
of one supervisor: either one killed is started again, and neither outlives the supervisor.

Each test runs a worker of its own against the stack, on queues of its own (TOKENMILL_QUEUE_PREFIX), with one shard
thread; its engine stalls a row holding STALL until the test removes a flag file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from celery import Celery

from ingest.intake import submit
from storage.job_settings import CELERY
from tests.fixtures_services import REPO
from tests.jobs.jobhelpers import new_job, write_parquet
from tests.service.conftest import (
    STACK_ENV,
    job_row,
    shard_rows,
    stack_module,
    stop_process_group,
    wait_for_job,
    wait_until,
)
from tests.service.test_tensor_parallel_worker import alive, children_of

pytestmark = pytest.mark.real_model

STALL = "STALL-THIS-ROW"
STALL_FLAG_ENV = "TOKENMILL_TEST_STALL_FLAG"


def stalling_engine(settings: dict):
    """The service tests' engine (tests/service/faulty_engine.py), except that tokenizing a row holding STALL waits
    while the file $TOKENMILL_TEST_STALL_FLAG exists (5 minutes at most): a shard that holds its thread, idle."""
    from tests.service.faulty_engine import check_tokenizing, load

    def stall(text: str) -> None:
        if STALL in text:
            flag, deadline = Path(os.environ[STALL_FLAG_ENV]), time.monotonic() + 300
            while flag.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    return check_tokenizing(load(settings), stall)


@dataclass
class LaneWorker:
    process: subprocess.Popen  # the supervisor, leader of its own process group
    name: str
    prefix: str
    app: Celery  # a client of the stack's broker and result backend
    stall_flag: Path
    log: Path

    @property
    def control_queue(self) -> str:
        return f"{self.prefix}control"

    def nodes(self) -> set[str]:
        return {name for reply in self.app.control.ping(timeout=1.0) for name in reply}

    def children(self) -> dict[str, int]:
        """The supervisor's node processes by role (TOKENMILL_WORKER_CHILD)."""
        found = {}
        for pid in children_of(self.process.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            role = next((v.partition(b"=")[2].decode() for v in environ if v.startswith(b"TOKENMILL_WORKER_CHILD=")),
                        None)
            if role:
                found[role] = pid
        return found



@pytest.fixture
def lane_worker(stack, tmp_path) -> Iterator[LaneWorker]:
    """`tokenmill worker` with one shard thread on queues of its own; once its shard node answers a ping."""
    prefix, name = f"lane-{uuid.uuid4().hex[:6]}.", f"lane{uuid.uuid4().hex[:6]}"
    flag, log = tmp_path / "stall", tmp_path / "worker.log"
    env = {**stack.env, **STACK_ENV, "TOKENMILL_QUEUE_PREFIX": prefix, STALL_FLAG_ENV: str(flag)}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tokenmill", "worker", "--name", name, "--threads", "1",
                                    "--engine-factory", "tests.service.test_control_lane:stalling_engine",
                                    "--kv-cache-memory", "0.25", "--shards-in-flight", "1", "--state-dir",
                                    str(stack.dir)], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    broker = stack.state["env"]["TOKENMILL_BROKER_URL"]
    worker = LaneWorker(process, name, prefix, Celery(broker=broker, backend=broker), flag, log)
    try:
        wait_until(lambda: f"{name}@{socket.gethostname()}" in worker.nodes(), "the worker's shard node", 120, 0.5)
        yield worker
    finally:
        flag.unlink(missing_ok=True)
        if process.poll() is None:
            stop_process_group(process, 30)
        worker.app.close()


def new_celery_job(stack, sessions, tmp_path: Path, what: str, prompts: list[str]) -> str:
    path = write_parquet(tmp_path / f"{what}.parquet", {"custom_id": [f"{what}-{i}" for i in range(len(prompts))],
                                                        "prompt": prompts},
                         schema=pa.schema([("custom_id", pa.string()), ("prompt", pa.string())]))
    stack.store(f"{stack.bucket}/lane").put_file(f"{what}-{tmp_path.name}.parquet", path)
    job = new_job(f"{stack.bucket}/lane/{what}-{tmp_path.name}.parquet",
                  f"{stack.bucket}/lane-out/{what}-{uuid.uuid4().hex[:8]}", "smollm2-135m", s3=stack.s3,
                  executor=CELERY, sampling={"max_tokens": 4, "temperature": 0})
    return submit(sessions, job).job.id


def test_control_tasks_run_while_every_shard_thread_is_busy(stack, sessions, lane_worker, tmp_path) -> None:
    worker = lane_worker
    worker.stall_flag.touch()
    busy = new_celery_job(stack, sessions, tmp_path, "busy", [f"{STALL}: say hello"])
    worker.app.send_task("tokenmill.plan_job", args=[busy], queue=worker.control_queue)
    wait_until(lambda: [s for s in shard_rows(sessions, busy) if s["status"] == "running"],
               "the busy job's shard to hold the worker's one shard thread", timeout=180, every=0.2)

    # an empty job needs a plan and a finalize, both control tasks; the shard thread stays busy meanwhile
    empty = new_celery_job(stack, sessions, tmp_path, "empty", [])
    sent = time.monotonic()
    planned = worker.app.send_task("tokenmill.plan_job", args=[empty], queue=worker.control_queue)
    try:
        planned.get(timeout=20)
    except Exception as error:
        pytest.fail(f"plan_job did not run within 20 s of being sent while the shard thread was busy: {error!r}")
    done = wait_for_job(sessions, empty, timeout=20)
    took = time.monotonic() - sent
    print(f"the empty job was planned and finalized in {took:.1f} s")
    assert done["status"] == "completed", done["error"]
    assert [s["status"] for s in shard_rows(sessions, busy)] == ["running"], "the shard thread was not busy throughout"
    assert took < 20

    worker.stall_flag.unlink()  # the stalled shard goes on: the worker still runs shards
    finished = wait_for_job(sessions, busy, timeout=180)
    assert finished["status"] == "completed", finished["error"]
    assert job_row(sessions, empty)["status"] == "completed"

    os.killpg(worker.process.pid, signal.SIGTERM)  # as `stack down` stops it: both nodes end, none needs SIGKILL
    worker.process.wait(60)
    wait_until(lambda: not stack_module().group_alive(worker.process.pid), "the worker's nodes to end", 30, 0.2)


def test_the_two_nodes_are_started_again_alone_and_end_with_their_supervisor(stack, lane_worker) -> None:
    worker = lane_worker
    host = socket.gethostname()
    nodes = {f"{worker.name}@{host}", f"{worker.name}-control@{host}"}
    wait_until(lambda: nodes <= worker.nodes(), "both nodes to answer", 60, 0.5)
    children = wait_until(lambda: (found := worker.children()).keys() == {"engine", "control"} and found,
                          "the supervisor's two node processes", 30, 0.2)

    os.kill(children["control"], signal.SIGKILL)  # the control node alone: started again, the shard node untouched
    restarted = wait_until(lambda: (found := worker.children()).get("control") not in (None, children["control"])
                           and found, "the control node to be started again", 60, 0.2)
    assert restarted["engine"] == children["engine"]
    wait_until(lambda: nodes <= worker.nodes(), "the new control node to answer", 60, 0.5)

    os.kill(worker.process.pid, signal.SIGKILL)  # the supervisor alone: its nodes must not run on as orphans
    worker.process.wait()
    wait_until(lambda: not any(alive(pid) for pid in restarted.values()), "both nodes to end with the supervisor",
               60, 0.2)
