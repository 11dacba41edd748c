"""KV connector (engine/kv_connector/): a producer engine saves the full blocks it computes, a fresh consumer engine
loads them instead of computing and gives the same greedy tokens; blocks are keyed by the prefix cache's chain
hashes under the model's identity, sealed by an HMAC under the deployment's secret, and never shared across salts
or models (tests/engine/test_kv_sealing.py: forged blocks, keys and namespaces without the secret)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from engine import LLM, KVTransferConfig, SamplingParams
from engine.kv_connector.store import DirectoryStore, seal, unseal
from tokenmill.bench.tiny_model import save_random_model

BLOCK = 8
SECRET = "test-deployment-kv-secret"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv")
    save_random_model(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, 1000) for _ in range(length)] for length in (41, 77, 100)]


def shared(path, role="kv_both", **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path), "kv_secret": SECRET, **extra}}


def tiny_llm(model_dir, kv_transfer_config=None, **settings) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_threads=2, block_size=BLOCK, max_model_len=256,
               kv_transfer_config=kv_transfer_config, **settings)


def run(llm: LLM, prompts, **kwargs) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, **kwargs)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def loadable_tokens(prompt: list[int]) -> int:
    """Whole blocks before the prompt's last token: what a consumer can load."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def stored_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))


def test_config_takes_vllms_names_and_refuses_what_it_cannot_do(tmp_path):
    config = KVTransferConfig.of(shared(tmp_path, "kv_consumer"))
    assert config.is_kv_consumer and not config.is_kv_producer
    assert KVTransferConfig.of(config) is config and KVTransferConfig.of(None) is None
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="sender", kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    with pytest.raises(ValueError, match="shared_storage_path"):
        KVTransferConfig("SharedStorageConnector", kv_connector_extra_config={"kv_secret": SECRET})
    with pytest.raises(ValueError, match="redis_url"):
        KVTransferConfig("RedisConnector", kv_connector_extra_config={"kv_secret": SECRET})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        from engine.config import EngineConfig

        EngineConfig(tensor_parallel_size=2, kv_transfer_config=shared(tmp_path))
    with pytest.raises(ValueError, match="file://"):
        DirectoryStore("s3://bucket/kv")
    assert DirectoryStore(f"file://{tmp_path}/kv").root == tmp_path / "kv"


def test_a_sealed_block_fails_its_check_when_altered_cut_or_moved():
    payload = bytes(range(256)) * 4
    secret = SECRET.encode()
    data = seal("ns/aa", payload, secret)
    assert unseal("ns/aa", data, len(payload), secret) == payload
    flipped = bytearray(data)
    flipped[-10] ^= 1
    assert unseal("ns/aa", bytes(flipped), len(payload), secret) is None
    assert unseal("ns/aa", data[:-1], len(payload), secret) is None
    assert unseal("ns/bb", data, len(payload), secret) is None  # filed under another block's key
    assert unseal("ns/aa", None, len(payload), secret) is None


def test_a_consumer_loads_the_producers_blocks_and_gives_the_same_tokens(tiny_dir, prompts, tmp_path):
    reference, _ = run(tiny_llm(tiny_dir), prompts)
    store = tmp_path / "kv"
    producer = tiny_llm(tiny_dir, shared(store, "kv_producer"))
    produced, _ = run(producer, prompts)
    assert produced == reference
    saved = stored_files(store)
    assert producer.engine.kv_connector.stats.blocks_saved == len(saved) > 0
    assert producer.engine.kv_connector.stats.blocks_loaded == 0

    consumer = tiny_llm(tiny_dir, shared(store, "kv_consumer"))
    consumed, cached = run(consumer, prompts)
    assert consumed == reference
    assert cached == [loadable_tokens(p) for p in prompts]
    stats = consumer.engine.kv_connector.stats
    assert stats.blocks_loaded * BLOCK == sum(cached) and stats.blocks_rejected == 0
    assert stats.blocks_saved == 0 and stored_files(store) == saved  # a consumer never saves
    # loaded blocks entered the consumer's own prefix cache: asked again, nothing more is loaded
    again, cached_again = run(consumer, prompts)
    assert again == reference and cached_again == cached
    assert consumer.engine.kv_connector.stats.blocks_loaded == stats.blocks_loaded


