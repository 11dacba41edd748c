"""The KV connector: whole KV blocks shared between engines through a byte store, keyed by an HMAC of the prefix
cache's chain hashes (which already hold the request's salt and adapter) under a namespace of the model's identity,
both keyed by the deployment's secret, and sealed by an HMAC tag under it (store.seal). Synchronous,
on the engine's process, in vLLM v1's terms:

- scheduler side: `get_num_new_matched_tokens` (how many tokens past the local prefix cache the store can give:
  whole blocks, never the prompt's last token, each block read and checked here), `update_state_after_alloc`
  (which pool blocks those land in: the plan's `kv_loads`), `request_finished`;
- worker side: the runner's `KVTransfer.start_load_kv` writes the plan's loads before the forward, and
  `wait_for_save` stores the full blocks a step computed that the store does not hold yet.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import KVTransferConfig, secret_bytes
from engine.kv_connector.store import ByteStore, contains, seal, unseal
from engine.step_hooks import StepHook
from engine.step_types import KVLoad

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.kv_transfer import KVTransfer
    from engine.sequence import Sequence
    from engine.step_types import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("tokenmill.engine")

KNOWN_BLOCKS = 1 << 16  # block hashes remembered as stored, so a producer asks the store about each only once
STORE_PAUSE_S = 5.0  # after a store call fails, the store is left alone this long: a hung Redis costs one timeout


@dataclass
class KVConnectorStats:
    blocks_loaded: int = 0  # blocks written into the pool from the store
    blocks_saved: int = 0  # blocks put in the store
    blocks_rejected: int = 0  # stored blocks whose tag did not verify or of the wrong size (computed instead)
    store_errors: int = 0  # get/put calls that raised (the block is computed, or not saved)


class KVConnector(StepHook):
    """`store`: where blocks live; `namespace`: the keyed digest of the model's identity that starts every key
    (factory.namespace_of); `kv`: the engine's block manager (block hashes); `transfer`: the runner's block copier
    (reads and writes pool blocks). The secret (config's `kv_secret`) seals blocks and keys their names. A hook of
    the engine step: it saves after the runner."""

    def __init__(self, config: KVTransferConfig, store: ByteStore, namespace: str, kv: KVCacheManager,
                 transfer: KVTransfer) -> None:
        self.config = config
        self.store = store
        self.namespace = namespace
        self._secret = secret_bytes(config.kv_connector_extra_config.get("kv_secret"))
        self.kv = kv
        self.transfer = transfer
        self.block_size = kv.block_size
        self.stats = KVConnectorStats()
        self._staged: tuple[int, int, list[tuple[bytes, bytes]]] | None = None  # seq_id, first block, found
        self._saved: dict[int, int] = {}  # seq_id -> its leading blocks saved (or found stored) already
        self._known: OrderedDict[bytes, None] = OrderedDict()  # block hashes known to be in the store
        self._rejected: set[bytes] = set()  # hashes whose stored block failed its check: a producer overwrites it
        self._paused_until = 0.0  # monotonic time before which the store is not called (STORE_PAUSE_S)

    @staticmethod
    def make_store(extra: dict[str, Any]) -> ByteStore:
        """The connector's own store from its extra config (a `kv_store` object given there wins)."""
        raise NotImplementedError

    def key(self, block_hash: bytes) -> str:
        """The block's name in the store: not computable from its tokens and salt without the secret."""
        return f"{self.namespace}/{hmac.new(self._secret, block_hash, hashlib.sha256).hexdigest()}"

    # scheduler side

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Tokens past the first `num_computed_tokens` (the local prefix-cache hit, whole blocks) that the store
        can give: the leading run of stored blocks that pass their checksum, the prompt's last token never among
        them (the model computes at least one token, for its logits). Those blocks are read now and kept for
        `update_state_after_alloc`; asking again for the same sequence reuses them."""
        if not self.config.is_kv_consumer:
            return 0
        first, end = num_computed_tokens // self.block_size, (seq.num_tokens - 1) // self.block_size
        if first >= end:
            return 0
        self.kv.update_block_hashes(seq)
        kept = {} if self._staged is None or self._staged[0] != seq.seq_id else dict(self._staged[2])
        found = []
        for block_hash in seq.block_hashes[first:end]:
            payload = kept.get(block_hash) or self._fetch(block_hash)
            if payload is None:
                break
            found.append((block_hash, payload))
        self._staged = (seq.seq_id, first, found)
        return len(found) * self.block_size

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> list[KVLoad]:
        """The loads of seq's `num_external_tokens` (as matched just before), into the blocks just allocated."""
        if self._staged is None or self._staged[0] != seq.seq_id:
            raise RuntimeError(f"sequence {seq.seq_id} was allocated external tokens it was not matched for")
        _, first, found = self._staged
        self._staged = None
        count = num_external_tokens // self.block_size
        loads = [KVLoad(seq.block_table[first + i], block_hash, payload)
                 for i, (block_hash, payload) in enumerate(found[:count])]
        self.stats.blocks_loaded += len(loads)
        return loads

    def request_finished(self, seq: Sequence) -> None:
        self._saved.pop(seq.seq_id, None)
        if self._staged is not None and self._staged[0] == seq.seq_id:
            self._staged = None

    # worker side

    def after_execute(self, plan: SchedulerOutput, output: ModelRunnerOutput, started: float) -> None:
        self.wait_for_save(plan)  # the full blocks this step computed, while the plan still holds them

    def wait_for_save(self, plan: SchedulerOutput) -> None:
        """Store the full blocks this step computed (run after the forward, before the blocks can be freed) that
        the store does not hold yet; returns once they are stored. Only a producer (kv_producer, kv_both) saves."""
        if not self.config.is_kv_producer:
            return
        block_ids: list[int] = []
        hashes: dict[bytes, None] = {}  # in order, each once (two sequences may compute one block in a step)
        for seq, num_new, _ in plan.scheduled:
            full = (seq.num_computed_tokens + num_new) // self.block_size
            done = self._saved.get(seq.seq_id, 0)
            if full <= done:
                continue
            self.kv.update_block_hashes(seq)
            for index in range(done, full):
                block_hash = seq.block_hashes[index]
                if block_hash not in hashes and not self._stored(block_hash):
                    block_ids.append(seq.block_table[index])
                    hashes[block_hash] = None
            self._saved[seq.seq_id] = full
        if not block_ids:
            return
        for block_hash, payload in zip(hashes, self.transfer.read_blocks(block_ids), strict=True):
            key = self.key(block_hash)
            if self._store_paused():
                return
            try:
                self.store.put(key, seal(key, payload, self._secret))
            except Exception as problem:  # a store that is down costs the saves, never the step
                self._store_failed("save", key, problem)
                continue
            self.stats.blocks_saved += 1
            self._rejected.discard(block_hash)
            self._remember(block_hash)

    # helpers

    def _store_paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def _store_failed(self, action: str, key: str, problem: Exception) -> None:
        self.stats.store_errors += 1
        self._paused_until = time.monotonic() + STORE_PAUSE_S
        log.warning("KV connector: could not %s block %s (%s: %s); not calling the store for %.0f s", action, key,
                    type(problem).__name__, problem, STORE_PAUSE_S)

    def _stored(self, block_hash: bytes) -> bool:
        if block_hash in self._known:
            return True
        if block_hash in self._rejected or self._store_paused():
            return False
        try:
            found = contains(self.store, self.key(block_hash))
        except Exception as problem:
            self._store_failed("look up", self.key(block_hash), problem)
            return False
        if found:
            self._remember(block_hash)
        return found

    def _fetch(self, block_hash: bytes) -> bytes | None:
        """A stored block's verified payload, or None (missing, unreadable, or its tag or size wrong)."""
        key = self.key(block_hash)
        if self._store_paused():
            return None
        try:
            data = self.store.get(key)
        except Exception as problem:
            self._store_failed("read", key, problem)
            return None
        if data is None:
            return None
        payload = unseal(key, data, self.transfer.bytes_per_block, self._secret)
        if payload is None:
            self.stats.blocks_rejected += 1
            self._rejected.add(block_hash)
            self._known.pop(block_hash, None)
            log.warning("KV connector: block %s failed its tag or size check; computing it instead", key)
            return None
        self._remember(block_hash)
        return payload

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        if len(self._known) > KNOWN_BLOCKS:
            self._known.popitem(last=False)
