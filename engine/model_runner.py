"""The only place that builds tensors for a step: turns a scheduler plan into a flat batch, copies blocks,
runs the model over the paged KV pool and hands the logits rows to the sampler. Loading is `model_loader`'s,
the pool's size `memory_plan`'s (from the runner's `shape`; the runner is given the plan, `initialize_kv_cache`) and
sampling the `Sampler`'s."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from engine import malloc_tuning
from engine.attention.base import AttentionBackend, StepBatch, allocate_kv_pool
from engine.batch import BatchItem, PoolZeroing, build_step_batch
from engine.config import EngineConfig
from engine.kernels import cpu_gemm
from engine.kernels.cpu_gemm import INVARIANT_ROWS
from engine.kv_cache_interface import KVPlan, ModelProbe, ModelShape
from engine.kv_transfer import KVTransfer
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model, pick_device, pick_dtype
from engine.models.llama import head_dim_of
from engine.sampler import Sampler
from engine.step_types import ModelRunnerOutput, SampleLayout, SchedulerOutput, StepInput

log = logging.getLogger("tokenmill.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, hf_config, max_model_len: int,
                 sampler: Sampler | None = None, tp: Any = None) -> None:
        """`tp`: this rank's group when the model is sharded over ranks (a subclass in engine/distributed/ loads
        its shard)."""
        self.config = config
        self.tp = tp
        self.device = pick_device(config.device) if tp is None else tp.device
        self.dtype = pick_dtype(config.dtype, self.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            malloc_tuning.keep_freed_memory()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model = self.load(model_dir, hf_config)
        self.lora = LoRAManager.for_model(self.model, config, hf_config, self.device)  # None without enable_lora
        shard = self.model.config  # this rank's heads and KV heads
        self.num_layers = len(self.model.layers)  # a pipeline stage's own
        self.num_kv_heads = shard.num_key_value_heads
        self.num_heads = shard.num_attention_heads
        self.head_dim = head_dim_of(shard)
        self.vocab_size = hf_config.vocab_size
        self.sampler = sampler or Sampler(config.seed)
        self.shape = ModelShape(self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, shard.hidden_size,
                                shard.intermediate_size, self.vocab_size, self.dtype, self.device, self.block_size,
                                max_model_len, sum(p.numel() * p.element_size() for p in self.model.parameters()),
                                tp.world_size if tp is not None else 1, self.uses_cuda_graphs())
        self.probe = ModelProbe(self.model, self.make_backend, self.tensor)  # what the memory plan may run

    def initialize_kv_cache(self, plan: KVPlan) -> None:
        """Allocate the KV pool of the memory plan (every rank's as many blocks as the smallest plan allows), its
        attention backend and block copies, and capture the CUDA graphs over it."""
        config = self.config
        if self.tp is not None:
            plan.num_blocks = self.tp.min_int(plan.num_blocks)
        self.kv_plan = plan
        k, v = allocate_kv_pool(self.num_layers, self.num_kv_heads, plan.num_blocks, self.block_size,
                                self.head_dim, self.dtype, self.device, plan.kv_scales)
        self.attention = self.make_backend(k, v)
        self.zeroing = PoolZeroing(k + v)
        # copy-on-write and swap copies of the pool's blocks (swap bookkeeping: engine/swap.py)
        self.transfer = KVTransfer(self.attention.k_caches + self.attention.v_caches, self.zeroing, self.tensor,
                                   config.swap_space)
        self.graphs = None  # decode steps as CUDA graphs (engine/cuda_graphs.py): CUDA and the Triton backend only
        if self.shape.cuda_graphs:
            from engine.cuda_graphs import DecodeGraphs

            reserved = torch.cuda.memory_reserved(self.device)
            self.graphs = DecodeGraphs.build(self.model, self.attention, self.shape, config.max_num_seqs)
            taken = torch.cuda.memory_reserved(self.device) - reserved
            log.info("CUDA graphs reserved %.0f MiB (planned %.0f MiB)", taken / 2**20, plan.graph_pool_bytes / 2**20)
        self.batch_invariant = False
        if config.batch_invariant == "auto":
            windows = self.attention.layer_windows is not None  # the invariant attention path has no windows yet
            config.batch_invariant = not windows and self.device.type == "cpu" and cpu_gemm.invariant_kernels(
                self.dtype)
            log.info("batch-invariant mode %s (auto: %s)", "on" if config.batch_invariant else "off",
                     "our GEMM kernels for this dtype are invariant as they are" if config.batch_invariant
                     else "the model has sliding-window layers" if windows
                     else "it would need GEMMs in fixed row tiles here, a cost")
        self.set_batch_invariant(config.batch_invariant)  # after the graphs: they replay only with it off

    def load(self, model_dir: Path, hf_config):
        """The model (a tensor-parallel rank's or a pipeline stage's runner loads its part)."""
        return load_model(model_dir, hf_config, self.max_model_len, self.dtype, self.device)

    def set_batch_invariant(self, on: bool) -> None:
        """Fixed-shape GEMMs and one attention path (see engine/kernels/cpu_gemm.py, engine/attention/), on or off.
        A tensor-parallel engine keeps the mode it started with: the other ranks set theirs at start."""
        if self.tp is not None and on != self.config.batch_invariant:
            raise ValueError("a tensor-parallel engine runs in the batch-invariant mode it started with "
                             f"({self.config.batch_invariant}); start its worker with the mode its jobs ask for")
        self.attention.set_batch_invariant(on)
        self.model.set_row_tile(INVARIANT_ROWS if on else 0)
        self.sampler.batch_invariant = self.batch_invariant = on

    @property
    def num_blocks(self) -> int:
        return self.kv_plan.num_blocks

    def make_backend(self, k: list[torch.Tensor], v: list[torch.Tensor], num_heads: int | None = None,
                     windows: list[int | None] | None = None) -> AttentionBackend:
        """Over the pools k, v: the target's backend, or a draft model's (`num_heads` and `windows` given)."""
        windows = self.model.layer_windows if num_heads is None else windows
        if self.backend_name(windows) == "triton":
            from engine.attention.triton_backend import TritonAttention

            return TritonAttention(k, v, num_heads or self.num_heads, windows)
        from engine.attention.torch_backend import TorchAttention

        return TorchAttention(k, v, num_heads or self.num_heads, windows)

    def backend_name(self, windows: list[int | None] | None) -> str:
        """auto: Triton on CUDA, else torch; torch also for sliding-window layers, which Triton lacks yet."""
        name, cuda = self.config.attention_backend, self.device.type == "cuda"
        return ("triton" if cuda and not any(windows or ()) else "torch") if name == "auto" else name

    def uses_cuda_graphs(self) -> bool:
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.tp is None
                and self.backend_name(self.model.layer_windows) == "triton")

    def prepare(self, items: list[BatchItem]) -> tuple[StepBatch, dict]:
        """The flat batch of `items` (its `sample_indices` still empty) and each sequence's rows in it."""
        self.zeroing.cover(items)
        batch, rows = build_step_batch(items, self.block_size, self.tensor)
        if self.lora is not None:
            self.lora.begin_step(items, rows, len(batch.input_ids))
        return batch, rows

    def tensor(self, values) -> torch.Tensor:
        """A long tensor on the device."""
        if self.device.type == "cuda":  # through pinned host memory: an async copy, no pageable bounce
            return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns each sampled sequence's new tokens by id: one sampled token, or the accepted
        drafts and then one recovered or bonus token. The flat batch holds the drafts after each decoding
        sequence's token."""
        layout = SampleLayout.of(plan)
        items = []
        for seq, num_new, _ in plan.scheduled:
            start = seq.num_computed_tokens
            items.append(BatchItem(seq, start, seq.token_ids[start:start + num_new]
                                   + plan.spec_token_ids.get(seq.seq_id, [])))
        batch, rows = self.prepare(items)
        step = StepInput(plan.block_copies, items, layout.batch_rows(rows), plan.blocks_to_swap_out,
                         plan.blocks_to_swap_in, plan.kv_loads)
        if self.tp is None:
            ran = self.run(step, batch)
        else:
            self.tp.send(step.for_ranks())
            ran = self.tp.fail_stop(self.run, step, batch)
        if ran is None:
            return ModelRunnerOutput()
        logits, hidden = ran
        return ModelRunnerOutput.of(self.sampler.sample(layout, logits), hidden)

    def run_remote(self, step: StepInput) -> None:
        """Another rank: rank 0's step, run alongside it."""
        with torch.inference_mode():
            self.run(step)

    def run(self, step: StepInput, batch: StepBatch | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copy and swap blocks, run the model over the step's items (`batch`: their flat batch, when built
        already); the logits of its sample rows and their hidden states (None without any, and on ranks other
        than 0)."""
        self.transfer.apply(step)
        if batch is None:
            batch, _ = self.prepare(step.items)
        batch.sample_indices = self.tensor(step.sample_rows)
        with self.tp.collectives() if self.tp is not None else nullcontext():  # every rank runs this step
            if self.graphs is not None and not self.batch_invariant and self.graphs.can_run(batch):  # replay a decode
                hidden = self.graphs.run(batch)
            else:
                self.attention.begin_step(batch)
                hidden = self.model(batch.input_ids, batch.positions, self.attention.forward)
            if not step.sample_rows:
                return None
            hidden = hidden.index_select(0, batch.sample_indices)
            logits = self.model.compute_logits(hidden)
            if self.tp is not None:  # each rank holds a slice of the vocabulary
                logits = self.tp.gather_columns(logits)
                return None if logits is None else (logits[:, :self.vocab_size], hidden)
            return logits, hidden
