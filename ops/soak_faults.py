"""Soak run of the service under faults: N small jobs on a running stack (`tokenmill stack up`), faults injected at
random times while they run, then every job's outputs checked row by row.

    python ops/soak_faults.py [--state-dir DIR] [--jobs 8] [--rows 12] [--faults 6] [--seed 1] [--hosts 1 --skew 60]
                              [--fault-list postgres-restart,pause-worker-upload] [--min-hits N]

Faults (picked at random, or named in order by `--fault-list`): redis-restart, redis-flushall, redis-pause
(SIGSTOP past a lease), tansu-restart, seaweedfs-outage (15 s), seaweedfs-long-outage (longer than the workers'
outage wait), SIGKILL of the consumer, the watcher, beat or a worker (each started again the way `stack up`
started it), cancel-job (a running soak job cancelled: it may end cancelled), and two at a step's own fault point
(`storage.faults`, armed through the stack's TOKENMILL_FAULT_DIR): pause-worker-upload, the next worker to reach
`before_part_upload` (between noting its part's key and the PUT) stops itself with SIGSTOP and is resumed after
its lease + 5 s; kill-during-finalize, the next process to finalize a job SIGKILLs itself in the middle.
On a stack with a PostgreSQL cluster of its own (`tokenmill stack up --postgres private`) also postgres-restart
(pg_ctl restart, fast) and postgres-partition: every process of the cluster stopped with SIGSTOP for the lease +
5 s, then resumed (clients hang as in a network partition; the server does not restart). With `--hosts N`, N
more workers run as simulated hosts (`tokenmill.stack.hosts`: their own hostname, clocks `--skew` seconds off,
alternately slow and fast), and pause-host stops one with SIGSTOP past its lease, then resumes it.

A fault waits for running work: until a soak job has a shard running (pause-worker-upload: until a worker took
the pause); should every soak job have ended, one more is submitted. Just before each injection the
database is asked again: the summary counts the faults that hit running work (a fault on a running shard's
worker or host, or on a service it uses: the database, the broker, the store; not the consumer, watcher or beat).
Prints the faults injected (and how many hit running work), jobs completed, rows lost, rows duplicated and part
files outside a manifest (the goal: 0, 0 and 0), checked for every job. Exit status 1 when a row was lost or
duplicated, a part was left over, a job ended otherwise than completed (no soak job is cancelled or has a
deadline) or did not end, or fewer than `--min-hits` faults hit running work."""

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
FAULTS = ("redis-restart", "redis-flushall", "redis-pause", "tansu-restart", "seaweedfs-outage",
          "seaweedfs-long-outage", "kill-consumer", "kill-watcher", "kill-beat", "kill-worker", "pause-worker-upload",
          "kill-during-finalize", "cancel-job")
POSTGRES_FAULTS = ("postgres-restart", "postgres-partition")  # on a stack's own cluster only
# the faults that touch a running shard: its worker's process or host, or a service it uses while it runs (the
# database, the broker it acknowledges through, the store its part goes to); killing the consumer, the watcher or
# beat is no hit, nor is a fault while only a plan or finalize step is held
HITS_RUNNING_SHARDS = {"redis-restart", "redis-flushall", "redis-pause", "seaweedfs-outage", "seaweedfs-long-outage",
                       "kill-worker", "pause-worker-upload", "postgres-restart", "postgres-partition", "pause-host",
                       "cancel-job"}
# faults at a step's own pause or crash point (storage.faults), armed through the stack's TOKENMILL_FAULT_DIR
AT_POINTS = {"pause-worker-upload": ("pause", "before_part_upload"),
             "kill-during-finalize": ("crash", "during_finalize")}
