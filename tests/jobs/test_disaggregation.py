"""Disaggregated prefill and decode workers on the real stack (`tokenmill stack up`: Redis, Kafka, S3, PostgreSQL,
beat): with TOKENMILL_KV_DISAGGREGATION=1, a job's shards go to a `tokenmill worker --kv-role producer`, which saves
each prompt's KV blocks to the stack's Redis and hands the shard to a `--kv-role consumer`, which loads them and
writes the part. Its texts equal a plain worker's (float32, greedy), every custom_id once; and a producer killed
(SIGKILL) mid-job costs nothing: its shards are redone by the consumer, every custom_id once, no job unfinished."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from ingest.config import ServiceConfig
from storage import db
from tests.jobs.jobhelpers import assert_each_id_once, write_parquet
from tests.service.conftest import (
    STACK_ENV,
    RunningStack,
    running_stack,
    shard_rows,
    stack_module,
    submit_file,
    wait_for_job,
    wait_until,
    worker_pid,
)
from tokenmill.cli import build_parser
from tokenmill.commands.service import worker_nodes
from workers.disagg import disaggregated, role_engine_settings

MODEL = "smollm2-135m"
SETTINGS = {**STACK_ENV, "TOKENMILL_KV_DISAGGREGATION": "1",
            "TOKENMILL_SWEEP_GRACE_S": "20"}  # longer than a prefill queue waits for a live producer here
BLOCK = 16


def rows(count: int, prefix: str, sentences: int) -> dict[str, list]:
    """Prompts that differ from their first token (no row's blocks are another's), several blocks long."""
    body = " ".join(f"Shelf {j} of hall {{i}} holds {j + 2} red books and {{i}} blue ones." for j in range(sentences))
    return {"custom_id": [f"{prefix}-{i:03d}" for i in range(count)],
            "prompt": [f"Record {i} of {prefix}: " + body.format(i=i) + " How many books are there in all?"
                       for i in range(count)]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    """The stack without workers of its own: each test starts the workers it needs (as stack processes, so that
    `stack down` stops them and checks they are gone)."""
    state_dir = tmp_path_factory.mktemp("disagg") / "stack"
    with running_stack(state_dir, 0, SETTINGS) as running:
        yield running


@pytest.fixture(scope="module")
def sessions(stack: RunningStack):
    factory = db.session_factory(db.make_engine(stack.database_url))
    yield factory
    factory.kw["bind"].dispose()


def start_workers(stack: RunningStack, roles: dict[str, str | None], **env: str) -> dict[str, int]:
    """`tokenmill worker --name NAME [--kv-role ROLE]` (float32, 1 thread) for each {NAME: ROLE}, as process groups
    of the stack, once their engines are loaded and all their nodes answer; {NAME: process group id}."""
    module = stack_module()
    groups = {}
    for name, kv_role in roles.items():
        command = [sys.executable, "-m", "tokenmill", "worker", "--name", name, "--model", MODEL, "--dtype",
                   "float32", "--threads", "1", "--kv-cache-memory", "0.25", "--state-dir", str(stack.dir),
                   *(("--kv-role", kv_role) if kv_role else ())]
        groups[name] = module.Stack(stack.dir).spawn(name, command, env)
    logs = [stack.dir / "logs" / f"{name}.log" for name in roles]
    wait_until(lambda: all(f"loaded {MODEL} in" in log.read_text() for log in logs), f"{list(roles)} to load", 120,
               every=0.5)
    wait_for_nodes(stack, [node for name in roles for node in (name, module.control_node_name(name))])
    stack.reload()
    return groups


def wait_for_nodes(stack: RunningStack, names: list[str]) -> None:
    from celery import Celery

    app = Celery(broker=stack.state["env"]["TOKENMILL_BROKER_URL"])
    wanted = {f"{name}@{socket.gethostname()}" for name in names}
    try:
        wait_until(lambda: wanted <= {node for reply in app.control.ping(timeout=1.0) for node in reply},
                   f"nodes {sorted(wanted)}", 60, every=0.5)
    finally:
        app.close()


def stop_worker(stack: RunningStack, name: str) -> None:
    stack_module().stop_group(stack.state["processes"][name])


def run_job(stack: RunningStack, path: Path, shard_size: int) -> str:
    return submit_file(stack, path, "--shard-size", str(shard_size), "--max-tokens", "10")


def finished(stack: RunningStack, sessions, job_id: str, ids: list[str]) -> dict[str, dict]:
    """The completed job's records by custom_id, each id exactly once."""
    job = wait_for_job(sessions, job_id, timeout=180)
    assert job["status"] == "completed", job["error"]
    results, errors, _ = assert_each_id_once(stack.store(job["output_uri"]), ids)
    assert not errors
    return {r["custom_id"]: r for r in results}


def group_of(shard: dict) -> int | None:
    try:
        return os.getpgid(worker_pid(shard["worker"]))
    except ProcessLookupError:  # its worker is gone
        return None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    folder = tmp_path_factory.mktemp("inputs")
    made = {"small": rows(8, "small", 3), "kill": rows(16, "kill", 7)}
    return {name: (write_parquet(folder / f"{name}.parquet", columns), columns["custom_id"])
            for name, columns in made.items()}


@pytest.fixture(scope="module")
def plain(stack, sessions, inputs) -> dict[str, dict[str, dict]]:
    """Both inputs through a plain float32 worker (no KV connector, shards straight to the model's queue)."""
    start_workers(stack, {"plain": None}, TOKENMILL_KV_DISAGGREGATION="0")
    try:
        jobs = {name: run_job(stack, path, 2 if name == "small" else 4) for name, (path, _) in inputs.items()}
        return {name: finished(stack, sessions, job_id, inputs[name][1]) for name, job_id in jobs.items()}
    finally:
        stop_worker(stack, "plain")


