"""Restarts and takeovers on the real services, each while a job runs: Redis restarted; tansu restarted (it keeps
messages in memory, so it comes back empty) with the consumer, the watcher and beat killed with SIGKILL; a live
worker's shard claim stolen, two jobs on one output prefix, the input replaced mid-job, and PostgreSQL restarted
(a private cluster this test starts itself, with a worker of its own). Each ends with every custom_id exactly
once in the outputs (or the job cleanly failed, for a replaced input) and no job left non-terminal."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from ingest.config import model_slug
from ingest.submit import send
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import (
    job_row,
    shard_rows,
    stack_module,
    stop_process_group,
    submit_file,
    wait_for_job,
    wait_for_workers,
    wait_until,
)
from tests.service.test_front_doors import jobs_where

pytestmark = pytest.mark.real_model

PG_BIN = max(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), default=Path("/none"))


def start_job(stack, tmp_path: Path, tag: str, rows: int = 8, max_tokens: int = 16, via: str = "kafka"):
    """A small job of `rows` prompts in shards of 2; (job id, custom ids)."""
    columns = prompt_rows(rows, tag)
    path = write_parquet(tmp_path / f"{tag}.parquet", columns)
    job_id = submit_file(stack, path, "--output", f"{stack.bucket}/{tag}-{uuid.uuid4().hex[:8]}", "--shard-size", "2",
                         "--max-tokens", str(max_tokens), via=via)
    return job_id, columns["custom_id"]


def a_shard_completed(sessions, job_id: str) -> None:
    wait_until(lambda: any(s["status"] == "completed" for s in shard_rows(sessions, job_id)),
               f"a first shard of {job_id} to complete", timeout=180)


def assert_completed_once(stack, sessions, job_id: str, custom_ids: list[str], timeout: float = 300) -> dict:
    job = wait_for_job(sessions, job_id, timeout=timeout)
    assert job["status"] == "completed", job["error"]
    assert_each_id_once(stack.store(job["output_uri"]), custom_ids)
    return job


def logs_of(stack, pattern: str) -> str:
    return "".join(p.read_text(errors="replace") for p in (stack.dir / "logs").glob(pattern))


def test_a_redis_restart_mid_job_loses_nothing_and_clients_reconnect(stack, sessions, tmp_path) -> None:
    """Redis (broker and result backend, no persistence) restarted by the stack with its own settings: the
    workers and beat reconnect, the reconciler resends what was queued, and a fresh client pings the workers."""
    # 24 shards: 16 (8 shards) were all taken by the two workers before the first finished on a 2-core Xeon
    job_id, ids = start_job(stack, tmp_path, "redis-restart", rows=48, max_tokens=8)
    a_shard_completed(sessions, job_id)
    assert any(s["status"] == "pending" for s in shard_rows(sessions, job_id)), "nothing was queued at the restart"
    stack_module().restart(stack.dir, "redis")
    stack.reload()
    wait_until(lambda: stack_module().port_open(stack.state["ports"]["redis"]), "Redis to listen", timeout=20)
    assert_completed_once(stack, sessions, job_id, ids)
    wait_for_workers(stack, 2, timeout=60)  # a new connection after the restart works


def test_tansu_restarted_and_the_consumer_watcher_and_beat_killed(stack, sessions, tmp_path) -> None:
    """While a job runs, the consumer, the watcher and beat are killed with SIGKILL and tansu is restarted (it
    comes back empty): the job (recorded in the database) completes; the three started again and the event
    producers reconnect, and a job sent to each front door afterwards completes once."""
    from kafka import KafkaConsumer, TopicPartition

    module = stack_module()
    job_id, ids = start_job(stack, tmp_path, "front-faults", via="s3")
    a_shard_completed(sessions, job_id)
    for name in ("consumer", "watcher", "beat"):
        os.killpg(stack.state["processes"][name], signal.SIGKILL)
    probe = KafkaConsumer(bootstrap_servers=stack.bootstrap)
    partition = TopicPartition("tokenmill.jobs", 0)
    end = probe.end_offsets([partition])[partition]
    probe.close()
    kafka_dir, port = str(stack.dir / "kafka"), str(stack.state["ports"]["kafka"])
    runner = module.Stack(stack.dir)
    runner.script("kafka", "stop", kafka_dir)
    runner.script("kafka", "start", kafka_dir, port, module.JOBS_TOPIC, module.EVENTS_TOPIC)
    _refill_offsets(stack.bootstrap, end)  # the topic came back empty: later tests must not meet old offsets
    for name in ("consumer", "watcher", "beat"):
        module.restart(stack.dir, name)
    stack.reload()
    kafka_job, kafka_ids = start_job(stack, tmp_path, "after-faults-kafka", rows=4, max_tokens=4)
    inbox_job, inbox_ids = start_job(stack, tmp_path, "after-faults-inbox", rows=4, max_tokens=4, via="s3")
    assert_completed_once(stack, sessions, job_id, ids)
    assert_completed_once(stack, sessions, kafka_job, kafka_ids)
    assert_completed_once(stack, sessions, inbox_job, inbox_ids)


def _refill_offsets(bootstrap: str, end: int) -> None:
    """Null messages up to the old end offset (the consumer rejects them), so new messages get new offsets."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        for _ in range(end):
            producer.send("tokenmill.jobs", value=None, key=b"offset-refill")
        producer.flush(timeout=60)
    finally:
        producer.close(timeout=5)