WORK_WAIT_S = 120  # how long a fault waits for running work before it is injected anyway (and counts as a miss)


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
    parser.add_argument("--fault-list", help="comma-separated faults to inject in this order (instead of --faults "
                                             "drawn at random)")
    parser.add_argument("--min-hits", type=int, default=0,
                        help="exit 1 when fewer faults than this hit running work (default 0)")
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
    may_end_cancelled: set[str] = set()  # the jobs cancel-job cancelled: they end cancelled, or completed first
    tag = f"soak-{int(time.time())}"

    def submit(index: int) -> None:
        ids = [f"{tag}-{index}-{row}" for row in range(args.rows)]
        path = work / f"{tag}-{index}.jsonl"
        path.write_text("".join(json.dumps({"custom_id": cid, "prompt": f"Count to {row}."}) + "\n"
                                for row, cid in enumerate(ids)))
        done = submit_job(str(path), rng.choice(("kafka", "s3")), config, f"{config.bucket_uri}/{tag}/{index}",
                          shard_size=2, sampling={"max_tokens": args.max_tokens})
        expected[done.job_id] = ids

    own_postgres = "postgres" in state
    faults = FAULTS + (POSTGRES_FAULTS if own_postgres else ()) + (("pause-host",) if args.hosts else ())
    if not own_postgres:
        print("PostgreSQL faults left out: the stack's database is a server it does not own "
              "(`tokenmill stack up --postgres private` runs a cluster of its own)", flush=True)
    chosen = args.fault_list.split(",") if args.fault_list else None
    if chosen and (unknown := [f for f in chosen if f not in faults]):
        parser.error(f"faults not available on this stack: {', '.join(unknown)} (available: {', '.join(faults)})")
    hosts = start_hosts(state_dir, state, args.hosts, args.skew, work)
    injected: list[tuple[str, bool]] = []  # (fault, whether it hit running work)
    started = time.monotonic()
    fault_times = sorted(rng.uniform(2, 20 + 6 * args.jobs) for _ in range(len(chosen) if chosen else args.faults))
    for index in range(args.jobs):
        submit(index)

    def top_up() -> None:
        """Every soak job ended with faults still to come: one more job, so they land on running work."""
        submit(len(expected))
        print(f"{time.monotonic() - started:6.1f} s  (every job had ended: job {len(expected)} submitted)", flush=True)

    for number, at in enumerate(fault_times):
        time.sleep(max(0.0, started + at - time.monotonic()))
        fault = chosen[number] if chosen else rng.choice(faults)
        if fault in AT_POINTS:  # the process pauses or kills itself at the step (storage.faults)
            hit = (at_point(*AT_POINTS[fault], state_dir, stack_module, sessions, expected, top_up, started)
                   and fault in HITS_RUNNING_SHARDS)
        elif fault == "cancel-job":
            wait_for_work(sessions, expected, top_up)
            hit = cancel_running_job(sessions, expected, may_end_cancelled, started)
        else:
            running = wait_for_work(sessions, expected, top_up)
            hit = bool(running and running[0]) and fault in HITS_RUNNING_SHARDS  # the database's answer just before
            shown = (f"{running[0]} shard(s) running, {running[1]} step(s) held" if running
                     else "database not answering") + ("" if hit else ": no hit")
            print(f"{time.monotonic() - started:6.1f} s  {fault}  ({shown})", flush=True)
            inject(fault, state_dir, stack_module, rng.choice(hosts) if hosts else None)
        injected.append((fault, hit))

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
    for job_id, ids in expected.items():  # every job, whatever it ended as: its rows once at most, no strays
        committed, found, parts = output_ids(sessions, job_id)
        seen = collections.Counter(committed)
        if statuses.get(job_id) == "completed":
            lost += sum(1 for cid in ids if seen[cid] == 0)
        duplicated += sum(count - 1 for count in seen.values() if count > 1)
        left_over += len(set(found) - set(parts))
    counts = collections.Counter(statuses.values())
    unexpected = sum(1 for job_id in expected  # a job ends completed, or cancelled when the soak cancelled it
                     if statuses.get(job_id) != "completed"
                     and not (job_id in may_end_cancelled and statuses.get(job_id) == "cancelled"))
    kinds = ", ".join(f"{kind} x{n}" for kind, n in collections.Counter(f for f, _ in injected).items())
    hits = sum(hit for _, hit in injected)
    print(f"faults injected: {len(injected)} ({kinds})")
    print(f"faults that hit running work: {hits} of {len(injected)}")
    print(f"jobs completed: {counts['completed']} of {len(expected)}"
          + "".join(f", {status}: {n}" for status, n in counts.items() if status != "completed"))
    print(f"jobs that ended otherwise than completed: {unexpected}")
    print(f"rows lost: {lost}")
    print(f"rows duplicated: {duplicated}")
    print(f"part files outside a manifest: {left_over}")
    print(f"extra hosts: {args.hosts}, clocks {', '.join(host_offset(i, args.skew) for i in range(args.hosts))}")
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return 0 if lost == duplicated == left_over == unexpected == 0 and hits >= args.min_hits else 1


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


