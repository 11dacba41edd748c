"""Draft-model proposers: a separate causal LM with the target's tokenizer, or the target's own first
layers and head (self-speculative). The draft keeps its own paged KV pool over the target's block ids."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.attention.base import AttentionBackend, allocate_kv_pool
from engine.batch import BatchItem, PoolZeroing, build_step_batch
from engine.model_loader import load_model, resolve_model
from engine.models.llama import LlamaForCausalLM, head_dim_of
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.kv_cache_interface import KVPlan, ModelShape
    from engine.sampler import Sampler

log = logging.getLogger("tokenmill.engine")


class DraftSetup(NamedTuple):
    """What a draft proposer takes from the target's side: its model and shape, the memory plan (the pool's blocks
    and the room planned for the draft's), the attention factory and tensor maker, and the sampler whose streams the
    drafts draw from."""

    model: LlamaForCausalLM  # the target model (a self-draft runs its first layers)
    shape: ModelShape  # block size, max_model_len, dtype and device
    plan: KVPlan  # num_blocks, and draft_bytes_per_block: the plan's room per block for the draft's KV pool
    make_attention: Callable[..., AttentionBackend]  # (k caches, v caches, num_heads, windows) -> a backend
    to_tensor: Callable[[list], torch.Tensor]
    sampler: Sampler  # its `probabilities`, and each sequence's stream (`generator_of`)


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, setup: DraftSetup) -> None:
        from engine.hf_files import load_config

        self.setup, shape = setup, setup.shape
        target = setup.model
        if config.method == "self":
            self.model = target
            self.num_layers = config.self_draft_layers(target.config.num_hidden_layers)
            hf_config = target.config
        else:
            draft_dir = resolve_model(config.model)
            hf_config = load_config(draft_dir)
            if hf_config.vocab_size != target.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({hf_config.vocab_size}) differs from the "
                                 f"target's ({target.config.vocab_size}): it must share the target's tokenizer")
            self.model = load_model(draft_dir, hf_config, shape.max_model_len, shape.dtype, shape.device)
            self.num_layers = hf_config.num_hidden_layers
        num_blocks = setup.plan.num_blocks
        k, v = allocate_kv_pool(self.num_layers, hf_config.num_key_value_heads, num_blocks, shape.block_size,
                                head_dim_of(hf_config), shape.dtype, shape.device)
        windows = (self.model.layer_windows or [None] * self.num_layers)[:self.num_layers]
        self.attention = setup.make_attention(k, v, hf_config.num_attention_heads, windows)
        self.zeroing = PoolZeroing(k + v)
        pool_bytes = sum(t.nbytes for t in k + v)
        if pool_bytes > num_blocks * setup.plan.draft_bytes_per_block:
            log.warning("the draft's KV pool (%.0f MiB) was not in the memory plan: set speculative_config on the "
                        "engine, not only per job, to count it", pool_bytes / 2**20)

    def _run(self, items: list[BatchItem]) -> torch.Tensor:
        """Draft logits at each item's last token."""
        self.zeroing.cover(items)
        batch, rows = build_step_batch(items, self.setup.shape.block_size, self.setup.to_tensor)
        self.attention.begin_step(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attention.forward, self.num_layers)
        last = self.setup.to_tensor([rows[i.seq.seq_id].last for i in items])
        return self.model.compute_logits(hidden.index_select(0, last))

    @torch.inference_mode()
    def propose(self, work: list[tuple[Sequence, int]]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Catch the draft's KV up with each sequence's tokens, then draft k tokens autoregressively. Returns
        {seq_id: drafts} and, for sampled sequences, {seq_id: the draft's distributions at them}."""
        sampler = self.setup.sampler
        items = [BatchItem(seq, seq.draft_computed_tokens, seq.token_ids[seq.draft_computed_tokens:])
                 for seq, _ in work]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in work}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in work}
        active = work
        while active:
            logits = self._run(items)
            for row, (seq, _) in enumerate(active):
                token, distribution = self._draw(logits[row], seq, sampler)
                drafts[seq.seq_id].append(token)
                if distribution is not None:
                    probs[seq.seq_id].append(distribution)
            active = [(seq, k) for seq, k in active if len(drafts[seq.seq_id]) < k]
            items = [BatchItem(seq, seq.num_tokens + len(drafts[seq.seq_id]) - 1, drafts[seq.seq_id][-1:])
                     for seq, _ in active]
        for seq, _ in work:
            seq.draft_computed_tokens = seq.num_tokens
        return drafts, {seq_id: torch.stack(rows) for seq_id, rows in probs.items() if rows}

    @staticmethod
    def _draw(logits: torch.Tensor, seq: Sequence, sampler: Sampler) -> tuple[int, torch.Tensor | None]:
        if seq.params.temperature == 0:
            return int(logits.argmax()), None
        distribution = sampler.probabilities(logits[None], [seq.params])[0]
        noise = torch.empty_like(distribution).exponential_(generator=sampler.generator_of(seq))
        return int((distribution / noise).argmax()), distribution