def test_a_live_worker_whose_claim_is_stolen_writes_nothing(stack, sessions, tmp_path) -> None:
    """A shard running on a live worker is claimed again (its token bumped, as a takeover after a lost lease
    does) and sent to the workers again: the first worker's heartbeat sees the claim gone, it stops the shard
    and writes nothing; the new claim completes it and the job has every custom_id exactly once."""
    from celery import Celery

    job_id, ids = start_job(stack, tmp_path, "stolen", rows=8, max_tokens=48)
    stolen: dict = {}

    def steal() -> bool:
        for shard in shard_rows(sessions, job_id):
            if shard["status"] != "running":
                continue
            with sessions.begin() as session:
                taken = session.execute(text(
                    "UPDATE shards SET claim_token = claim_token + 1, status = 'pending', worker = NULL, "
                    "lease_expires_at = NULL WHERE id = :id AND claim_token = :t AND status = 'running'"),
                    {"id": shard["id"], "t": shard["claim_token"]}).rowcount
            if taken:
                stolen.update(shard)
                return True
        return False

    wait_until(steal, "a running shard to steal", timeout=180, every=0.1)
    job = job_row(sessions, job_id)
    app = Celery(broker=stack.state["env"]["TOKENMILL_BROKER_URL"])
    try:
        queue = stack.state["env"].get("TOKENMILL_QUEUE_PREFIX", "") + f"gpu.{model_slug(job['model'])}"
        app.send_task("tokenmill.run_shard", (job_id, stolen["id"]), queue=queue)
    finally:
        app.close()
    assert_completed_once(stack, sessions, job_id, ids)
    shard = next(s for s in shard_rows(sessions, job_id) if s["id"] == stolen["id"])
    assert shard["claim_token"] >= stolen["claim_token"] + 2 and shard["output_key"].endswith(
        f"-c{shard['claim_token']}.parquet"), shard
    pattern = rf"(shard {stolen['id']}: its claim \(token {stolen['claim_token']}\) was taken over|" \
              rf"job {job_id}: shard {stolen['index']} was claimed by another worker)"
    assert re.search(pattern, logs_of(stack, "worker*.log")), "the first worker did not notice"


def test_a_second_job_on_a_live_jobs_output_is_refused_naming_it(stack, sessions) -> None:
    output = f"{stack.bucket}/one-prefix-{uuid.uuid4().hex[:8]}"
    first_rows = [{"custom_id": f"prefix-a-{i}", "prompt": f"Say {i}."} for i in range(6)]
    first = send(stack.bootstrap, "tokenmill.jobs", {"rows": first_rows, "output_uri": output, "shard_size": 2,
                                                     "sampling": {"max_tokens": 16}})
    second = send(stack.bootstrap, "tokenmill.jobs", {"rows": [{"custom_id": "prefix-b", "prompt": "x"}],
                                                      "output_uri": output + "/"})
    owner = wait_until(lambda: jobs_where(sessions, "source_ref = :ref", ref=f"tokenmill.jobs/0/{first.offset}"),
                       "the first job", timeout=60)[0]

    def rejection():
        with sessions() as session:
            return session.scalar(text('SELECT error FROM rejected_messages WHERE topic = :t AND "offset" = :o'),
                                  {"t": "tokenmill.jobs", "o": second.offset})

    error = wait_until(rejection, "the second message to be rejected", timeout=60)
    assert f"taken by live job {owner['id']}" in error
    assert_completed_once(stack, sessions, owner["id"], [r["custom_id"] for r in first_rows])