def test_the_connectors_counts_reach_engine_stats_and_prometheus(tiny_dir, prompts, tmp_path):
    from prometheus_client import CollectorRegistry

    from engine.prometheus import EngineMetrics

    store = tmp_path / "kv"
    run(tiny_llm(tiny_dir, shared(store, "kv_producer")), prompts)
    consumer = tiny_llm(tiny_dir, shared(store, "kv_consumer"))
    registry = CollectorRegistry()
    EngineMetrics(consumer.engine, "tiny", registry).attach()
    run(consumer, prompts)
    loaded = consumer.engine.kv_connector.stats.blocks_loaded
    assert loaded > 0 and consumer.engine.get_stats().kv_connector_blocks_loaded == loaded
    sample = registry.get_sample_value
    assert sample("tokenmill:kv_connector_blocks_loaded_total", {"model_name": "tiny"}) == loaded
    assert sample("tokenmill:kv_connector_blocks_saved_total", {"model_name": "tiny"}) == 0


def test_a_producer_never_loads_and_kv_both_saves_only_what_is_missing(tiny_dir, prompts, tmp_path):
    store = tmp_path / "kv"
    first = tiny_llm(tiny_dir, shared(store, "kv_producer"))
    run(first, prompts[:1])
    count = len(stored_files(store))
    again = tiny_llm(tiny_dir, shared(store, "kv_producer"))
    _, cached = run(again, prompts[:1])
    assert cached == [0] and again.engine.kv_connector.stats.blocks_saved == 0
    both = tiny_llm(tiny_dir, shared(store, "kv_both"))
    tokens, cached = run(both, prompts)
    assert cached[0] == loadable_tokens(prompts[0]) and cached[1:] == [0, 0]
    assert len(stored_files(store)) == count + both.engine.kv_connector.stats.blocks_saved
    assert both.engine.kv_connector.stats.blocks_saved == sum(
        (len(p) + GREEDY.max_tokens - 1) // BLOCK for p in prompts[1:])  # every full block the step computed
    assert tokens == run(tiny_llm(tiny_dir), prompts)[0]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_block_is_computed_not_trusted(tiny_dir, prompts, tmp_path, damage):
    store = tmp_path / "kv"
    prompt = prompts[2]
    reference, _ = run(tiny_llm(tiny_dir, shared(store, "kv_producer")), [prompt])
    producer_ns = next(store.iterdir()).name
    keys = sorted(stored_files(store / producer_ns))
    assert len(keys) >= 6
    # damage the 4th block of the prompt: its key is its chain hash, so find it through a consumer's hashes
    consumer = tiny_llm(tiny_dir, shared(store, "kv_consumer"))
    seq_hashes = _block_hashes(consumer, prompt)
    victim = store / consumer.engine.kv_connector.key(seq_hashes[3])
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] if damage == "truncate" else data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:])
    tokens, cached = run(consumer, [prompt])
    assert tokens == reference
    assert cached == [3 * BLOCK]  # the blocks before the bad one; the rest were computed
    assert consumer.engine.kv_connector.stats.blocks_rejected == 1


def _block_hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from engine.sequence import Sequence

    seq = Sequence(0, "probe", prompt, GREEDY)
    llm.engine.kv_manager.update_block_hashes(seq)
    return seq.block_hashes


def test_no_block_crosses_a_salt_a_namespace_or_a_model(tiny_dir, prompts, tmp_path):
    store = tmp_path / "kv"
    run(tiny_llm(tiny_dir, shared(store, "kv_producer")), prompts, cache_salt="tenant-a")
    salted = tiny_llm(tiny_dir, shared(store, "kv_consumer"))
    assert run(salted, prompts, cache_salt="tenant-b")[1] == [0, 0, 0]
    assert run(salted, prompts)[1] == [0, 0, 0]  # unsalted requests do not see tenant-a's blocks either
    assert salted.engine.kv_connector.stats.blocks_loaded == 0
    assert run(salted, prompts, cache_salt="tenant-a")[1] == [loadable_tokens(p) for p in prompts]

    other_namespace = tiny_llm(tiny_dir, shared(store, "kv_consumer", namespace="deployment-2"))
    assert run(other_namespace, prompts, cache_salt="tenant-a")[1] == [0, 0, 0]
    other_dtype = tiny_llm(tiny_dir, shared(store, "kv_consumer"), kv_cache_dtype="fp8")
    assert run(other_dtype, prompts, cache_salt="tenant-a")[1] == [0, 0, 0]
    other_model = tmp_path / "other-model"
    save_random_model(other_model, seed=2)
    assert run(tiny_llm(other_model, shared(store, "kv_consumer")), prompts, cache_salt="tenant-a")[1] == [0, 0, 0]
    namespaces = {salted.engine.kv_connector.namespace, other_namespace.engine.kv_connector.namespace,
                  other_dtype.engine.kv_connector.namespace}
    assert len(namespaces) == 3


