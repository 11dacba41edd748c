"""Worker identity across containers that share a hostname (Docker `--network host`, Kubernetes `hostNetwork`)
but not PIDs: a holder's PID is probed only where it names a process here (same host, boot and PID namespace);
elsewhere only its lease counts, and an equal PID in another namespace is never "me". The other namespaces here
are real ones (`unshare --pid`, which needs root or user namespaces)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

from storage.liveness import holder_alive, worker_id
from storage.models import utcnow
from tests.service.test_shard_claims import make_job, set_shard, shard_ids
from workers.sweep import sweep

REPO = Path(__file__).resolve().parents[2]

# in a fresh PID namespace (python is PID 1 there): fork until a child gets PID argv[1], which prints its worker id
WORKER_ID_AT_PID = """
import os, sys
from storage.liveness import worker_id
wanted = int(sys.argv[1])
while True:
    child = os.fork()
    if child == 0:
        if os.getpid() == wanted:
            print(worker_id(), flush=True)
        os._exit(0)
    os.waitpid(child, 0)
    if child >= wanted:
        break
"""

CLAIM_SHARD = """
import sys
from storage import db
from workers.job_steps import JobSteps
from workers.shard_step import ShardStep
sessions = db.session_factory(db.make_engine(sys.argv[1]))
print(ShardStep(JobSteps(sessions, sys.argv[2])).claim_shard(int(sys.argv[3]), max_attempts=3).decision)
"""


IN_NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def in_new_pid_namespace(script: str, *args: str) -> str:
    """Run a Python script as PID 1 of a PID namespace of its own (same host, same boot); its stdout."""
    done = subprocess.run([*IN_NEW_PID_NAMESPACE, script, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no PID namespaces here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@contextmanager
def live_worker_in_new_pid_namespace() -> Iterator[str]:
    """A process that is PID 1 of a PID namespace of its own, alive (and so its namespace) until the block ends;
    its worker id. (A namespace's id is reused once it ends.)"""
    script = "import sys; from storage.liveness import worker_id; print(worker_id(), flush=True); sys.stdin.read()"
    process = subprocess.Popen([*IN_NEW_PID_NAMESPACE, script], cwd=REPO, env=ENV, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = process.stdout.readline().strip()
        if not worker:
            pytest.skip(f"no PID namespaces here: {process.stderr.read().strip()}")
        yield worker
    finally:
        process.stdin.close()
        process.wait(timeout=30)


def pid_dead_here(start: int = 2) -> int:
    return next(pid for pid in range(start, 1 << 22) if not os.path.exists(f"/proc/{pid}"))


def test_a_dead_pid_from_another_pid_namespace_keeps_its_lease(sqlite_sessions) -> None:
    """Another container on this hostname holds a shard as PID p, a PID that names no process here: its lease
    holds until it lapses, and the sweep leaves the shard alone."""
    pid = pid_dead_here()
    holder = in_new_pid_namespace(WORKER_ID_AT_PID, str(pid))
    print("holder from another PID namespace:", holder, "- us:", worker_id())
    assert holder.startswith(f"{os.uname().nodename}:{pid}")
    assert not os.path.exists(f"/proc/{pid}"), "the PID was taken here meanwhile"
    now = utcnow()
    assert holder_alive(holder, now + timedelta(minutes=1), now), "fenced a live holder of another namespace"
    assert not holder_alive(holder, now, now), "its lease lapsed"

    job_id = make_job(sqlite_sessions, shards=1)
    shard = shard_ids(sqlite_sessions, job_id)[0]
    set_shard(sqlite_sessions, shard, status="running", attempts=1, worker=holder,
              lease_expires_at=now + timedelta(hours=1))
    assert sweep(sqlite_sessions, now=now).requeue == []


def test_equal_pids_in_two_pid_namespaces_are_not_one_worker(sqlite_sessions, tmp_path) -> None:
    """Two containers on one hostname, each its worker as PID 1: one's live claim is not the other's own stale
    one, so the other finds the shard busy instead of taking it over."""
    job_id = make_job(sqlite_sessions, status="in_progress", shards=1)
    shard = shard_ids(sqlite_sessions, job_id)[0]
    with live_worker_in_new_pid_namespace() as holder:
        print("holder (PID 1 of one namespace):", holder)
        set_shard(sqlite_sessions, shard, status="running", attempts=1, claim_token=1, worker=holder,
                  lease_expires_at=utcnow() + timedelta(hours=1))
        decision = in_new_pid_namespace(CLAIM_SHARD, f"sqlite:///{tmp_path / 'jobs.db'}", job_id, str(shard))
    print("PID 1 of another namespace, claiming it:", decision)
    assert decision == "busy", "took over a live claim of an equal PID in another namespace"


def test_our_pid_with_another_nonce_is_an_earlier_process_not_us() -> None:
    """Our PID, boot and namespace but another process's nonce: that process held our PID before us, so it is
    gone (its lease ends now); our own id keeps its lease; a forked child is someone else."""
    from storage.liveness import WorkerIdentity, this_worker

    me, now = this_worker(), utcnow()
    earlier = str(WorkerIdentity(me.host, me.pid, me.boot, me.pid_namespace, "0" * 12))
    until = now + timedelta(hours=1)
    print("us:", me, "- earlier holder of our PID:", earlier)
    assert holder_alive(str(me), until, now)
    assert not holder_alive(earlier, until, now)
    elsewhere = str(WorkerIdentity(me.host, me.pid, me.boot, "1", "0" * 12))
    assert holder_alive(elsewhere, until, now), "our PID in another namespace: only its lease counts"

    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(writer, worker_id().encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    forked = os.read(reader, 200).decode()
    os.close(reader)
    assert forked != worker_id() and forked.startswith(f"{me.host}:{child}@")


def test_a_dead_pid_in_our_namespace_ends_its_lease_at_once(sqlite_sessions) -> None:
    """The positive control: a worker of this host, boot and PID namespace that exited lets go at once, lease or
    not, and the sweep requeues its shard; so does an older worker's `host:pid`."""
    done = subprocess.run([sys.executable, "-c", "from storage.liveness import worker_id; print(worker_id())"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          check=True, timeout=120)
    exited = done.stdout.strip()
    print("an exited worker of our namespace:", exited)
    now = utcnow()
    assert not holder_alive(exited, now + timedelta(hours=1), now)
    old_format = exited.partition("@")[0]
    assert not holder_alive(old_format, now + timedelta(hours=1), now)
    assert holder_alive(f"other-host:{exited.partition(':')[2]}", now + timedelta(hours=1), now)

    job_id = make_job(sqlite_sessions, shards=1)
    shard = shard_ids(sqlite_sessions, job_id)[0]
    set_shard(sqlite_sessions, shard, status="running", attempts=1, worker=exited,
              lease_expires_at=now + timedelta(hours=1))
    assert sweep(sqlite_sessions, now=now).requeue == [(job_id, shard, "m")]