def test_an_input_replaced_mid_job_fails_the_job_with_that_reason(stack, sessions, tmp_path) -> None:
    # more shards than the two workers hold in flight: some are still to read their rows after the replacement
    job_id, _ = start_job(stack, tmp_path, "replaced", rows=48, max_tokens=16)
    a_shard_completed(sessions, job_id)
    job = job_row(sessions, job_id)
    assert any(s["status"] == "pending" for s in shard_rows(sessions, job_id)), "every shard ran before the change"
    replacement = write_parquet(tmp_path / "other.parquet", prompt_rows(48, "other"))
    bucket_uri, _, key = job["input_uri"].rpartition("/")
    stack.store(bucket_uri).put_file(key, replacement)
    job = wait_for_job(sessions, job_id, timeout=180)
    assert job["status"] == "failed" and "changed since the job was validated" in job["error"], job["error"]
    wait_until(lambda: all(s["status"] != "running" for s in shard_rows(sessions, job_id)),
               "the shards in flight to stop", timeout=60)
    assert any(s["status"] == "completed" for s in shard_rows(sessions, job_id))  # kept


# ---- PostgreSQL restarted, on a private cluster -----------------------------------------------------------

@pytest.fixture
def private_postgres():
    """A PostgreSQL cluster of this test's own (initdb, pg_ctl) on a free port, never the machine's server; run
    as the `postgres` user when this is root (initdb refuses root)."""
    import pwd
    import tempfile

    from tests.fixtures_services import free_port_block

    assert (PG_BIN / "initdb").exists(), "no PostgreSQL server binaries under /usr/lib/postgresql/*/bin"
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="tokenmill-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port_block(1)

    def run(*command) -> None:
        subprocess.run([*as_user, *map(str, command)], check=True, capture_output=True, timeout=120)

    run(PG_BIN / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def ctl(action: str) -> None:
        options = ["-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1"] if action != "stop" else ["-m", "fast"]
        run(PG_BIN / "pg_ctl", "-D", data, "-l", root / "pg.log", "-w", "-t", "60", action, *options)

    ctl("start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", ctl
    finally:
        subprocess.run([*as_user, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def new_topic(bootstrap: str, prefix: str) -> str:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    return topic


def test_postgresql_down_longer_than_the_lease_with_the_service_running(stack, private_postgres, tmp_path) -> None:
    """A service of its own on a private PostgreSQL (the stack's Redis and tansu, its own queues and topic): a
    worker, beat's sweep and the Kafka consumer, with 4 s leases. PostgreSQL stops for 10 s while shards run,
    and a second job is sent meanwhile: the consumer waits the outage out, the lapsed leases are renewed or taken
    over, the outage uses no shard attempt, and both jobs complete (finalize included) with every custom_id once."""
    from storage import db, migrate

    url, ctl = private_postgres
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    prefix, topic = f"pg-{uuid.uuid4().hex[:6]}.", new_topic(stack.bootstrap, "pg")
    env = {**stack.env, "TOKENMILL_DATABASE_URL": url, "TOKENMILL_QUEUE_PREFIX": prefix, "TOKENMILL_LEASE_S": "4",
           "TOKENMILL_TRANSIENT_RETRY_S": "2", "TOKENMILL_JOBS_TOPIC": topic, "TOKENMILL_CONSUMER_GROUP": topic,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    tokenmill = [sys.executable, "-m", "tokenmill"]
    celery = [sys.executable, "-m", "celery", "-A", "workers.celery_app"]
    commands = {"worker": [*tokenmill, "worker", "--name", f"{prefix}w", "--threads", "2", "--kv-cache-memory", "0.25"],
                "beat": [*celery, "beat", "--schedule", str(tmp_path / "beat-schedule")],
                "consumer": [*tokenmill, "consumer"]}
    processes = {name: subprocess.Popen(command, env=env, cwd=tmp_path, stdout=open(tmp_path / f"{name}.log", "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
                 for name, command in commands.items()}

    def job_from(offset: int) -> dict:
        found = wait_until(lambda: jobs_where(sessions, "source_ref = :ref", ref=f"{topic}/0/{offset}"),
                           f"the job of message {offset}", timeout=120)
        return found[0]

    try:
        rows = lambda name, count: [{"custom_id": f"{name}-{i}", "prompt": f"Write one sentence about {i}."}
                                    for i in range(count)]
        first_rows, second_rows = rows("pg-first", 8), rows("pg-second", 4)
        spec = lambda rows, name: {"rows": rows, "output_uri": f"{stack.bucket}/{name}-{uuid.uuid4().hex[:8]}",
                                   "shard_size": 2, "sampling": {"max_tokens": 32, "temperature": 0}}
        send(stack.bootstrap, topic, spec(first_rows, "pg-first"))
        first = job_from(0)
        a_shard_completed(sessions, first["id"])
        ctl("stop")  # longer than a lease: the running shards' leases lapse while their heartbeats cannot reach it
        send(stack.bootstrap, topic, spec(second_rows, "pg-second"))
        time.sleep(10)
        ctl("start")
        second = job_from(1)
        for job, columns in ((first, first_rows), (second, second_rows)):
            done = wait_for_job(sessions, job["id"], timeout=300)
            assert done["status"] == "completed", done["error"]
            assert_each_id_once(stack.store(done["output_uri"]), [row["custom_id"] for row in columns])
            assert all(s["attempts"] == 1 for s in shard_rows(sessions, job["id"])), "the outage used an attempt"
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in commands}
        assert "OperationalError" in logs["worker"], "no task met the outage"
        assert "could not record" in logs["consumer"], "the consumer did not meet the outage"
    finally:
        for process in processes.values():
            stop_process_group(process, 30)
        sessions.kw["bind"].dispose()


def test_a_consumer_killed_between_its_insert_and_its_offset_commit_makes_one_job(stack, sessions, tmp_path) -> None:
    """A consumer (a topic and group of its own) SIGKILLed after recording a message but before committing its
    offset (TOKENMILL_CRASH_AT): the next consumer reads the message again, finds the same job, commits, and the
    job completes with every custom_id once."""
    from kafka import KafkaConsumer, TopicPartition

    topic = group = new_topic(stack.bootstrap, "crash")
    rows = [{"custom_id": f"crash-{i}", "prompt": f"Say {i}."} for i in range(4)]
    send(stack.bootstrap, topic, {"rows": rows, "output_uri": f"{stack.bucket}/{topic}", "shard_size": 2,
                                  "sampling": {"max_tokens": 8}})
    env = {**stack.env, "TOKENMILL_JOBS_TOPIC": topic, "TOKENMILL_CONSUMER_GROUP": group,
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "tokenmill", "consumer"]
    crashed = subprocess.run(command, env={**env, "TOKENMILL_CRASH_AT": "after_consumer_insert"}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    (job,) = jobs_where(sessions, "source_ref = :ref", ref=f"{topic}/0/0")

    def committed() -> int | None:
        reader = KafkaConsumer(bootstrap_servers=stack.bootstrap, group_id=group, enable_auto_commit=False)
        try:
            return reader.committed(TopicPartition(topic, 0))
        finally:
            reader.close()

    assert committed() is None, "the killed consumer must not have committed"
    second = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=open(tmp_path / "consumer.log", "wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: committed() == 1, "the second consumer to commit the message", timeout=60, every=0.5)
    finally:
        stop_process_group(second, 30)
    assert [j["id"] for j in jobs_where(sessions, "source_ref = :ref", ref=f"{topic}/0/0")] == [job["id"]], \
        "the message made a second job"
    assert job["id"] in (tmp_path / "consumer.log").read_text(errors="replace"), "the second consumer never read it"
    assert_completed_once(stack, sessions, job["id"], [row["custom_id"] for row in rows])