def test_fp8_pools_round_trip_their_bytes(tiny_dir, prompts, tmp_path):
    store = tmp_path / "kv"
    reference, _ = run(tiny_llm(tiny_dir, kv_cache_dtype="fp8"), prompts)
    producer = tiny_llm(tiny_dir, shared(store, "kv_producer"), kv_cache_dtype="fp8")
    assert run(producer, prompts)[0] == reference
    consumer = tiny_llm(tiny_dir, shared(store, "kv_consumer"), kv_cache_dtype="fp8")
    tokens, cached = run(consumer, prompts)
    assert tokens == reference and cached == [loadable_tokens(p) for p in prompts]
    pool = consumer.engine.runner.attention.k_caches[0]
    assert pool.element_size() == 1
    assert consumer.engine.runner.transfer.bytes_per_block == producer.engine.runner.transfer.bytes_per_block


class DictStore:
    """A store of the user's: anything with get and put."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, data: bytes) -> None:
        self.data[key] = data


def test_any_get_put_store_plugs_in(tiny_dir, prompts):
    store = DictStore()
    config = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kv_store": store, "kv_secret": SECRET}}
    reference, _ = run(tiny_llm(tiny_dir, config), prompts)
    assert store.data
    tokens, cached = run(tiny_llm(tiny_dir, config), prompts)
    assert tokens == reference and cached == [loadable_tokens(p) for p in prompts]


@pytest.mark.service  # the machine's Redis
def test_redis_connector_round_trip(tiny_dir, prompts):
    import redis

    url, prefix = "redis://localhost:6379/15", f"tokenmill-test:{uuid.uuid4().hex}:"
    client = redis.Redis.from_url(url)
    config = {"kv_connector": "RedisConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"redis_url": url, "redis_key_prefix": prefix, "kv_secret": SECRET}}
    try:
        producer = tiny_llm(tiny_dir, config)
        reference, _ = run(producer, prompts)
        keys = list(client.scan_iter(match=prefix + "*"))
        assert len(keys) == producer.engine.kv_connector.stats.blocks_saved > 0
        consumer = tiny_llm(tiny_dir, {**config, "kv_role": "kv_consumer"})
        tokens, cached = run(consumer, prompts)
        assert tokens == reference and cached == [loadable_tokens(p) for p in prompts]
        assert len(list(client.scan_iter(match=prefix + "*"))) == len(keys)
    finally:
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)
        client.close()


SCRIPT = """
import json, sys
import torch
torch.set_num_threads(2)
from engine import LLM, SamplingParams
role, store, prompts_file, out_file = sys.argv[1:5]
config = None if role == "none" else {"kv_connector": "SharedStorageConnector", "kv_role": role,
                                      "kv_connector_extra_config": {"shared_storage_path": store,
                                                                    "kv_secret": "test-deployment-kv-secret"}}
llm = LLM("smollm2-135m", dtype="float32", num_threads=2, kv_transfer_config=config)
outs = llm.generate(json.load(open(prompts_file)), SamplingParams(max_tokens=16, temperature=0))
stats = llm.engine.kv_connector.stats.__dict__ if config else {}
json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "cached": [o.num_cached_tokens for o in outs],
           "stats": stats}, open(out_file, "w"))
"""


def test_real_model_producer_and_fresh_consumer_processes_match_one_process(model_dir, tokenizer, tmp_path):
    """The done-when check: offline, a producer process and a fresh consumer process give the same float32 greedy
    tokens as one process, and the consumer loads at least 80% of each prompt's tokens through the connector."""
    from tests.engine.identity import PASSAGE

    prompts = [tokenizer.encode(f"Note {i}. " + PASSAGE * 4)[:length] for i, length in enumerate((210, 300, 390))]
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]

    def process(role: str) -> dict:
        out = tmp_path / f"{role}.json"
        subprocess.run([sys.executable, str(script), role, str(tmp_path / "kv"), str(prompts_file), str(out)],
                       cwd=root, check=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
        return json.loads(out.read_text())

    one = process("none")
    producer = process("kv_producer")
    consumer = process("kv_consumer")
    assert producer["tokens"] == one["tokens"]
    assert consumer["tokens"] == one["tokens"]
    assert producer["stats"]["blocks_saved"] > 0 and consumer["stats"]["blocks_saved"] == 0
    for prompt, cached in zip(prompts, consumer["cached"], strict=True):
        assert cached >= 0.8 * len(prompt), (cached, len(prompt))
    assert consumer["stats"]["blocks_loaded"] * 16 == sum(consumer["cached"])  # all through the connector
