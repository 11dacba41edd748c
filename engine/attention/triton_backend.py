"""Paged attention with Triton kernels (the CUDA backend; on CPU it runs under Triton's interpreter).

Per layer: one kernel writes the step's K/V into the pool, one attends the decode tokens, one the prefill
tokens. A decode-only step reads nothing from the host after `begin_step`, so it can be replayed as a CUDA graph.
Batch-invariant mode runs every token through the prefill kernel (a decode is a query of length 1), with one set
of tile sizes: key tiles from position 0 in fixed steps, whatever the step holds.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, PrefillGroup, StepBatch, sequence_tables

try:
    from engine.attention import triton_kernels as kernels
except ImportError as error:  # triton missing or broken
    raise ImportError(
        f"attention_backend='triton' needs the `triton` package ({error}); install it "
        "(pip install 'tokenmill[gpu]') or choose attention_backend='torch'") from error


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_q_heads: int,
                 windows: list[int | None] | None = None):
        super().__init__(k_caches, v_caches, num_q_heads, windows)
        if self.layer_windows is not None:
            raise ValueError("the Triton backend has no sliding-window attention yet: use attention_backend='torch' "
                             "for a model with sliding-window layers (Gemma 3)")
        if k_caches[0].device.type == "cpu" and not kernels.INTERPRETED:
            raise RuntimeError("the Triton backend runs on CPU tensors only in Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before starting (slow; for tests), or use attention_backend='torch'")
        kernels.check_head_dim(self.head_dim)
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")

    def begin_step(self, batch: StepBatch) -> None:
        self.slot_mapping = batch.slot_mapping
        self.num_decodes = batch.num_decodes
        self.decode_tables = batch.decode_block_tables
        self.decode_context_lens = batch.decode_context_lens
        self.prefill = batch.prefill
        if self.batch_invariant and batch.num_decodes:  # decodes join the prefills as queries of length 1
            self.prefill = self._all_as_prefill(batch)
            self.num_decodes = 0
        if self.prefill is None:
            return
        device = batch.slot_mapping.device
        starts = [0]
        for length in self.prefill.query_lens:
            starts.append(starts[-1] + length)
        self.query_starts = torch.tensor(starts, dtype=torch.long, device=device)
        self.prefill_context_lens = torch.tensor(self.prefill.context_lens, dtype=torch.long, device=device)
        self.max_query_len = max(self.prefill.query_lens)

    @staticmethod
    def _all_as_prefill(batch: StepBatch) -> PrefillGroup:
        decode_lens = batch.decode_context_lens_list or batch.decode_context_lens.tolist()
        context_lens = list(decode_lens) + (batch.prefill.context_lens if batch.prefill else [])
        tables, query_lens = sequence_tables(batch)
        return PrefillGroup(query_lens, context_lens, tables)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.k_caches[layer], self.v_caches[layer]
        scales = (self.k_scales[layer], self.v_scales[layer]) if self.k_scales is not None else (None, None)
        kernels.write_kv(k, v, k_pool, v_pool, self.slot_mapping, *scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = self.num_decodes
        if nd:
            kernels.paged_decode_attention(q[:nd], k_pool, v_pool, out[:nd], self.decode_tables,
                                           self.decode_context_lens, *scales)
        if self.prefill is not None:
            kernels.paged_prefill_attention(q[nd:], k_pool, v_pool, out[nd:], self.prefill.block_tables,
                                            self.query_starts, self.prefill_context_lens, self.max_query_len, *scales)
        return out
