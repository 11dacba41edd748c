"""Draft-model proposers: a separate causal LM with the target's tokenizer, or the target's own first
layers and head (self-speculative). The draft keeps its own paged KV pool over the target's block ids."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.attention.base import allocate_kv_pool
from engine.batch import BatchItem, PoolZeroing, build_step_batch
from engine.models.llama import head_dim_of
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig

log = logging.getLogger("tokenmill.engine")


def self_draft_layers(config: SpeculativeConfig, total: int) -> int:
    layers = config.draft_layers or max(1, total // 4)
    if not 1 <= layers < total:
        raise ValueError(f"draft_layers must be in [1, {total - 1}], got {layers}")
    return layers


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, element: int) -> int:
    return 2 * num_layers * num_kv_heads * block_size * head_dim * element


def draft_memory(settings: dict[str, Any] | None, runner) -> tuple[int, int]:
    """(weights bytes, KV bytes per block) that the proposer of `settings` adds to the target's: a draft
    model's weights and KV pool, the self-draft's KV pool over the target's first layers, nothing for
    n-gram lookups. Read before the proposer exists, so the memory plan can count it."""
    if not settings:
        return 0, 0
    from transformers import AutoConfig

    from engine.model_loader import resolve_model
    from engine.models.llama import LlamaForCausalLM

    config = SpeculativeConfig.from_dict(settings)
    element = runner.dtype.itemsize
    if config.method == "self":
        layers = self_draft_layers(config, runner.num_layers)
        return 0, kv_bytes_per_block(layers, runner.num_kv_heads, runner.block_size, runner.head_dim, element)
    if config.method != "draft":
        return 0, 0
    hf_config = AutoConfig.from_pretrained(resolve_model(config.model))
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, runner.max_model_len)
    weights = sum(p.numel() for p in model.parameters()) * element
    return weights, kv_bytes_per_block(hf_config.num_hidden_layers, hf_config.num_key_value_heads,
                                       runner.block_size, head_dim_of(hf_config), element)


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, runner) -> None:
        from transformers import AutoConfig

        from engine.model_loader import resolve_model
        from engine.model_runner import load_model

        self.runner = runner
        if config.method == "self":
            self.model = runner.model
            self.num_layers = self_draft_layers(config, runner.num_layers)
            hf_config = runner.model.config
        else:
            draft_dir = resolve_model(config.model)
            hf_config = AutoConfig.from_pretrained(draft_dir)
            if hf_config.vocab_size != runner.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({hf_config.vocab_size}) differs from the "
                                 f"target's ({runner.vocab_size}): it must share the target's tokenizer")
            self.model = load_model(draft_dir, hf_config, runner.max_model_len, runner.dtype, runner.device)
            self.num_layers = hf_config.num_hidden_layers
        k, v = allocate_kv_pool(self.num_layers, hf_config.num_key_value_heads, runner.num_blocks, runner.block_size,
                                head_dim_of(hf_config), runner.dtype, runner.device)
        self.attention = runner.make_backend(k, v, hf_config.num_attention_heads)
        self.zeroing = PoolZeroing(k + v)
        pool_bytes = sum(t.nbytes for t in k + v)
        if pool_bytes > runner.num_blocks * runner.kv_plan.draft_bytes_per_block:
            log.warning("the draft's KV pool (%.0f MiB) was not in the memory plan: set speculative_config on the "
                        "engine, not only per job, to count it", pool_bytes / 2**20)

    def _run(self, items: list[BatchItem]) -> torch.Tensor:
        """Draft logits at each item's last token."""
        self.zeroing.cover(items)
        batch, rows = build_step_batch(items, self.runner.block_size, self.runner._tensor)
        self.attention.begin_step(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.attention.forward, self.num_layers)
        last = self.runner._tensor([rows[i.seq.seq_id].last for i in items])
        return self.model.compute_logits(hidden.index_select(0, last))

    @torch.inference_mode()
    def propose(self, work: list[tuple[Sequence, int]]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Catch the draft's KV up with each sequence's tokens, then draft k tokens autoregressively. Returns
        {seq_id: drafts} and, for sampled sequences, {seq_id: the draft's distributions at them}."""
        sampler = self.runner.sampler
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
    def _draw(logits: torch.Tensor, seq: Sequence, sampler) -> tuple[int, torch.Tensor | None]:
        if seq.params.temperature == 0:
            return int(logits.argmax()), None
        distribution = sampler.probabilities(logits[None], [seq.params])[0]
        noise = torch.empty_like(distribution).exponential_(generator=sampler.generator_of(seq))
        return int((distribution / noise).argmax()), distribution
