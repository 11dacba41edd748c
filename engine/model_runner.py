"""The only place that builds tensors: turns a scheduler plan into a flat batch, runs the model over
the paged KV pool and samples. Also sizes the KV pool from the memory budget at start-up."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend, StepBatch, allocate_kv_pool
from engine.batch import BatchItem, PoolZeroing, build_step_batch
from engine.config import EngineConfig
from engine.models.llama import LlamaForCausalLM, head_dim_of, rope_tables
from engine.sampler import Sampler
from engine.step_types import ModelRunnerOutput, SampleLayout, SchedulerOutput

log = logging.getLogger("tokenmill.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KVPlan:
    """The memory plan: everything the engine holds at its peak, and the budget it must fit in."""

    num_blocks: int
    bytes_per_block: int  # target KV, all layers, K and V
    weights_bytes: int
    activation_bytes: int  # peak of the largest step (measured on CUDA, estimated on CPU)
    budget_bytes: int  # what weights + everything below may take together
    draft_bytes_per_block: int = 0  # the draft proposer's own KV pool over the same block ids
    draft_weights_bytes: int = 0
    graph_pool_bytes: int = 0  # CUDA graphs' private memory pool
    other_bytes: int = 0  # CUDA: device memory already used besides the weights (context, other processes)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * (self.bytes_per_block + self.draft_bytes_per_block)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.other_bytes + self.activation_bytes + self.graph_pool_bytes
                + self.draft_weights_bytes + self.kv_bytes)

    def describe(self, block_size: int, max_model_len: int) -> str:
        tokens = (self.num_blocks - 1) * block_size
        mib = 2**20
        draft = (f", draft weights {self.draft_weights_bytes / mib:.0f} MiB + draft KV "
                 f"{self.num_blocks * self.draft_bytes_per_block / mib:.0f} MiB" if self.draft_bytes_per_block else "")
        graphs = f", CUDA graph pool {self.graph_pool_bytes / mib:.0f} MiB" if self.graph_pool_bytes else ""
        return (f"KV cache: {self.num_blocks - 1} blocks x {block_size} tokens = {tokens:,} tokens "
                f"({(self.num_blocks * self.bytes_per_block) / 2**30:.2f} GiB); "
                f"max concurrency at {max_model_len} tokens/request: {tokens / max_model_len:.1f}x; "
                f"weights {self.weights_bytes / mib:.0f} MiB, "
                f"activation peak {self.activation_bytes / mib:.0f} MiB{graphs}{draft}; "
                f"total {self.total_bytes / mib:.0f} MiB of a {self.budget_bytes / mib:.0f} MiB budget")


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' asked for, but torch sees no CUDA device")
    return torch.device(setting)


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 matmuls in hardware, where bf16 runs about twice as fast as float32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    if setting != "auto":
        return DTYPES[setting]
    if device.type == "cuda":
        return torch.bfloat16
    native = cpu_has_native_bf16()
    dtype = torch.bfloat16 if native else torch.float32
    log.info("dtype auto: %s (the CPU %s native bf16: avx512_bf16 or AMX)", str(dtype).removeprefix("torch."),
             "has" if native else "lacks")
    return dtype


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def load_model(model_dir: Path, hf_config, max_positions: int, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    from safetensors import safe_open

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_positions)
    model = model.to_empty(device=device)
    files = sorted(model_dir.glob("*.safetensors"))

    def weights():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_hf_weights(weights())
    cos, sin = rope_tables(hf_config, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model = model.to(dtype).eval()
    if device.type == "cpu":
        model.pack_for_cpu()
    return model


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config, max_model_len: int,
                 sampler: Sampler | None = None) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model = load_model(model_dir, hf_config, max_model_len, self.dtype, self.device)
        self.num_layers = hf_config.num_hidden_layers
        self.num_kv_heads = hf_config.num_key_value_heads
        self.num_heads = hf_config.num_attention_heads
        self.head_dim = head_dim_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.kv_plan = self.plan_kv_cache()
        k, v = allocate_kv_pool(self.num_layers, self.num_kv_heads, self.kv_plan.num_blocks, self.block_size,
                                self.head_dim, self.dtype, self.device)
        self.attention = self.make_backend(k, v)
        self.zeroing = PoolZeroing(k + v)
        self.sampler = sampler or Sampler(config.seed)
        self.graphs = None  # decode steps as CUDA graphs (engine/cuda_graphs.py): CUDA and the Triton backend only
        if self.uses_cuda_graphs():
            from engine.cuda_graphs import DecodeGraphs

            reserved = torch.cuda.memory_reserved(self.device)
            self.graphs = DecodeGraphs.for_runner(self)
            taken = torch.cuda.memory_reserved(self.device) - reserved
            log.info("CUDA graphs reserved %.0f MiB (planned %.0f MiB)", taken / 2**20,
                     self.kv_plan.graph_pool_bytes / 2**20)

    @property
    def num_blocks(self) -> int:
        return self.kv_plan.num_blocks

    def make_backend(self, k: list[torch.Tensor], v: list[torch.Tensor],
                     num_heads: int | None = None) -> AttentionBackend:
        name = self.config.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if name == "triton":
            from engine.attention.triton_backend import TritonAttention

            return TritonAttention(k, v, num_heads or self.num_heads)
        from engine.attention.torch_backend import TorchAttention

        return TorchAttention(k, v, num_heads or self.num_heads)

    def bytes_per_block(self) -> int:
        from engine.spec_decode.draft import kv_bytes_per_block

        return kv_bytes_per_block(self.num_layers, self.num_kv_heads, self.block_size, self.head_dim,
                                  self.dtype.itemsize)

    def activation_peak(self) -> int:
        """Peak activation memory of the largest step: measured with a profiling forward on CUDA,
        estimated on CPU."""
        tokens = self.config.max_num_batched_tokens
        if self.device.type == "cuda":
            return self.profile_forward_peak(tokens, self.config.max_num_seqs)
        element = self.dtype.itemsize
        hidden = self.model.config.hidden_size
        per_token = (4 * hidden + 3 * self.model.config.intermediate_size
                     + (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * 2) * element
        attention = min(tokens, self.max_model_len) ** 2 * self.num_heads * element  # masked scores, worst case
        logits = self.config.max_num_seqs * self.vocab_size * 4 * 3
        return tokens * per_token + attention + logits

    def uses_cuda_graphs(self) -> bool:
        backend = self.config.attention_backend
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and backend in ("auto", "triton"))

    def graph_pool_peak(self) -> int:
        """The CUDA graphs' private pool: graphs keep the intermediate tensors of a decode forward at the
        largest captured batch, beside whatever an eager step allocates. Estimated by the peak of an eager
        forward of that many tokens (the graphs share one pool, largest captured first)."""
        if not self.uses_cuda_graphs():
            return 0
        from engine.cuda_graphs import capture_sizes

        return self.profile_forward_peak(capture_sizes(self.config.max_num_seqs)[-1], 0)

    @torch.inference_mode()
    def profile_forward_peak(self, num_tokens: int, num_logit_rows: int) -> int:
        """Bytes a forward of `num_tokens` prompt tokens (sequences of at most max_model_len) and the
        sampling of `num_logit_rows` rows allocate at their peak, beyond what was allocated before; run
        over a scratch KV pool just big enough, whose own size is left out. CUDA only."""
        from engine.attention.base import zero_blocks
        from engine.sampling_params import SamplingParams
        from engine.sequence import Sequence

        bs = self.block_size
        lengths = [min(self.max_model_len, num_tokens - start) for start in range(0, num_tokens, self.max_model_len)]
        num_blocks = 1 + sum(-(-n // bs) for n in lengths)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        k, v = allocate_kv_pool(self.num_layers, self.num_kv_heads, num_blocks, bs, self.head_dim, self.dtype,
                                self.device)
        zero_blocks(k + v, 0, num_blocks)
        scratch = torch.cuda.memory_allocated(self.device) - before
        attention = self.make_backend(k, v)
        items, next_block = [], 1
        for index, length in enumerate(lengths):
            seq = Sequence(-1 - index, "profile", [0] * length, SamplingParams(max_tokens=1))
            seq.block_table = list(range(next_block, next_block + -(-length // bs)))
            next_block += len(seq.block_table)
            items.append(BatchItem(seq, 0, seq.token_ids))
        batch, _ = build_step_batch(items, bs, self._tensor)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        attention.begin_step(batch)
        hidden = self.model(batch.input_ids, batch.positions, attention.forward)
        if num_logit_rows:
            rows = torch.arange(num_logit_rows, device=self.device) % hidden.shape[0]
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            torch.softmax(logits.float(), dim=-1).cumsum(dim=-1)  # the sampler's float32 copies
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch
        del k, v, attention, batch, hidden
        torch.cuda.empty_cache()
        return max(peak, 0)

    def plan_kv_cache(self) -> KVPlan:
        """Blocks for the KV pools (the target's and the draft proposer's, over the same block ids) from
        what is left of the budget after weights, the activation peak, the draft model and the CUDA
        graphs' pool. CUDA: `memory_utilization` of the device for all of it; CPU: at most
        `cpu_kv_cache_space` for the pools, within 80% of the host's available memory."""
        from engine.spec_decode.draft import draft_memory

        per_block = self.bytes_per_block()
        draft_weights, draft_per_block = draft_memory(self.config.speculative_config, self)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        activation = self.activation_peak()
        graph_pool = self.graph_pool_peak()
        needed_blocks = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        other = 0
        fixed = weights + activation + graph_pool + draft_weights
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
            budget = fixed + num_blocks * (per_block + draft_per_block)
        else:
            if self.config.kv_cache_memory is not None:
                kv_budget = self.config.kv_cache_memory
                budget = fixed + kv_budget
            elif self.device.type == "cuda":
                torch.cuda.empty_cache()  # memory cached by torch but free would otherwise count as used
                free, total = torch.cuda.mem_get_info(self.device)
                other = max(total - free - weights, 0)
                budget = int(total * self.config.memory_utilization)
                kv_budget = budget - other - fixed
            else:
                budget = weights + int(available_host_memory() * 0.8)  # the weights are loaded already
                kv_budget = min(self.config.cpu_kv_cache_space, budget - fixed)
            num_blocks = min(kv_budget // (per_block + draft_per_block), needed_blocks)
            if num_blocks < 2:
                raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB; weights "
                                   f"{weights / 2**20:.0f} MiB, activations {activation / 2**20:.0f} MiB, "
                                   f"CUDA graphs {graph_pool / 2**20:.0f} MiB, draft model "
                                   f"{draft_weights / 2**20:.0f} MiB, other {other / 2**20:.0f} MiB)")
        plan = KVPlan(int(num_blocks), per_block, weights, activation, int(budget), draft_per_block,
                      draft_weights, graph_pool, other)
        log.info(plan.describe(self.block_size, self.max_model_len))
        return plan

    def prepare(self, plan: SchedulerOutput, layout: SampleLayout) -> StepBatch:
        """The flat batch (drafts ride along after each decoding sequence's token), with the logits rows
        of `layout` as `sample_indices`."""
        items = [BatchItem(s.seq, s.seq.num_computed_tokens,
                           s.seq.token_ids[s.seq.num_computed_tokens:s.seq.num_computed_tokens + s.num_new_tokens]
                           + plan.spec_token_ids.get(s.seq.seq_id, [])) for s in plan.scheduled]
        self.zeroing.cover(items)
        batch, rows = build_step_batch(items, self.block_size, self._tensor)
        batch.sample_indices = self._tensor(layout.batch_rows(rows))
        return batch

    def _tensor(self, values) -> torch.Tensor:
        if self.device.type == "cuda":  # through pinned host memory: an async copy, no pageable bounce
            return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V) before they are written."""
        src = self._tensor([s for s, _ in copies])
        dst = self._tensor([d for _, d in copies])
        self.zeroing.ensure(1 + max(d for _, d in copies))  # before the copy, or zeroing would undo it
        for cache in self.attention.k_caches + self.attention.v_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns each sampled sequence's new tokens: one sampled token, or the accepted
        drafts and then one recovered or bonus token."""
        if plan.block_copies:
            self.copy_blocks(plan.block_copies)
        layout = SampleLayout.of(plan)
        batch = self.prepare(plan, layout)
        if self.graphs is not None and self.graphs.can_run(batch):  # decode-only step: replay a CUDA graph
            hidden = self.graphs.run(batch)
        else:
            self.attention.begin_step(batch)
            hidden = self.model(batch.input_ids, batch.positions, self.attention.forward)
        if not layout.seqs:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_indices))
        return ModelRunnerOutput.of(self.sampler.sample(layout, logits))
