"""The memory plan, made once at start-up between loading the model and allocating its KV pool: how many KV blocks
fit beside the weights, the activation peak of the largest step, the CUDA graphs' pool and the draft proposer (its
weights and its KV pool over the same block ids). Works from the model's `ModelShape`; on CUDA it profiles a
forward of the model (`ModelProbe`), building nothing it keeps. With an FP8 KV cache (engine/kv_quant.py) it also
fixes the pool's scales (calibrated or given) and counts one byte per element. The runner is handed the `KVPlan`."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.base import allocate_kv_pool, zero_blocks
from engine.batch import BatchItem, build_step_batch
from engine.kv_cache_interface import KVPlan, ModelProbe, ModelShape
from engine.kv_quant import KVScales, kv_scales_for
from engine.models.llama import head_dim_of
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig

__all__ = ["KVPlan", "ModelProbe", "ModelShape", "plan_kv_cache"]

log = logging.getLogger("tokenmill.engine")


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, element: int) -> int:
    return 2 * num_layers * num_kv_heads * block_size * head_dim * element


def draft_memory(settings: dict[str, Any] | None, shape: ModelShape) -> tuple[int, int]:
    """(weights bytes, KV bytes per block) that the proposer of `settings` adds to the target's: a draft
    model's weights and KV pool, the self-draft's KV pool over the target's first layers, nothing for
    n-gram lookups. Read before the proposer exists, so the memory plan can count it."""
    if not settings:
        return 0, 0
    from engine.hf_files import load_config
    from engine.model_loader import resolve_model
    from engine.models import causal_lm_class

    config = SpeculativeConfig.from_dict(settings)
    element = shape.dtype.itemsize
    if config.method == "self":
        layers = config.self_draft_layers(shape.num_layers)
        return 0, kv_bytes_per_block(layers, shape.num_kv_heads, shape.block_size, shape.head_dim, element)
    if config.method != "draft":
        return 0, 0
    hf_config = load_config(resolve_model(config.model))
    with torch.device("meta"):
        model = causal_lm_class(hf_config)(hf_config, shape.max_model_len)
    weights = sum(p.numel() for p in model.parameters()) * element
    return weights, kv_bytes_per_block(hf_config.num_hidden_layers, hf_config.num_key_value_heads,
                                       shape.block_size, head_dim_of(hf_config), element)


def activation_peak(config: EngineConfig, shape: ModelShape, probe: ModelProbe,
                    kv_scales: KVScales | None = None) -> int:
    """Peak activation memory of the largest step: measured with a profiling forward on CUDA, estimated on CPU."""
    tokens = config.max_num_batched_tokens
    if shape.device.type == "cuda":
        return profile_forward_peak(shape, probe, tokens, config.max_num_seqs, kv_scales)
    element = shape.dtype.itemsize
    per_token = (4 * shape.hidden_size + 3 * shape.intermediate_size
                 + (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * 2) * element
    attention = min(tokens, shape.max_model_len) ** 2 * shape.num_heads * element  # masked scores, worst case
    logits = config.max_num_seqs * shape.vocab_size * 4 * 3
    return tokens * per_token + attention + logits


def graph_pool_peak(config: EngineConfig, shape: ModelShape, probe: ModelProbe,
                    kv_scales: KVScales | None = None) -> int:
    """The CUDA graphs' private pool: graphs keep the intermediate tensors of a decode forward at the largest
    captured batch, beside whatever an eager step allocates. Estimated by the peak of an eager forward of that
    many tokens (the graphs share one pool, largest captured first)."""
    if not shape.cuda_graphs:
        return 0
    from engine.cuda_graphs import capture_sizes

    return profile_forward_peak(shape, probe, capture_sizes(config.max_num_seqs)[-1], 0, kv_scales)


@torch.inference_mode()
def profile_forward_peak(shape: ModelShape, probe: ModelProbe, num_tokens: int, num_logit_rows: int,
                         kv_scales: KVScales | None = None) -> int:
    """Bytes a forward of `num_tokens` prompt tokens (sequences of at most max_model_len) and the sampling of
    `num_logit_rows` rows allocate at their peak, beyond what was allocated before; run over a scratch KV pool
    just big enough, whose own size is left out. CUDA only."""
    bs, device, model = shape.block_size, shape.device, probe.model
    lengths = [min(shape.max_model_len, num_tokens - start) for start in range(0, num_tokens, shape.max_model_len)]
    num_blocks = 1 + sum(-(-n // bs) for n in lengths)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    k, v = allocate_kv_pool(shape.num_layers, shape.num_kv_heads, num_blocks, bs, shape.head_dim, shape.dtype,
                            device, kv_scales)
    zero_blocks(k + v, 0, num_blocks)
    scratch = torch.cuda.memory_allocated(device) - before
    attention = probe.make_attention(k, v)
    items, next_block = [], 1
    for index, length in enumerate(lengths):
        seq = Sequence(-1 - index, "profile", [0] * length, SamplingParams(max_tokens=1))
        seq.block_table = list(range(next_block, next_block + -(-length // bs)))
        next_block += len(seq.block_table)
        items.append(BatchItem(seq, 0, seq.token_ids))
    batch, _ = build_step_batch(items, bs, probe.to_tensor)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    attention.begin_step(batch)
    stage_input = None  # a pipeline stage after the first starts from hidden states
    if model.embed_tokens is None:
        stage_input = torch.zeros(num_tokens, shape.hidden_size, dtype=shape.dtype, device=device)
    hidden = model(batch.input_ids, batch.positions, attention.forward, hidden=stage_input)
    if num_logit_rows and model.embed_tokens is not None:  # the first stage alone computes logits
        rows = torch.arange(num_logit_rows, device=device) % hidden.shape[0]
        logits = model.compute_logits(hidden.index_select(0, rows))
        torch.softmax(logits.float(), dim=-1).cumsum(dim=-1)  # the sampler's float32 copies
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    del k, v, attention, batch, hidden
    torch.cuda.empty_cache()
    return max(peak, 0)


def plan_kv_cache(config: EngineConfig, shape: ModelShape, probe: ModelProbe) -> KVPlan:
    """Blocks for the KV pools (the target's and the draft proposer's, over the same block ids) from what is
    left of the budget after weights, the activation peak, the draft model and the CUDA graphs' pool. CUDA:
    `memory_utilization` of the device for all of it; CPU: at most `cpu_kv_cache_space` for the pools, within
    80% of the host's available memory."""
    kv_scales = kv_scales_for(config, shape, probe.model)  # FP8: one byte per element
    model_dtype_per_block = kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.block_size,
                                               shape.head_dim, shape.dtype.itemsize)
    per_block = model_dtype_per_block if kv_scales is None else model_dtype_per_block // shape.dtype.itemsize
    draft_weights, draft_per_block = draft_memory(config.speculative_config, shape)
    weights = shape.weights_bytes
    activation = activation_peak(config, shape, probe, kv_scales)
    graph_pool = graph_pool_peak(config, shape, probe, kv_scales)
    needed_blocks = config.max_num_seqs * shape.max_blocks_per_seq + 1
    other = 0
    fixed = weights + activation + graph_pool + draft_weights
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
        budget = fixed + num_blocks * (per_block + draft_per_block)
    else:
        if config.kv_cache_memory is not None:
            kv_budget = config.kv_cache_memory
            budget = fixed + kv_budget
        elif shape.device.type == "cuda":
            torch.cuda.empty_cache()  # memory cached by torch but free would otherwise count as used
            free, total = torch.cuda.mem_get_info(shape.device)
            other = max(total - free - weights, 0)
            budget = int(total * config.memory_utilization)
            kv_budget = budget - other - fixed
        else:  # TP ranks or stages share the host
            budget = weights + int(available_host_memory() * 0.8 / shape.num_ranks)  # the weights are loaded already
            kv_budget = min(config.cpu_kv_cache_space, budget - fixed)
        num_blocks = min(kv_budget // (per_block + draft_per_block), needed_blocks)
        if num_blocks < 2:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB; weights "
                               f"{weights / 2**20:.0f} MiB, activations {activation / 2**20:.0f} MiB, "
                               f"CUDA graphs {graph_pool / 2**20:.0f} MiB, draft model "
                               f"{draft_weights / 2**20:.0f} MiB, other {other / 2**20:.0f} MiB)")
    plan = KVPlan(int(num_blocks), per_block, weights, activation, int(budget), draft_per_block,
                  draft_weights, graph_pool, other, kv_scales, model_dtype_per_block)
    log.info(plan.describe(shape.block_size, shape.max_model_len))
    return plan
