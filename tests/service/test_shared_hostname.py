"""Containers with host networking, on the real stack: two more workers on the stack's own hostname, each in a PID
namespace of its own (`unshare --pid`, its supervisor PID 1 and its worker PID 2 in both). Their PIDs mean nothing
to each other or to the stack's workers, so no sweep fences a live shard and no worker takes one over as its own
stale claim: the job completes with every custom_id once, no part outside its manifest, and each shard claimed
once."""

from __future__ import annotations

import socket
import uuid

import pytest

from tests.jobs.jobhelpers import prompt_rows, write_parquet
from tests.service.conftest import STACK_ENV, shard_rows, stop_process_group, submit_file, wait_for_workers, wait_until
from tests.service.test_restarts import assert_completed_once
from tokenmill.stack.hosts import start_host_worker

pytestmark = pytest.mark.real_model

CONTAINERS = ("container-a", "container-b")


@pytest.fixture
def containers(stack, tmp_path):
    """Two `tokenmill worker`s on this hostname, each in its own PID namespace; their logs."""
    host = socket.gethostname()
    logs = {name: tmp_path / f"{name}.log" for name in CONTAINERS}
    workers = [start_host_worker(stack.dir, stack.state["model"], host, logs[name], env={**stack.env, **STACK_ENV},
                                 worker_args=("--threads", "1", "--kv-cache-memory", "0.25", "--shards-in-flight",
                                              "1"), name=name, own_pids=True)
               for name in CONTAINERS]
    try:
        wait_for_workers(stack, 4, timeout=240)
        wait_until(lambda: all("loaded" in log.read_text(errors="replace") for log in logs.values()),
                   "the containers' models to load", timeout=240, every=1)
        yield logs
    finally:
        for worker in workers:
            stop_process_group(worker, 30)


def test_workers_sharing_a_hostname_in_separate_pid_namespaces_take_no_live_claim(stack, sessions, containers,
                                                                                 tmp_path) -> None:
    rows = prompt_rows(240, "shared-host")
    path = write_parquet(tmp_path / "shared-host.parquet", rows)
    job_id = submit_file(stack, path, "--output", f"{stack.bucket}/shared-host-{uuid.uuid4().hex[:8]}",
                         "--shard-size", "8", "--max-tokens", "8")
    job = assert_completed_once(stack, sessions, job_id, rows["custom_id"], timeout=600)
    shards = shard_rows(sessions, job_id)
    print(f"job {job_id}: {job['status']}; claim tokens {[s['claim_token'] for s in shards]}")
    print("workers:", sorted({s["worker"] for s in shards}))
    assert all(s["status"] == "completed" for s in shards)
    retaken = [(s["index"], s["claim_token"]) for s in shards if s["claim_token"] != 1]  # a takeover fences: 3
    assert not retaken, f"shards claimed more than once (shard, claim token): {retaken}"
    ran = {name: sum("tokenmill.run_shard[" in line and "'decision': 'completed'" in line
                     for line in log.read_text(errors="replace").splitlines()) for name, log in containers.items()}
    print("shards each container completed:", ran)
    assert all(ran.values()), "a container ran no shard"
