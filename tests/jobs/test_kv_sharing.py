"""KV sharing across workers (`tokenmill worker --kv-sharing`, issue #43): the option expands to the engine's
kv_transfer_config (RedisConnector, kv_both) over the service's own Redis, and two workers' engines, built by the
worker's engine loader from those settings, share a long prefix through the real Redis: the rows of the second load
the blocks the first computed, and their outputs equal a run without sharing. The blocks live in database 1 of the
service's Redis, never the broker's, sealed under the deployment's TOKENMILL_KV_SECRET, without which a worker does
not share (issue #56)."""

from __future__ import annotations

import gc
import uuid

import pytest
import redis

from engine.chat import chat_token_ids
from ingest.intake import submit
from storage.objectstore import open_store
from tests.jobs.jobhelpers import new_job, read_outputs, write_parquet
from tokenmill.bench.workload import questions, system_prompt
from tokenmill.cli import build_parser, main
from tokenmill.options import engine_kwargs
from workers.inprocess import run_job
from workers.worker_engine import load_engine

REDIS_URL = "redis://127.0.0.1:6379/0"
KV_URL = "redis://127.0.0.1:6379/1"  # the service's Redis, database KV_DB: not the broker's
KV_SECRET = "test-deployment-kv-secret"
ENGINE_ARGS = ("--dtype", "float32", "--threads", "2", "--kv-cache-memory", "0.25", "--max-num-seqs", "16",
               "--batch-invariant", "on", "--no-enable-lora")


@pytest.fixture
def service_env(monkeypatch) -> str:
    """The service's settings as a worker reads them, with a queue prefix (and so KV key prefix) of this test's."""
    prefix = f"t-kvs-{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("TOKENMILL_BROKER_URL", REDIS_URL)
    for name in ("TOKENMILL_RESULT_BACKEND", "TOKENMILL_KV_REDIS_URL", "TOKENMILL_KV_TTL_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENMILL_QUEUE_PREFIX", prefix)
    monkeypatch.setenv("TOKENMILL_KV_SECRET", KV_SECRET)
    return prefix


def worker_settings(*args: str) -> dict:
    """The engine settings `tokenmill worker ARGS` loads its engine with."""
    return engine_kwargs(build_parser().parse_args(["worker", *ENGINE_ARGS, *args]))


def test_kv_sharing_expands_to_kv_both_over_the_service_redis(service_env, monkeypatch) -> None:
    assert "kv_transfer_config" not in worker_settings()
    assert worker_settings("--kv-sharing")["kv_transfer_config"] == {
        "kv_connector": "RedisConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"redis_url": KV_URL, "redis_key_prefix": f"{service_env}tokenmill:kv:",
                                      "redis_ttl": 600, "kv_secret": KV_SECRET}}
    own = worker_settings("--kv-sharing", "--kv-sharing-url", "redis://kv-host:6380/3", "--kv-sharing-ttl", "60")
    assert own["kv_transfer_config"]["kv_connector_extra_config"] == {
        "redis_url": "redis://kv-host:6380/3", "redis_key_prefix": f"{service_env}tokenmill:kv:",
        "redis_ttl": 60, "kv_secret": KV_SECRET}
    never = worker_settings("--kv-sharing", "--kv-sharing-ttl", "0")["kv_transfer_config"]
    assert "redis_ttl" not in never["kv_connector_extra_config"]
    monkeypatch.setenv("TOKENMILL_KV_REDIS_URL", "redis://kv-host:6380/4")  # the disaggregated workers' KV Redis
    monkeypatch.setenv("TOKENMILL_KV_TTL_S", "0")
    assert worker_settings("--kv-sharing")["kv_transfer_config"]["kv_connector_extra_config"] == {
        "redis_url": "redis://kv-host:6380/4", "redis_key_prefix": f"{service_env}tokenmill:kv:",
        "kv_secret": KV_SECRET}


def test_kv_sharing_needs_the_deployments_secret_and_keeps_out_of_the_brokers_database(service_env,
                                                                                     monkeypatch) -> None:
    from workers.kv_sharing import default_kv_redis_url, without_kv_secret

    for secret in ("", "short"):
        monkeypatch.setenv("TOKENMILL_KV_SECRET", secret)
        with pytest.raises(ValueError, match="KV secret"):
            worker_settings("--kv-sharing")
    monkeypatch.setenv("TOKENMILL_KV_SECRET", KV_SECRET)
    own = '{"kv_connector": "RedisConnector", "kv_connector_extra_config": {"redis_url": "redis://h/2"}}'
    settings = worker_settings("--kv-transfer-config", own)
    assert settings["kv_transfer_config"]["kv_connector_extra_config"] == {
        "redis_url": "redis://h/2", "kv_secret": KV_SECRET}  # the secret from the deployment, not the command line
    assert without_kv_secret(settings)["kv_transfer_config"]["kv_connector_extra_config"] == {
        "redis_url": "redis://h/2"}  # as a job's settings store it, or a worker's environment passes it on
    with pytest.raises(ValueError, match="TOKENMILL_KV_SECRET, not in --kv-transfer-config"):
        worker_settings("--kv-transfer-config", own.replace('"redis://h/2"', '"redis://h/2", "kv_secret": "x"'))
    monkeypatch.setenv("TOKENMILL_BROKER_URL", "redis://:pw@127.0.0.1:6379/1")  # a broker in database 1
    with pytest.raises(ValueError, match="TOKENMILL_KV_REDIS_URL"):
        worker_settings("--kv-sharing")
    monkeypatch.setenv("TOKENMILL_BROKER_URL", "redis://:pw@127.0.0.1:6379/0?health_check_interval=5")
    from ingest.config import ServiceConfig

    assert default_kv_redis_url(ServiceConfig.from_env()) == "redis://:pw@127.0.0.1:6379/1?health_check_interval=5"


