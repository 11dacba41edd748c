"""Swap preemption's bookkeeping: a host-side pool of KV blocks that preempted sequences move to and back
from (vLLM v0's swap space). Plain Python like engine/block_pool.py: the scheduler plans (src, dst) block pairs
here, the runner's `KVTransfer` copies them.

A swapped-out sequence keeps its tokens and `num_computed_tokens`; its device blocks are freed (one reference
each, so a block shared with a forked sample or kept by the prefix cache stays for them) and its computed
blocks are copied to host blocks of its own. Swapping in takes fresh device blocks for all of them, so it resumes
without recomputing anything.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from engine.block_pool import KVCacheManager
from engine.sequence import Sequence

# preemption_mode=None swaps a victim with at least this many computed tokens and recomputes a shorter one:
# re-prefilling 256 tokens costs about as much as one batched prefill chunk, copying them back costs far less.
SWAP_MIN_COMPUTED_TOKENS = 256


@dataclass
class SwapStats:
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


class SwapSpace:
    """Host blocks 0..num_blocks-1, the lowest free id handed out first (the runner's host tensors grow to the
    highest id used). Swap-outs wait in `pending_out` until a step runs; swap-ins go straight into the plan."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks))  # a heap
        self.pending_out: list[tuple[int, int]] = []  # (device block, host block), copied before the next step
        self.stats = SwapStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        """Share of the host blocks held by swapped-out sequences (vLLM v0's cpu_cache_usage)."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def swap_out(self, seq: Sequence, kv: KVCacheManager) -> bool:
        """Move seq's computed blocks to host blocks and free its device blocks; False (nothing done) when it has
        no computed block or the host pool has too few free blocks."""
        count = kv.blocks_needed(seq.num_computed_tokens)
        if count == 0 or count > self.num_free_blocks:
            return False
        # a block copied-on-write in this step holds nothing yet: its contents are still in the source block
        pending_sources = {dst: src for src, dst in kv.pending_copies}
        sources = [pending_sources.get(block, block) for block in seq.block_table[:count]]
        host = [heapq.heappop(self.free_ids) for _ in range(count)]
        self.pending_out.extend(zip(sources, host, strict=True))
        kv.free(seq)
        seq.host_block_table = host
        self.stats.blocks_swapped_out += count
        return True

    def can_swap_in(self, seq: Sequence, kv: KVCacheManager, num_new_tokens: int, keep_watermark: bool) -> bool:
        """Whether seq's host blocks and its next `num_new_tokens` fit in the free device blocks, keeping the
        watermark free for running sequences (as `KVCacheManager.can_admit`)."""
        needed = max(kv.blocks_needed(seq.num_computed_tokens + num_new_tokens), len(seq.host_block_table))
        reserve = kv.watermark_blocks if keep_watermark else 0
        return needed + reserve <= kv.pool.num_free_blocks

    def swap_in(self, seq: Sequence, kv: KVCacheManager) -> list[tuple[int, int]]:
        """Give seq fresh device blocks for its host blocks and free those; returns the (host, device) copies."""
        host = seq.host_block_table
        device = kv.pool.allocate(len(host))
        seq.block_table = device
        seq.num_registered_blocks = 0  # registered again, on these blocks, as allocate_slots fills them
        self._release(seq)  # a swap-out into them still pending is copied first, in the same step
        self.stats.blocks_swapped_in += len(host)
        return list(zip(host, device, strict=True))

    def free(self, seq: Sequence) -> None:
        """Release seq's host blocks; copies into them not yet made are dropped (it finished while swapped)."""
        if not seq.host_block_table:
            return
        if self.pending_out:
            dropped = set(seq.host_block_table)
            self.pending_out = [(s, d) for s, d in self.pending_out if d not in dropped]
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        for block in seq.host_block_table:
            heapq.heappush(self.free_ids, block)
        seq.host_block_table = []

    def take_swap_outs(self) -> list[tuple[int, int]]:
        pairs, self.pending_out = self.pending_out, []
        return pairs
