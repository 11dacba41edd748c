"""Flat step batches: the tokens each sequence computes this step, laid out for the attention backends.

Shared by the model runner (target model) and the draft proposer (its own KV pool, same block tables).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import PrefillGroup, StepBatch, shared_prefix_blocks, zero_blocks
from engine.block_pool import NULL_BLOCK
from engine.sequence import Sequence


@dataclass
class BatchItem:
    seq: Sequence
    start: int  # position of the first token computed
    token_ids: list[int]  # tokens computed at positions start, start + 1, ...


@dataclass
class Rows:
    first: int  # flat-batch row of the item's first token
    count: int

    @property
    def last(self) -> int:
        return self.first + self.count - 1


def build_step_batch(items: list[BatchItem], block_size: int,
                     to_tensor: Callable[[list], torch.Tensor]) -> tuple[StepBatch, dict[int, Rows]]:
    """The flat batch with single-token items first, shortest context first, and each sequence's rows in it
    (by seq_id). `sample_indices` is left empty: callers choose their rows."""
    bs = block_size
    decodes = sorted((item for item in items if len(item.token_ids) == 1), key=lambda item: item.start)
    prefills = [item for item in items if len(item.token_ids) > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: dict[int, Rows] = {}
    for item in decodes + prefills:
        table, count = item.seq.block_table, len(item.token_ids)
        rows[item.seq.seq_id] = Rows(len(input_ids), count)
        input_ids.extend(item.token_ids)
        positions.extend(range(item.start, item.start + count))
        slots.extend(table[p // bs] * bs + p % bs for p in range(item.start, item.start + count))

    def tables(group: list[BatchItem]) -> torch.Tensor:
        width = max(len(i.seq.block_table) for i in group)
        return to_tensor([i.seq.block_table + [NULL_BLOCK] * (width - len(i.seq.block_table)) for i in group])

    def shared(group: list[BatchItem]) -> int:
        if len(group) < 2:
            return 0
        return shared_prefix_blocks([i.seq.block_table for i in group], [i.start for i in group], bs)

    prefill = None
    if prefills:
        prefill = PrefillGroup(
            query_lens=[len(i.token_ids) for i in prefills],
            context_lens=[i.start + len(i.token_ids) for i in prefills],
            block_tables=tables(prefills),
            shared_blocks=shared(prefills),
        )
    decode_lens = [i.start + 1 for i in decodes]  # ascending
    batch = StepBatch(
        input_ids=to_tensor(input_ids),
        positions=to_tensor(positions),
        slot_mapping=to_tensor(slots),
        num_decodes=len(decodes),
        decode_context_lens=to_tensor(decode_lens),
        decode_block_tables=tables(decodes) if decodes else to_tensor([[NULL_BLOCK]]),
        decode_max_context_len=max(decode_lens, default=0),
        decode_context_lens_list=decode_lens,
        prefill=prefill,
        sample_indices=to_tensor([]),
        decode_shared_blocks=shared(decodes),
    )
    return batch, rows


class PoolZeroing:
    """Zero pool blocks on first use: masked-out slots are still read, so they must be finite, and zeroing
    lazily keeps start-up fast and memory committed only as the pool fills. Block ids at or past the
    high-water mark have never been handed out (the free queue starts in id order)."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        self.zeroed = 0
        self.ensure(1)  # the null block

    def ensure(self, end: int) -> None:
        if end > self.zeroed:
            zero_blocks(self.caches, self.zeroed, end)
            self.zeroed = end

    def cover(self, items: list[BatchItem]) -> None:
        self.ensure(1 + max((max(i.seq.block_table) for i in items if i.seq.block_table), default=0))