@pytest.fixture(scope="module")
def pair(stack, plain) -> dict[str, int]:
    """A producer and a consumer worker (the plain one stopped): their process groups (not named "consumer": that
    is the stack's Kafka consumer)."""
    return start_workers(stack, {"prefiller": "producer", "decoder": "consumer"})


def texts(records: dict[str, dict]) -> dict[str, str]:
    return {custom_id: record["text"] for custom_id, record in records.items()}


# ---- settings ----------------------------------------------------------------------------------------

def test_disaggregation_names_models_and_roles_pick_queues_and_connectors(monkeypatch) -> None:
    for value, expected in (("", False), ("0", False), ("1", True), ("all", True), ("other, smollm2-135m", True),
                            ("other", False)):
        monkeypatch.setenv("TOKENMILL_KV_DISAGGREGATION", value)
        assert disaggregated(MODEL) is expected, value
    monkeypatch.setenv("TOKENMILL_QUEUE_PREFIX", "t.")
    monkeypatch.setenv("TOKENMILL_KV_SECRET", "test-deployment-kv-secret")
    config = ServiceConfig.from_env()
    producer = build_parser().parse_args(["worker", "--kv-role", "producer"])
    assert worker_nodes(producer, config)["engine"].queues == ["t.gpu.smollm2-135m.prefill"]
    assert worker_nodes(build_parser().parse_args(["worker", "--kv-role", "consumer"]), config)["engine"].queues == [
        "t.gpu.smollm2-135m"]
    assert role_engine_settings({"dtype": "float32"}, None, config) == {"dtype": "float32"}
    redis = dataclasses.replace(config, result_backend="redis://broker:6379/0")
    assert role_engine_settings({}, "producer", redis)["kv_transfer_config"] == {
        "kv_connector": "RedisConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
            "redis_url": "redis://broker:6379/1", "redis_key_prefix": "t.tokenmill:kv:",  # not the broker's db
            "redis_ttl": 3600}}  # its kv_secret ($TOKENMILL_KV_SECRET) is added where the engine is made
    own = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": "/kv"}}
    rabbit = dataclasses.replace(config, result_backend=None)
    assert role_engine_settings({"kv_transfer_config": own}, "consumer", rabbit)["kv_transfer_config"] == {
        **own, "kv_role": "kv_consumer"}
    with pytest.raises(ValueError, match="TOKENMILL_KV_REDIS_URL"):
        role_engine_settings({}, "consumer", rabbit)
    monkeypatch.setenv("TOKENMILL_KV_REDIS_URL", "redis://kv:6379/3")
    monkeypatch.setenv("TOKENMILL_KV_TTL_S", "0")
    assert role_engine_settings({}, "consumer", rabbit)["kv_transfer_config"]["kv_connector_extra_config"] == {
        "redis_url": "redis://kv:6379/3", "redis_key_prefix": "t.tokenmill:kv:"}
    monkeypatch.delenv("TOKENMILL_KV_SECRET")
    with pytest.raises(ValueError, match="TOKENMILL_KV_SECRET"):
        role_engine_settings({}, "consumer", rabbit)


# ---- on the stack --------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_a_job_through_a_producer_and_a_consumer_equals_a_plain_workers(stack, sessions, inputs, plain, pair):
    path, ids = inputs["small"]
    job_id = run_job(stack, path, 2)
    records = finished(stack, sessions, job_id, ids)
    assert texts(records) == texts(plain["small"])
    assert all(r["cached_tokens"] == 0 for r in plain["small"].values())  # no row shares another's blocks
    for record in records.values():  # loaded from Redis: the consumer's own cache never saw these prompts
        assert BLOCK <= record["cached_tokens"] <= record["prompt_tokens"] - 1, record
    assert {group_of(s) for s in shard_rows(sessions, job_id)} == {pair["decoder"]}  # the part's one writer
    assert all(s["attempts"] == 1 for s in shard_rows(sessions, job_id))  # a prefill's hand-off counts none
    producer_log = (stack.dir / "logs" / "prefiller.log").read_text()
    assert len(re.findall(rf"job {job_id}: shard \d+: prefilled 2 prompt\(s\)", producer_log)) == len(ids) // 2
    loaded = re.findall(r"KV connector totals: blocks_loaded (\d+)", (stack.dir / "logs" / "decoder.log").read_text())
    assert loaded and int(loaded[-1]) >= sum(r["cached_tokens"] for r in records.values()) // BLOCK


@pytest.mark.real_model
def test_a_producer_killed_mid_job_costs_nothing(stack, sessions, inputs, plain, pair):
    path, ids = inputs["kill"]
    job_id = run_job(stack, path, 4)
    prefilling = wait_until(lambda: [s for s in shard_rows(sessions, job_id)
                                     if s["status"] == "running" and group_of(s) == pair["prefiller"]],
                            "a shard prefilling on the producer", 120, every=0.05)
    os.killpg(pair["prefiller"], signal.SIGKILL)
    records = finished(stack, sessions, job_id, ids)
    assert texts(records) == texts(plain["kill"])
    shards = {s["index"]: s for s in shard_rows(sessions, job_id)}
    for victim in prefilling:  # its lease lapsed; the sweep sent it to the consumer; the lost prefill cost no attempt
        redone = shards[victim["index"]]
        assert redone["status"] == "completed" and group_of(redone) == pair["decoder"] and redone["attempts"] == 1
    with sessions() as session:
        statuses = session.execute(text("SELECT id, status FROM jobs")).all()
    assert statuses and all(status == "completed" for _, status in statuses), statuses  # no job left unfinished
