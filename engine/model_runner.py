"""The only place that builds tensors: turns a scheduler plan into a flat batch, runs the model over
the paged KV pool and samples. Also sizes the KV pool from the memory budget at start-up."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend, StepBatch, allocate_kv_pool
from engine.batch import BatchItem, PoolZeroing, Rows, build_step_batch
from engine.config import EngineConfig
from engine.models.llama import LlamaForCausalLM, head_dim_of, rope_tables
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.verifier import verify_drafts

log = logging.getLogger("tokenmill.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    weights_bytes: int
    activation_bytes: int
    budget_bytes: int

    def describe(self, block_size: int, max_model_len: int) -> str:
        tokens = (self.num_blocks - 1) * block_size
        return (f"KV cache: {self.num_blocks - 1} blocks x {block_size} tokens = {tokens:,} tokens "
                f"({(self.num_blocks * self.bytes_per_block) / 2**30:.2f} GiB); "
                f"max concurrency at {max_model_len} tokens/request: {tokens / max_model_len:.1f}x; "
                f"weights {self.weights_bytes / 2**20:.0f} MiB, "
                f"activation peak {self.activation_bytes / 2**20:.0f} MiB")


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
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config, max_model_len: int) -> None:
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
        self.sampler = Sampler(config.seed)
        self.graphs = None  # decode steps as CUDA graphs (engine/cuda_graphs.py): CUDA and the Triton backend only
        if self.device.type == "cuda" and self.attention.name == "triton" and not config.enforce_eager:
            from engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs.for_runner(self)

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
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element

    def activation_peak(self) -> int:
        """Peak activation memory of the largest step: measured on CUDA, estimated on CPU."""
        tokens = self.config.max_num_batched_tokens
        element = torch.tensor([], dtype=self.dtype).element_size()
        hidden = self.model.config.hidden_size
        per_token = (4 * hidden + 3 * self.model.config.intermediate_size
                     + (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * 2) * element
        attention = min(tokens, self.max_model_len) ** 2 * self.num_heads * element  # masked scores, worst case
        logits = self.config.max_num_seqs * self.vocab_size * 4 * 3
        return tokens * per_token + attention + logits

    def plan_kv_cache(self) -> KVPlan:
        per_block = self.bytes_per_block()
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        activation = self.activation_peak()
        needed_blocks = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        if self.config.num_kv_blocks is not None:
            budget = self.config.num_kv_blocks * per_block
            num_blocks = self.config.num_kv_blocks
        else:
            if self.config.kv_cache_memory is not None:
                budget = self.config.kv_cache_memory
            elif self.device.type == "cuda":
                torch.cuda.empty_cache()  # memory cached by torch but free would otherwise count as used
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * self.config.memory_utilization) - (total - free) - activation
            else:
                budget = min(self.config.cpu_kv_cache_space, int(available_host_memory() * 0.8) - activation)
            num_blocks = min(budget // per_block, needed_blocks)
            if num_blocks < 2:
                raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB after weights "
                                   f"{weights / 2**20:.0f} MiB and activations {activation / 2**20:.0f} MiB)")
        plan = KVPlan(int(num_blocks), per_block, weights, activation, int(budget))
        log.info(plan.describe(self.block_size, self.max_model_len))
        return plan

    def prepare(self, plan: SchedulerOutput, layout: SampleLayout) -> StepBatch:
        """The flat batch (drafts ride along after each decoding sequence's token), with the logits rows
        of `layout` as `sample_indices`."""
        items = [BatchItem(s.seq, s.seq.num_computed_tokens,
                           s.seq.token_ids[s.seq.num_computed_tokens:s.seq.num_computed_tokens + s.num_new_tokens]
                           + s.seq.spec_token_ids) for s in plan.scheduled]
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
            return ModelRunnerOutput.of([], [])
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_indices))
        return self.sample(layout, logits)

    def sample(self, layout: SampleLayout, logits: torch.Tensor) -> ModelRunnerOutput:
        plain_seqs = [layout.seqs[i] for i in layout.plain]
        if not plain_seqs:
            plain = []
        elif len(layout.plain_rows) == logits.shape[0]:  # every row is a plain sample, in order: no gather
            plain = self.sampler(logits, plain_seqs)
        else:
            plain = self.sampler(logits[layout.plain_rows], plain_seqs)
        spec_seqs = [layout.seqs[i] for i in layout.spec]
        verified = verify_drafts([logits[a:b] for a, b in layout.spec_rows], spec_seqs, self.sampler) if spec_seqs \
            else []
        tokens: list[list[int]] = [[]] * len(layout.seqs)
        for index, token in zip(layout.plain, plain, strict=True):
            tokens[index] = [token]
        for index, accepted in zip(layout.spec, verified, strict=True):
            tokens[index] = accepted
        return ModelRunnerOutput.of(layout.seqs, tokens)


@dataclass
class SampleLayout:
    """A step's sampled sequences and their logits rows, laid out once per step. A forking parent's row
    feeds its n samples; a sequence with drafts has one row per draft position and one beyond."""

    seqs: list[Sequence]  # every sequence that gets tokens this step, in plan order (forks after their parent)
    row_seqs: list[tuple[Sequence, int]]  # sequences whose batch rows are read, in logits order; samples each
    plain: list[int]  # indices into seqs sampled from one row
    plain_rows: list[int]  # their logits rows
    spec: list[int]  # indices into seqs verifying drafts
    spec_rows: list[tuple[int, int]]  # their logits rows [start, end)

    @classmethod
    def of(cls, plan: SchedulerOutput) -> SampleLayout:
        layout = cls([], [], [], [], [], [])
        row = 0
        for row_seq, seqs in plan.sample_groups():
            layout.row_seqs.append((row_seq, len(seqs)))
            if row_seq.spec_token_ids:
                end = row + 1 + len(row_seq.spec_token_ids)
                layout.spec.append(len(layout.seqs))
                layout.spec_rows.append((row, end))
                layout.seqs.append(row_seq)
                row = end
                continue
            for seq in seqs:
                layout.plain.append(len(layout.seqs))
                layout.plain_rows.append(row)
                layout.seqs.append(seq)
                row += 1
        return layout

    def batch_rows(self, rows: dict[int, Rows]) -> list[int]:
        """The flat-batch rows whose hidden states become logits, in logits order."""
        out: list[int] = []
        for row_seq, num_samples in self.row_seqs:
            r = rows[row_seq.seq_id]
            if row_seq.spec_token_ids:
                out.extend(range(r.first, r.first + r.count))
            else:
                out.extend([r.last] * num_samples)
        return out


@dataclass
class ModelRunnerOutput:
    """One step's result keyed by sequence id, like vLLM v1's `ModelRunnerOutput` with `req_id_to_index`."""

    seqs: list[Sequence]  # the sequences that got tokens, in the order the scheduler's update takes them
    seq_id_to_index: dict[int, int]
    sampled_token_ids: list[list[int]]  # per sequence: the accepted drafts, then one sampled token

    @classmethod
    def of(cls, seqs: list[Sequence], tokens: list[list[int]]) -> ModelRunnerOutput:
        return cls(seqs, {seq.seq_id: i for i, seq in enumerate(seqs)}, tokens)

    def tokens_of(self, seq_id: int) -> list[int]:
        return self.sampled_token_ids[self.seq_id_to_index[seq_id]]

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sampled_token_ids))
