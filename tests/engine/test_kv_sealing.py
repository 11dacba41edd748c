"""KV blocks are sealed and named under the deployment's secret (issue #56 item 4): a block forged by someone who can
write the store but lacks the secret is rejected and computed, keys and namespaces cannot be computed from the
tokens and the tenant's salt alone, models are told apart by their weights (not their names), and a Redis that
never answers costs a timeout, not a hung step."""

from __future__ import annotations

import hashlib
import hmac
import shutil
import socket
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.kv_connector import store as kv_store
from tokenmill.bench.tiny_model import save_random_model

BLOCK = 8
SECRET, OTHER_SECRET = "deployment-one-kv-secret", "deployment-two-kv-secret"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SALT = "tenant-a"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sealing") / "tiny"
    save_random_model(path)
    return path


@pytest.fixture(scope="module")
def prompt():
    import random

    rng = random.Random(11)
    return [rng.randrange(3, 1000) for _ in range(60)]


def shared(path, role, secret=SECRET, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path), "kv_secret": secret, **extra}}


def tiny_llm(model_dir, kv_transfer_config=None) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_threads=2, block_size=BLOCK, max_model_len=256,
               kv_transfer_config=kv_transfer_config)


def run(llm: LLM, prompts) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts, GREEDY, cache_salt=SALT)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def block_hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from engine.sequence import Sequence

    seq = Sequence(0, "probe", prompt, GREEDY, cache_salt=SALT)
    llm.engine.kv_manager.update_block_hashes(seq)
    return seq.block_hashes


def stored_names(root) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}


def _forge(kind: str, key: str, genuine: bytes) -> bytes:
    """A stored value for `key` written by someone who can reach the store but lacks the deployment's secret."""
    head = len(kv_store.MAGIC) + kv_store.DIGEST_SIZE
    payload = bytes(len(genuine) - head)  # all-zero KV: what the forger wants the consumer to attend to
    if kind == "wrong-tag":
        return kv_store.MAGIC + bytes(kv_store.DIGEST_SIZE) + payload
    if kind == "unkeyed-checksum":  # sha256(key, payload): computable by anyone
        return kv_store.MAGIC + hashlib.sha256(key.encode() + payload).digest() + payload
    name = key.encode()  # "other-secret": a tag made as the engine makes it, under another deployment's secret
    tag = hmac.new(OTHER_SECRET.encode(), len(name).to_bytes(4, "big") + name + payload, hashlib.sha256).digest()
    return kv_store.MAGIC + tag + payload


@pytest.mark.parametrize("kind", ["wrong-tag", "unkeyed-checksum", "other-secret"])
def test_a_forged_block_is_rejected_and_computed(tiny_dir, prompt, tmp_path, kind):
    reference, _ = run(tiny_llm(tiny_dir), [prompt])
    store = tmp_path / "kv"
    assert run(tiny_llm(tiny_dir, shared(store, "kv_producer")), [prompt])[0] == reference
    consumer = tiny_llm(tiny_dir, shared(store, "kv_consumer"))
    key = consumer.engine.kv_connector.key(block_hashes(consumer, prompt)[3])
    victim = store / key
    victim.write_bytes(_forge(kind, key, victim.read_bytes()))

    tokens, cached = run(consumer, [prompt])
    assert tokens == reference
    assert cached == [3 * BLOCK]  # the three genuine blocks before the forged one; the rest computed
    assert consumer.engine.kv_connector.stats.blocks_rejected == 1


def test_keys_and_namespaces_are_not_computable_without_the_secret(tiny_dir, prompt, tmp_path):
    store = tmp_path / "kv"
    producer = tiny_llm(tiny_dir, shared(store, "kv_producer"))
    run(producer, [prompt])
    names = stored_names(store)
    assert len(names) >= 6
    hashes = block_hashes(producer, prompt)  # what anyone computes from the tokens and the tenant's salt
    assert not {h.hex() for h in hashes} & names, "a key is the block's plain chain hash"

    other = tiny_llm(tiny_dir, shared(store, "kv_consumer", secret=OTHER_SECRET))
    assert other.engine.kv_connector.namespace != producer.engine.kv_connector.namespace
    assert other.engine.kv_connector.key(hashes[0]) != producer.engine.kv_connector.key(hashes[0])
    assert run(other, [prompt])[1] == [0]  # another deployment finds none of the blocks
    assert other.engine.kv_connector.stats.blocks_loaded == 0


