"""Reference paged attention in plain torch (the CPU backend).

Each group of sequences gathers its blocks per KV head with one `index_select`, pads queries to the
group's longest, and runs one masked `scaled_dot_product_attention` per layer: no per-sequence loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, StepBatch


@dataclass
class _Group:
    start: int  # first token of the group in the flat batch
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_context_len: int
    gather_index: torch.Tensor  # [Hkv * num_seqs * max_blocks] rows of the [Hkv*NB, bs*D] pool view
    mask: torch.Tensor  # bool, broadcastable to [Hkv, num_seqs, G * max_query_len, context]
    pad_index: torch.Tensor | None  # prefill only: flat token -> padded query row
    unpad_index: torch.Tensor | None  # prefill only: padded row -> flat token


class TorchAttention(AttentionBackend):
    name = "torch"

    def begin_step(self, batch: StepBatch) -> None:
        device = batch.slot_mapping.device
        heads = torch.arange(self.num_kv_heads, device=device)
        pool_slots = self.num_blocks * self.block_size
        self.write_index = (heads[:, None] * pool_slots + batch.slot_mapping[None, :]).reshape(-1)
        self.groups: list[_Group] = []
        if batch.num_decodes:
            self.groups.append(self._decode_group(batch, heads))
        if batch.prefill is not None:
            self.groups.append(self._prefill_group(batch, heads))

    def _gather_index(self, block_tables: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        return (heads[:, None, None] * self.num_blocks + block_tables[None]).reshape(-1)

    def _decode_group(self, batch: StepBatch, heads: torch.Tensor) -> _Group:
        tables = batch.decode_block_tables
        length = tables.shape[1] * self.block_size
        key_pos = torch.arange(length, device=tables.device)
        mask = (key_pos[None, :] < batch.decode_context_lens[:, None])[None, :, None, :]
        return _Group(0, batch.num_decodes, batch.num_decodes, 1, length,
                      self._gather_index(tables, heads), mask, None, None)

    def _prefill_group(self, batch: StepBatch, heads: torch.Tensor) -> _Group:
        group = batch.prefill
        device = group.block_tables.device
        num_seqs, max_q = len(group.query_lens), max(group.query_lens)
        length = group.block_tables.shape[1] * self.block_size
        q_lens = torch.tensor(group.query_lens, device=device)
        ctx_lens = torch.tensor(group.context_lens, device=device)
        row = torch.arange(max_q, device=device)
        valid = row[None, :] < q_lens[:, None]  # [S, Lq]
        starts = torch.cumsum(q_lens, 0) - q_lens
        pad_index = torch.where(valid, starts[:, None] + row[None, :], 0).reshape(-1)
        unpad_index = valid.reshape(-1).nonzero().squeeze(1)
        query_pos = (ctx_lens - q_lens)[:, None] + row[None, :]  # absolute position of each query row
        key_pos = torch.arange(length, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; also bounds the context
        mask = mask[None, :, None].expand(1, num_seqs, self.group, max_q, length)
        mask = mask.reshape(1, num_seqs, self.group * max_q, length)
        return _Group(batch.num_decodes, int(q_lens.sum()), num_seqs, max_q, length,
                      self._gather_index(group.block_tables, heads), mask, pad_index, unpad_index)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        hkv, d, g = self.num_kv_heads, self.head_dim, self.group
        k_pool, v_pool = self.k_caches[layer], self.v_caches[layer]
        k_pool.view(-1, d).index_copy_(0, self.write_index, k.view(num_tokens, hkv, d).transpose(0, 1).reshape(-1, d))
        v_pool.view(-1, d).index_copy_(0, self.write_index, v.view(num_tokens, hkv, d).transpose(0, 1).reshape(-1, d))
        k_rows = k_pool.view(hkv * self.num_blocks, self.block_size * d)
        v_rows = v_pool.view(hkv * self.num_blocks, self.block_size * d)
        out = torch.empty_like(q)
        for grp in self.groups:
            keys = k_rows.index_select(0, grp.gather_index).view(hkv, grp.num_seqs, grp.max_context_len, d)
            values = v_rows.index_select(0, grp.gather_index).view(hkv, grp.num_seqs, grp.max_context_len, d)
            q_grp = q[grp.start:grp.start + grp.num_tokens]
            if grp.pad_index is None:  # decode: one query row per sequence
                queries = q_grp.view(grp.num_seqs, hkv, g, d).transpose(0, 1)
                attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=grp.mask)
                out[grp.start:grp.start + grp.num_tokens] = attn.transpose(0, 1).reshape(grp.num_tokens, -1)
                continue
            lq = grp.max_query_len
            queries = q_grp.index_select(0, grp.pad_index).view(grp.num_seqs, lq, hkv, g, d)
            queries = queries.permute(2, 0, 3, 1, 4).reshape(hkv, grp.num_seqs, g * lq, d)
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=grp.mask)
            attn = attn.view(hkv, grp.num_seqs, g, lq, d).permute(1, 3, 0, 2, 4).reshape(grp.num_seqs * lq, -1)
            out[grp.start:grp.start + grp.num_tokens] = attn.index_select(0, grp.unpad_index)
        return out
