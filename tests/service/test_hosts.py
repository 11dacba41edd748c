"""Workers on several hosts, on the real stack: a third worker runs as host `hostb` (its own UTS namespace,
`unshare -u`) with its clock 60 s slow (libfaketime). Its leases are stamped and checked on PostgreSQL's clock,
so the other hosts' sweeps leave them alone; paused (SIGSTOP) past its lease, it loses its shard to another
worker, and once resumed (SIGCONT) it writes nothing and gives the attempt back. Each job ends completed with
every custom_id exactly once and no part file outside its manifest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.jobs.jobhelpers import prompt_rows, write_parquet
from tests.service.conftest import (
    STACK_ENV,
    shard_rows,
    stop_process_group,
    submit_file,
    wait_for_workers,
    wait_until,
)
from tests.service.test_restarts import assert_completed_once
from tokenmill.stack.hosts import start_host_worker

pytestmark = pytest.mark.real_model

HOST = "hostb"


@pytest.fixture
def skewed_host(stack, tmp_path):
    """`tokenmill worker` as host `hostb`, its clock 60 s behind the others' (probed), against the stack."""
    log = tmp_path / f"{HOST}.log"
    worker = start_host_worker(stack.dir, stack.state["model"], HOST, log, "-60s", {**stack.env, **STACK_ENV},
                               ("--threads", "1", "--kv-cache-memory", "0.25", "--shards-in-flight", "1"))
    try:
        wait_for_workers(stack, 3, timeout=180)
        assert_clock_moved(worker, -60.0)
        yield worker, log
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
        stop_process_group(worker, 30)


def assert_clock_moved(worker: subprocess.Popen, offset_s: float) -> None:
    """Every process of the host has libfaketime loaded, and a probe run with their LD_PRELOAD and FAKETIME reads
    a clock `offset_s` off this one's: the skew is real, not a setting that did nothing."""
    group = [pid for pid in os.listdir("/proc") if pid.isdigit() and process_group(pid) == worker.pid]
    assert worker.pid in map(int, group)
    for pid in group:
        assert "libfaketime" in Path(f"/proc/{pid}/maps").read_text(), f"no libfaketime in process {pid}"
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{worker.pid}/environ").read_text().split("\0")
                   if "=" in item)
    probe = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], capture_output=True, text=True,
                           env={**os.environ, "LD_PRELOAD": environ["LD_PRELOAD"], "FAKETIME": environ["FAKETIME"]},
                           timeout=60)
    assert probe.returncode == 0, probe.stderr[-2000:]
    offset = float(probe.stdout) - time.time()
    assert abs(offset - offset_s) < 10, f"the host's clock is {offset:+.0f} s off, not {offset_s:+.0f} s"


def process_group(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def hostb_shards(sessions, job_id: str, status: str | None = None) -> list[dict]:
    return [s for s in shard_rows(sessions, job_id)
            if (s["worker"] or "").startswith(f"{HOST}:") and status in (None, s["status"])]


def test_a_host_with_a_skewed_clock_keeps_its_leases_and_a_paused_one_gives_way(stack, sessions, skewed_host,
                                                                                   tmp_path) -> None:
    worker, log = skewed_host
    rows = prompt_rows(12, "hosts")
    path = write_parquet(tmp_path / "hosts.parquet", rows)
    job_id = submit_file(stack, path, "--output", f"{stack.bucket}/hosts-{uuid.uuid4().hex[:8]}", "--shard-size", "2",
                         "--max-tokens", "48")
    running = wait_until(lambda: hostb_shards(sessions, job_id, "running"), f"{HOST} to run a shard", timeout=240)[0]
    assert abs(time.time() - running["lease_expires_at"].timestamp() + 20) < 15, "not on the database's clock"

    os.killpg(worker.pid, signal.SIGSTOP)  # paused past its 20 s lease: the sweep hands its shard to another
    # the sweep first fences it (a new token, still naming the paused host), then another worker claims it
    taken = wait_until(lambda: next((s for s in shard_rows(sessions, job_id) if s["id"] == running["id"]
                                     and s["claim_token"] > running["claim_token"] and s["status"] != "pending"),
                                    None), "the paused host's shard to be claimed again", timeout=90, every=0.5)
    os.killpg(worker.pid, signal.SIGCONT)
    assert_completed_once(stack, sessions, job_id, rows["custom_id"], timeout=300)
    shards = shard_rows(sessions, job_id)
    assert all(s["status"] == "completed" for s in shards)
    retaken = [s for s in shards if s["claim_token"] > 1]
    assert [s["id"] for s in retaken] == [running["id"]], "only the paused shard may be claimed twice"
    assert not taken["worker"].startswith(f"{HOST}:")
    wait_until(lambda: next(s for s in shard_rows(sessions, job_id) if s["id"] == running["id"])["attempts"] == 1,
               "the paused host to give its attempt back", timeout=60)
    text = Path(log).read_text(errors="replace")
    assert f"shard {running['id']}: its claim (token {running['claim_token']}) was taken over" in text \
        or f"job {job_id}: shard {running['index']} was claimed by another worker" in text, "it did not notice"