def test_a_connector_without_a_secret_is_refused(tmp_path):
    from engine import KVTransferConfig

    for secret in (None, "", "short"):
        extra = {"shared_storage_path": str(tmp_path)} | ({} if secret is None else {"kv_secret": secret})
        with pytest.raises(ValueError, match="kv_secret"):
            KVTransferConfig("SharedStorageConnector", "kv_both", extra)
    config = KVTransferConfig("SharedStorageConnector", "kv_both",
                              {"shared_storage_path": str(tmp_path), "kv_secret": SECRET})
    assert SECRET not in repr(config)


def test_models_named_alike_with_other_weights_share_nothing(tiny_dir, prompt, tmp_path):
    twin = tmp_path / "other" / "tiny"  # the same directory name and config.json, other weights
    save_random_model(twin, seed=2)
    assert (twin / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    copy = tmp_path / "copy" / "renamed"  # the same weights under another name
    shutil.copytree(tiny_dir, copy)

    store = tmp_path / "kv"
    producer = tiny_llm(tiny_dir, shared(store, "kv_producer"))
    run(producer, [prompt])
    impostor = tiny_llm(twin, shared(store, "kv_consumer"))
    assert impostor.engine.kv_connector.namespace != producer.engine.kv_connector.namespace
    assert run(impostor, [prompt])[1] == [0]
    same = tiny_llm(copy, shared(store, "kv_consumer"))
    assert same.engine.kv_connector.namespace == producer.engine.kv_connector.namespace
    assert run(same, [prompt])[1] == [(len(prompt) - 1) // BLOCK * BLOCK]


class SilentServer:
    """A TCP listener that accepts connections and never answers: a hung Redis."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.connections:
            connection.close()


@pytest.fixture
def silent_redis():
    server = SilentServer()
    yield f"redis://127.0.0.1:{server.port}/0"
    server.close()


def finishes_within(seconds: float, call) -> tuple[bool, object]:
    """(whether `call` returned or raised within `seconds`, its result or exception)."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(call())
        except Exception as problem:
            outcome.append(problem)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive(), (outcome[0] if outcome else None)


@pytest.mark.parametrize("timeout_s", [0.5, None])  # None: the store's own default (2 s), not redis-py's
def test_a_redis_that_never_answers_fails_the_call_within_its_timeout(silent_redis, timeout_s):
    import redis

    settings = {} if timeout_s is None else {"timeout_s": timeout_s}
    started = time.monotonic()
    done, outcome = finishes_within(15, lambda: kv_store.RedisStore(silent_redis, **settings).get("block"))
    assert done, "RedisStore.get hung on a Redis that never answers"
    assert isinstance(outcome, redis.exceptions.TimeoutError), outcome
    assert time.monotonic() - started < (timeout_s or 2) + 1


def test_a_hung_redis_costs_the_step_a_timeout_and_the_block_is_computed(tiny_dir, prompt, silent_redis):
    reference, _ = run(tiny_llm(tiny_dir), [prompt])
    config = {"kv_connector": "RedisConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"redis_url": silent_redis, "kv_secret": SECRET, "redis_timeout_s": 0.5}}
    llm = tiny_llm(tiny_dir, config)
    started = time.monotonic()
    done, outcome = finishes_within(30, lambda: run(llm, [prompt]))
    assert done, "generate hung on a Redis that never answers"
    assert outcome == (reference, [0])
    stats = llm.engine.kv_connector.stats
    assert stats.store_errors >= 1 and stats.blocks_loaded == stats.blocks_saved == 0
    assert time.monotonic() - started < 10  # one timeout, then the store is left alone a while, not one per block
