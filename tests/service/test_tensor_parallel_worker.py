"""`tokenmill worker --tensor-parallel-size 3` on the real stack: one Celery worker whose engine spans three
processes (SmolLM2-135M's 9 heads and 3 KV heads refuse 2) runs a job to completion; then one of its ranks is
killed mid-job, the worker's engine goes down with its process, and the stack's other workers take its shards
over, every custom_id once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import (
    REPO,
    STACK_ENV,
    shard_rows,
    stack_module,
    submit_file,
    wait_for_job,
    wait_for_workers,
    wait_until,
    worker_pid,
)

pytestmark = pytest.mark.real_model
STACK_WORKERS = ("worker1", "worker2")


def pid_of(shard: dict) -> int:
    return worker_pid(shard["worker"])


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def start_tp_worker(stack, log: Path) -> subprocess.Popen:
    """A worker of its own (no supervisor: it is not started again once its engine is down)."""
    command = [sys.executable, "-m", "tokenmill", "worker", "--name", "tp3", "--model", "smollm2-135m",
               "--tensor-parallel-size", "3", "--threads", "1", "--kv-cache-memory", "0.25",
               "--state-dir", str(stack.dir)]
    env = {**stack.env, **STACK_ENV, "TOKENMILL_WORKER_CHILD": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def test_a_tp3_worker_runs_jobs_and_a_dead_rank_hands_its_shards_over(stack, sessions, tmp_path) -> None:
    module = stack_module()
    for name in STACK_WORKERS:  # the TP worker alone takes the first job's shards
        module.stop_group(stack.state["processes"][name])
    worker = start_tp_worker(stack, tmp_path / "tp-worker.log")
    try:
        first = prompt_rows(6, "tp")
        job_id = submit_file(stack, write_parquet(tmp_path / "first.parquet", first), "--shard-size", "2",
                             "--max-tokens", "8")
        job = wait_for_job(sessions, job_id, timeout=240)
        assert job["status"] == "completed", job["error"]
        assert {pid_of(s) for s in shard_rows(sessions, job_id)} == {worker.pid}
        assert_each_id_once(stack.store(job["output_uri"]), first["custom_id"])

        second = prompt_rows(8, "tpkill")
        job_id = submit_file(stack, write_parquet(tmp_path / "second.parquet", second), "--shard-size", "2",
                             "--max-tokens", "48")
        running = wait_until(lambda: [s for s in shard_rows(sessions, job_id) if s["status"] == "running"],
                             "a shard running on the TP worker", timeout=120, every=0.05)
        ranks = [pid for pid in children_of(worker.pid)
                 if b"engine.distributed.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 2
        os.kill(ranks[0], signal.SIGKILL)
        assert worker.wait(60) == 75, "the worker's engine must go down with its process"
        wait_until(lambda: not any(alive(pid) for pid in ranks), "the other ranks to exit", 10)
        for name in STACK_WORKERS:
            module.restart(stack.dir, name)
        stack.reload()
        wait_for_workers(stack)
        job = wait_for_job(sessions, job_id, timeout=240)
        assert job["status"] == "completed", job["error"]
        shards = {s["index"]: s for s in shard_rows(sessions, job_id)}
        for victim in running:
            redone = shards[victim["index"]]
            assert redone["status"] == "completed" and pid_of(redone) != worker.pid
        assert_each_id_once(stack.store(job["output_uri"]), second["custom_id"])
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        stack.reload()
        for name in STACK_WORKERS:
            if name not in module.Stack(stack.dir).running():
                module.restart(stack.dir, name)
        stack.reload()
        wait_for_workers(stack)
