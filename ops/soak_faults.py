"""Soak run of the service under faults: N small jobs on a running stack (`tokenmill stack up`), faults injected at
random times while they run, then every job's outputs checked row by row.

    python ops/soak_faults.py [--state-dir DIR] [--jobs 8] [--rows 12] [--faults 6] [--seed 1] [--hosts 1 --skew 60]

Faults (picked at random): redis-restart, redis-flushall, tansu-restart, seaweedfs-outage (15 s), and SIGKILL of
the consumer, the watcher, beat or a worker (each started again the way `stack up` started it). With `--hosts N`,
N more workers run as simulated hosts (`tokenmill.stack.hosts`: their own hostname, clocks `--skew` seconds
off, alternately slow and fast), and pause-host stops one with SIGSTOP past its lease, then resumes it. Prints
the faults injected, jobs completed, rows lost, rows duplicated and part files outside a manifest (the goal: 0, 0
and 0). Exit status 1 when a row was lost or duplicated, a part was left over or a job did not end."""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TERMINAL = {"completed", "failed", "cancelled", "expired"}
FAULTS = ("redis-restart", "redis-flushall", "tansu-restart", "seaweedfs-outage", "kill-consumer", "kill-watcher",
          "kill-beat", "kill-worker")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, help="the stack's state directory (default: $TOKENMILL_DATA/stack)")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rows", type=int, default=12, help="rows per job (shards of 2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--faults", type=int, default=6, help="faults to inject")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the jobs to end")
    parser.add_argument("--hosts", type=int, default=0, help="extra workers, each a simulated host")
    parser.add_argument("--skew", type=float, default=60, help="their clock offsets, in seconds")
    args = parser.parse_args()

    from storage.db import data_dir
    from tokenmill.stack import local_stack as stack_module

    state_dir = args.state_dir or data_dir() / "stack"
    state = json.loads((state_dir / "stack.json").read_text())
    os.environ.update(state["env"])
    from ingest.config import ServiceConfig
    from ingest.submit import submit_job
    from storage import db

    rng = random.Random(args.seed)
    config = ServiceConfig.from_env()
    sessions = db.session_factory(db.make_engine(os.environ["TOKENMILL_DATABASE_URL"]))
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    expected: dict[str, list[str]] = {}
    tag = f"soak-{int(time.time())}"

    def submit(index: int) -> None:
        ids = [f"{tag}-{index}-{row}" for row in range(args.rows)]
        path = work / f"{tag}-{index}.jsonl"
        path.write_text("".join(json.dumps({"custom_id": cid, "prompt": f"Count to {row}."}) + "\n"
                                for row, cid in enumerate(ids)))
        done = submit_job(str(path), rng.choice(("kafka", "s3")), config, f"{config.bucket_uri}/{tag}/{index}",
                          shard_size=2, sampling={"max_tokens": args.max_tokens})
        expected[done.job_id] = ids

    hosts = start_hosts(state_dir, state, args.hosts, args.skew, work)
    faults = FAULTS + (("pause-host",) if hosts else ())
    injected: list[str] = []
    started = time.monotonic()
    fault_times = sorted(rng.uniform(2, 20 + 6 * args.jobs) for _ in range(args.faults))
    for index in range(args.jobs):
        submit(index)
    for at in fault_times:
        time.sleep(max(0.0, started + at - time.monotonic()))
        fault = rng.choice(faults)
        inject(fault, state_dir, stack_module, rng.choice(hosts) if hosts else None)
        injected.append(fault)
        print(f"{time.monotonic() - started:6.1f} s  {fault}", flush=True)

    deadline = time.monotonic() + args.timeout
    statuses: dict[str, str] = {}
    while time.monotonic() < deadline:
        statuses = job_statuses(sessions, list(expected))
        if all(s in TERMINAL for s in statuses.values()):
            break
        time.sleep(2)
    for host in hosts:
        stop_host(host)
    lost = duplicated = left_over = 0
    for job_id, ids in expected.items():
        if statuses.get(job_id) != "completed":
            continue
        committed, found, parts = output_ids(sessions, job_id)
        seen = collections.Counter(committed)
        lost += sum(1 for cid in ids if seen[cid] == 0)
        duplicated += sum(count - 1 for count in seen.values() if count > 1)
        left_over += len(set(found) - set(parts))
    counts = collections.Counter(statuses.values())
    kinds = ", ".join(f"{kind} x{n}" for kind, n in collections.Counter(injected).items())
    print(f"faults injected: {len(injected)} ({kinds})")
    print(f"jobs completed: {counts['completed']} of {len(expected)}"
          + "".join(f", {status}: {n}" for status, n in counts.items() if status != "completed"))
    print(f"rows lost: {lost}")
    print(f"rows duplicated: {duplicated}")
    print(f"part files outside a manifest: {left_over}")
    print(f"extra hosts: {args.hosts}, clocks {', '.join(host_offset(i, args.skew) for i in range(args.hosts))}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return 0 if lost == duplicated == left_over == 0 and all(s in TERMINAL for s in statuses.values()) else 1


def start_hosts(state_dir: Path, state: dict, count: int, skew: float, work: Path) -> list:
    from tokenmill.stack.hosts import start_host_worker

    hosts = [start_host_worker(state_dir, state["model"], f"host{i + 1}", work / f"host{i + 1}.log",
                               host_offset(i, skew), state["env"],
                               ("--threads", "1", "--kv-cache-memory", "0.25", "--shards-in-flight", "1"))
             for i in range(count)]
    if hosts:
        time.sleep(30)  # their models load
    return hosts


def stop_host(host) -> None:
    """SIGTERM to the simulated host's process group (resumed first, should it be paused), SIGKILL after 30 s."""
    import subprocess

    for sig in (signal.SIGCONT, signal.SIGTERM):
        os.killpg(host.pid, sig)
    try:
        host.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait()


def host_offset(index: int, skew: float) -> str:
    """The clock offset of the index-th simulated host: alternately slow and fast."""
    return f"{'-' if index % 2 == 0 else '+'}{skew:.0f}s"


def inject(fault: str, state_dir: Path, stack_module, host=None) -> None:
    stack = stack_module.Stack(state_dir)
    if fault == "pause-host":
        lease = float(stack.state["env"].get("TOKENMILL_LEASE_S") or 120)
        os.killpg(host.pid, signal.SIGSTOP)
        time.sleep(lease + 5)
        os.killpg(host.pid, signal.SIGCONT)
    elif fault == "redis-restart":
        stack_module.restart(state_dir, "redis")
    elif fault == "redis-flushall":
        import redis

        redis.Redis(port=stack.state["ports"]["redis"]).flushall()
    elif fault == "tansu-restart":
        kafka_dir, port = str(state_dir / "kafka"), str(stack.state["ports"]["kafka"])
        stack.script("kafka", "stop", kafka_dir)
        stack.script("kafka", "start", kafka_dir, port, stack_module.JOBS_TOPIC, stack_module.EVENTS_TOPIC)
    elif fault == "seaweedfs-outage":
        weed_dir, port = str(state_dir / "seaweedfs"), str(stack.state["ports"]["s3"])
        stack.script("seaweedfs", "stop", weed_dir)
        time.sleep(15)
        stack.script("seaweedfs", "start", weed_dir, port)
    else:
        name = {"kill-consumer": "consumer", "kill-watcher": "watcher", "kill-beat": "beat",
                "kill-worker": "worker1"}[fault]
        try:
            os.killpg(stack.state["processes"][name], signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(1)
        stack_module.restart(state_dir, name)


def job_statuses(sessions, job_ids: list[str]) -> dict[str, str]:
    from sqlalchemy import select

    from storage.models import Job

    try:
        with sessions() as session:
            return dict(session.execute(select(Job.id, Job.status).where(Job.id.in_(job_ids))).all())
    except Exception as error:  # the database restarting: ask again
        print(f"(database: {error})", file=sys.stderr)
        return {}


def output_ids(sessions, job_id: str) -> tuple[list[str], list[str], list[str]]:
    """The custom_ids in a completed job's committed outputs (its manifest's parts and its error file), the
    part files under its prefix and those its manifest lists."""
    from storage import repository as repo
    from storage.formats import ERRORS_KEY, MANIFEST_KEY, read_part
    from storage.objectstore import open_store

    with sessions() as session:
        job = repo.get_job(session, job_id)
    store = open_store(job.output_uri, job.settings.s3)
    manifest = json.loads(store.get_bytes(MANIFEST_KEY))
    ids = [row["custom_id"] for part in manifest["files"]["parts"]
           for row in read_part(store, part["key"]).to_pylist() if row["choice_index"] == 0]
    errors = store.get_bytes(ERRORS_KEY).decode().splitlines() if store.exists(ERRORS_KEY) else []
    found = [key for key in store.list("part-")]
    return (ids + [json.loads(line)["custom_id"] for line in errors if line.strip()], found,
            [part["key"] for part in manifest["files"]["parts"]])


if __name__ == "__main__":
    sys.exit(main())