def wait_for_work(sessions, expected: dict[str, list[str]], top_up) -> tuple[int, int] | None:
    """Until a soak job has a shard running, submitting one more job (top_up) whenever every soak job has ended;
    at most WORK_WAIT_S. The last answer of running_work."""
    deadline = time.monotonic() + WORK_WAIT_S
    checked_ended = 0.0
    work = None
    while time.monotonic() < deadline:
        if (work := running_work(sessions, list(expected))) and work[0]:
            return work
        checked_ended = top_up_if_all_ended(sessions, expected, top_up, checked_ended)
        time.sleep(0.2)
    return running_work(sessions, list(expected))


def top_up_if_all_ended(sessions, expected: dict[str, list[str]], top_up, checked_at: float) -> float:
    """At most once a second: one more job when every soak job has ended. When it last looked."""
    if time.monotonic() - checked_at <= 1:
        return checked_at
    statuses = job_statuses(sessions, list(expected))
    if all(statuses.get(job_id) in TERMINAL for job_id in expected):
        top_up()
    return time.monotonic()


def at_point(kind: str, point: str, state_dir: Path, stack_module, sessions, expected: dict[str, list[str]],
             top_up, started: float) -> bool:
    """Arm a pause or crash point (storage.faults) and wait for a process to take it. A paused process stopped
    itself with SIGSTOP there (before_part_upload: between noting its part's key and the PUT) and is resumed after
    its lease + 5 s, so the sweep has taken its work and it carries on as a zombie; a crashed one SIGKILLed itself
    (during_finalize: the finalize step's process) and the stack's processes that died are started again. Whether
    a process took it."""
    stack = stack_module.Stack(state_dir)
    lease = float(stack.state["env"].get("TOKENMILL_LEASE_S") or 120)
    faults = Path(stack.state["env"].get("TOKENMILL_FAULT_DIR") or state_dir / "faults")
    faults.mkdir(parents=True, exist_ok=True)
    trigger, taken_as = faults / f"{kind}-{point}", {"pause": "paused", "crash": "crashed"}[kind]
    trigger.touch()
    deadline, checked_ended = time.monotonic() + WORK_WAIT_S, 0.0
    while not (taken := list(faults.glob(f"{taken_as}-{point}-*"))) and time.monotonic() < deadline:
        checked_ended = top_up_if_all_ended(sessions, expected, top_up, checked_ended)
        time.sleep(0.05)
    label = f"{time.monotonic() - started:6.1f} s  {kind} at {point}"
    if not taken:
        trigger.unlink(missing_ok=True)
        print(f"{label}  (no process reached it: no hit)", flush=True)
        return False
    group, pid = (int(part) for part in taken[0].name.rsplit("-", 2)[1:])
    owner = next((name for name, leader in stack.state["processes"].items() if leader == group), None)
    print(f"{label}: process {pid} of {owner or 'no stack process'}"
          + (f", for {lease + 5:.0f} s" if kind == "pause" else ", restarted"), flush=True)
    try:
        if kind == "pause":
            time.sleep(lease + 5)
            os.kill(pid, signal.SIGCONT)
        elif owner is not None:  # the process it killed may be one node of several: the whole process starts again
            stack_module.restart(state_dir, owner)
    except ProcessLookupError:
        pass
    finally:
        taken[0].unlink(missing_ok=True)
    return True


def cancel_running_job(sessions, expected: dict[str, list[str]], may_end_cancelled: set[str],
                       started: float) -> bool:
    """Cancel a soak job that has a shard running (as `tokenmill cancel` does); whether one was."""
    from sqlalchemy import select

    from storage.models import Shard
    from workers.inprocess import cancel_job

    try:
        with sessions() as session:
            job_id = session.scalar(select(Shard.job_id).where(Shard.job_id.in_(list(expected)),
                                                               Shard.status == "running").limit(1))
        if job_id is None:
            print(f"{time.monotonic() - started:6.1f} s  cancel-job  (no job running: no hit)", flush=True)
            return False
        may_end_cancelled.add(job_id)
        status = cancel_job(sessions, job_id).status
    except Exception as error:  # the database down: a miss
        print(f"{time.monotonic() - started:6.1f} s  cancel-job  (failed: {error})", flush=True)
        return False
    print(f"{time.monotonic() - started:6.1f} s  cancel-job {job_id}: {status}", flush=True)
    return True