def test_kv_sharing_refuses_other_kv_settings_and_a_service_without_redis(service_env, monkeypatch,
                                                                            capsys) -> None:
    code = main(["worker", "--kv-sharing", "--kv-transfer-config",
                 '{"kv_connector": "RedisConnector", "kv_connector_extra_config": {"redis_url": "redis://h/0"}}'])
    assert code == 2
    assert "--kv-sharing and --kv-transfer-config both set the engine's KV connector" in capsys.readouterr().err
    assert main(["worker", "--kv-sharing", "--kv-role", "consumer"]) == 2
    assert "--kv-sharing and --kv-role both set the engine's KV role" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--kv-sharing-url needs --kv-sharing"):
        worker_settings("--kv-sharing-url", REDIS_URL)
    with pytest.raises(ValueError, match="at least 1 second"):
        worker_settings("--kv-sharing", "--kv-sharing-ttl", "-5")
    monkeypatch.setenv("TOKENMILL_BROKER_URL", "amqp://guest@127.0.0.1:5672//")  # RabbitMQ: no result backend
    with pytest.raises(ValueError, match="name one with --kv-sharing-url"):
        worker_settings("--kv-sharing")
    assert "kv_transfer_config" in worker_settings("--kv-sharing", "--kv-sharing-url", REDIS_URL)


@pytest.mark.real_model
def test_the_second_worker_loads_the_prefix_the_first_computed(service_env, sessions, tmp_path) -> None:
    """Worker A runs a job of four questions after one 512+-token system prompt; worker B, with an empty prefix
    cache of its own, runs four other questions after the same prompt and loads the prompt's blocks from Redis
    instead of computing them. A worker without sharing computes them, and writes the same outputs."""
    shared, plain = worker_settings("--kv-sharing"), worker_settings()
    first = load_engine(shared)
    tokenizer = first.tokenizer
    system = system_prompt(512, tokenizer)
    pool = questions()

    def chat(question: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    ids = [chat_token_ids(tokenizer, chat(q)) for q in pool[:2]]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    shared_blocks = common // 16
    assert shared_blocks >= 32

    def job(engine, name: str, asked: list[str]) -> list[dict]:
        rows = write_parquet(tmp_path / f"{name}.parquet", {"custom_id": [f"{name}-{i}" for i in range(len(asked))],
                                                             "messages": [chat(q) for q in asked]})
        spec = new_job(rows, tmp_path / f"out-{name}", sampling={"temperature": 0.0, "max_tokens": 8},
                       shard_size=2)
        done = run_job(sessions, submit(sessions, spec).job.id, lambda settings: engine)
        assert done.status == "completed", done.error
        results, errors, _ = read_outputs(open_store(str(tmp_path / f"out-{name}")))
        assert errors == []
        return sorted(results, key=lambda r: r["custom_id"])

    client = redis.Redis.from_url(KV_URL)
    try:
        job(first, "a", pool[:4])
        assert first.kv_connector.stats.blocks_saved >= shared_blocks and first.kv_connector.stats.blocks_loaded == 0
        stored = list(client.scan_iter(match=f"{service_env}tokenmill:kv:*"))
        assert len(stored) == first.kv_connector.stats.blocks_saved
        broker = redis.Redis.from_url(REDIS_URL)
        assert not list(broker.scan_iter(match=f"{service_env}tokenmill:kv:*"))  # none in the broker's database
        broker.close()
        assert all(0 < client.ttl(key) <= 600 for key in stored[:8])
        del first  # freed before the next engine loads (three fill 5 GB); the job closed its engine thread
        gc.collect()

        second = load_engine(shared)
        loaded = job(second, "b", pool[4:8])
        assert second.kv_connector.stats.blocks_loaded >= shared_blocks
        assert all(row["cached_tokens"] >= shared_blocks * 16 for row in loaded), [r["cached_tokens"] for r in loaded]
        assert second.kv_connector.stats.store_errors == second.kv_connector.stats.blocks_rejected == 0
        second_computed = second.stats.computed_prefill_tokens
        del second
        gc.collect()

        alone = load_engine(plain)
        assert alone.kv_connector is None
        computed = job(alone, "c", pool[4:8])
        assert alone.stats.computed_prefill_tokens >= second_computed + shared_blocks * 16
        assert [(r["text"], r["completion_tokens"]) for r in loaded] == \
               [(r["text"], r["completion_tokens"]) for r in computed]
        assert all(r["completion_tokens"] == 8 or r["finish_reason"] == "stop" for r in loaded)
    finally:
        keys = list(client.scan_iter(match=f"{service_env}*"))
        if keys:
            client.unlink(*keys)
        client.close()
