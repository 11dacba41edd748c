"""What every attention backend is given: the step's flat token layout and a paged KV pool.

KV pool layout, per layer, for K and for V: [num_kv_heads, num_blocks, block_size, head_dim].
Head-major, so the blocks of one head gathered for a batch are already [batch, length, head_dim].
An FP8 pool (engine/kv_quant.py) holds e4m3 bytes; its lists carry each layer's per-head scales, and attention
dequantises what it reads into the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_quant import FP8_DTYPE, KVScales


@dataclass
class PrefillGroup:
    """Sequences computing more than one token this step; their tokens follow the decode tokens."""

    query_lens: list[int]
    context_lens: list[int]  # tokens in the KV pool once this step's are written
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with the null block
    shared_blocks: int = 0  # leading blocks common to every sequence and before every query (see below)


@dataclass
class StepBatch:
    """One step's flat batch: the first `num_decodes` tokens are single-token (decode) sequences."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] block_id * block_size + offset
    num_decodes: int
    decode_context_lens: torch.Tensor  # [num_decodes]
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_max_context_len: int
    prefill: PrefillGroup | None
    sample_indices: torch.Tensor  # rows whose logits are needed, in scheduler order
    # Leading block-table entries that every decode sequence shares (a common prefix from the prefix
    # cache or a fork) and that lie wholly before each query: attention over them needs no mask, so a
    # backend may read them once for the whole group (cascade attention). 0 when there is none.
    decode_shared_blocks: int = 0
    decode_context_lens_list: list[int] | None = None  # decode_context_lens on the host, when known


def shared_prefix_blocks(tables: list[list[int]], first_query_positions: list[int], block_size: int) -> int:
    """Number of leading block ids common to all tables and wholly before every sequence's first query."""
    limit = min(min(first_query_positions) // block_size, min(len(t) for t in tables))
    first = tables[0]
    for index in range(limit):
        block = first[index]
        if any(t[index] != block for t in tables):
            return index
    return limit


class AttentionBackend:
    """Paged attention over one KV pool. `begin_step` once per step, then `forward` per layer."""

    name = "base"
    batch_invariant = False  # every query through one path whose result does not depend on the batch

    def set_batch_invariant(self, on: bool) -> None:
        self.batch_invariant = on

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_q_heads: int,
                 windows: list[int | None] | None = None):
        """`windows`: each layer's sliding window W (a query at position p attends to keys in (p - W, p]), None
        where the layer attends to its whole context; None: no layer has one."""
        self.layer_windows = list(windows) if windows is not None and any(windows) else None
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim = k_caches[0].shape
        self.dtype = getattr(k_caches, "compute_dtype", k_caches[0].dtype)  # what attention computes in
        self.k_scales = getattr(k_caches, "scales", None)  # FP8 pools: [layers, Hkv] float32 on the pools' device
        self.v_scales = getattr(v_caches, "scales", None)
        self.num_q_heads = num_q_heads
        self.group = num_q_heads // self.num_kv_heads

    def begin_step(self, batch: StepBatch) -> None:
        raise NotImplementedError

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] for this step's tokens -> attention output [T, Hq*D].
        Writes k/v into the pool at the step's slots first."""
        raise NotImplementedError


def sequence_tables(batch: StepBatch) -> tuple[torch.Tensor, list[int]]:
    """Every sequence's block table, decodes first, padded to one width, and each one's query length."""
    tables = [batch.decode_block_tables[:batch.num_decodes]]
    query_lens = [1] * batch.num_decodes
    if batch.prefill is not None:
        tables.append(batch.prefill.block_tables)
        query_lens += batch.prefill.query_lens
    width = max(t.shape[1] for t in tables)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables]), query_lens


def per_token_tables(batch: StepBatch) -> torch.Tensor:
    """Each token's own sequence's block table, [num_tokens, max_blocks]."""
    tables, query_lens = sequence_tables(batch)
    return tables.repeat_interleave(torch.tensor(query_lens, device=tables.device), dim=0)


class KVPools(list):
    """One layer's pool per entry, K's or V's; `scales` [layers, Hkv] (float32) where they hold FP8 bytes, and the
    model's dtype, which attention computes in."""

    def __init__(self, pools: list[torch.Tensor], compute_dtype: torch.dtype, scales: torch.Tensor | None) -> None:
        super().__init__(pools)
        self.compute_dtype = compute_dtype
        self.scales = scales


def allocate_kv_pool(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device, scales: KVScales | None = None
                     ) -> tuple[KVPools, KVPools]:
    """Uninitialised K and V pools; see `zero_blocks`, which the runner applies before first use. With `scales`,
    FP8 pools (e4m3, one byte per element) read by a model of `dtype`."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    element = FP8_DTYPE if scales is not None else dtype
    k = [torch.empty(shape, dtype=element, device=device) for _ in range(num_layers)]
    v = [torch.empty(shape, dtype=element, device=device) for _ in range(num_layers)]
    k_scales = scales.k.to(device=device, dtype=torch.float32).contiguous() if scales is not None else None
    v_scales = scales.v.to(device=device, dtype=torch.float32).contiguous() if scales is not None else None
    return KVPools(k, dtype, k_scales), KVPools(v, dtype, v_scales)


def zero_blocks(caches: list[torch.Tensor], start: int, end: int) -> None:
    """Zero blocks [start, end): masked-out slots of a block are still read, so they must be finite.
    Zeroing on first use keeps start-up fast and memory committed only as the pool fills."""
    for cache in caches:
        cache[:, start:end].zero_()