def running_work(sessions, job_ids: list[str]) -> tuple[int, int] | None:
    """(shards running, job steps held) of these jobs; None while the database does not answer."""
    from sqlalchemy import func, select

    from storage.models import Job, Shard

    try:
        with sessions() as session:
            shards = session.scalar(select(func.count()).select_from(Shard)
                                    .where(Shard.job_id.in_(job_ids), Shard.status == "running"))
            steps = session.scalar(select(func.count()).select_from(Job)
                                   .where(Job.id.in_(job_ids), Job.worker.is_not(None), Job.status.not_in(TERMINAL)))
            return shards, steps
    except Exception as error:
        print(f"(database: {error})", file=sys.stderr)
        return None


def inject(fault: str, state_dir: Path, stack_module, host=None) -> None:
    stack = stack_module.Stack(state_dir)
    lease = float(stack.state["env"].get("TOKENMILL_LEASE_S") or 120)
    if fault == "pause-host":
        os.killpg(host.pid, signal.SIGSTOP)
        try:
            time.sleep(lease + 5)
        finally:
            os.killpg(host.pid, signal.SIGCONT)
    elif fault == "postgres-restart":
        stack.script("postgres", "restart", stack.state["postgres"]["dir"])
    elif fault == "postgres-partition":
        pids = stack_module.private_postgres_pids(stack.state)  # the postmaster first: it starts no more backends
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(lease + 5)
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
    elif fault == "redis-restart":
        stack_module.restart(state_dir, "redis")
    elif fault == "redis-flushall":
        import redis

        redis.Redis(port=stack.state["ports"]["redis"]).flushall()
    elif fault == "tansu-restart":
        kafka_dir, port = str(state_dir / "kafka"), str(stack.state["ports"]["kafka"])
        stack.script("kafka", "stop", kafka_dir)
        stack.script("kafka", "start", kafka_dir, port, stack_module.JOBS_TOPIC, stack_module.EVENTS_TOPIC)
    elif fault in ("seaweedfs-outage", "seaweedfs-long-outage"):  # the long one outlasts the workers' outage wait
        weed_dir, port = str(state_dir / "seaweedfs"), str(stack.state["ports"]["s3"])
        stack.script("seaweedfs", "stop", weed_dir)
        time.sleep(15 if fault == "seaweedfs-outage"
                   else float(stack.state["env"].get("TOKENMILL_OUTAGE_WAIT_S") or 300) + 10)
        stack.script("seaweedfs", "start", weed_dir, port)
    elif fault == "redis-pause":  # the broker hangs (SIGSTOP) past a lease: clients block, then it answers again
        group = stack.state["processes"]["redis"]
        os.killpg(group, signal.SIGSTOP)
        try:
            time.sleep(lease + 5)
        finally:
            os.killpg(group, signal.SIGCONT)
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
    """The custom_ids in a job's committed outputs (a completed job's manifest parts and its error file; another
    job's completed shards' parts), the part files under its prefix and those it committed."""
    from storage import repository as repo
    from storage.formats import ERRORS_KEY, MANIFEST_KEY, read_part
    from storage.objectstore import open_store

    with sessions() as session:
        job = repo.get_job(session, job_id)
        shard_parts = [s.output_key for s in repo.shards(session, job_id) if s.status == "completed" and s.output_key]
    store = open_store(job.output_uri, job.settings.s3)
    completed = job.status == "completed"
    parts = ([part["key"] for part in json.loads(store.get_bytes(MANIFEST_KEY))["files"]["parts"]] if completed
             else shard_parts)
    ids = [row["custom_id"] for key in parts for row in read_part(store, key).to_pylist() if row["choice_index"] == 0]
    errors = store.get_bytes(ERRORS_KEY).decode().splitlines() if completed and store.exists(ERRORS_KEY) else []
    found = [key for key in store.list("part-")]
    return ids + [json.loads(line)["custom_id"] for line in errors if line.strip()], found, parts


if __name__ == "__main__":
    sys.exit(main())
