"""Pipeline parallelism: the model's layers split into P contiguous stages, each one process (rank) or T
tensor-parallel ranks (T * P ranks in all); each step's hidden states go from stage to stage. Rank 0 is the engine
(scheduler, sampler) and in the first stage, which holds the embedding and the LM head, so the last stage sends back
only the hidden states of the rows to sample. A step's sequences run in micro-batches, so that stage 1 computes
micro-batch i while stage 0 computes i + 1. Starting the ranks, the step broadcast, the agreed KV pool size and a
dead rank's handling are tensor parallelism's (ranks.py, group.py); each stage's KV pool holds its own layers only."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.batch import BatchItem, build_step_batch
from engine.config import EngineConfig
from engine.distributed.group import RankFailure, TensorParallelGroup
from engine.distributed.sharding import ShardRunner, load_shard
from engine.model_loader import finish_loading, materialize
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.step_types import StepInput


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers, contiguous and as even as can be; where the count does not divide, the last stages take
    one more (the first also embeds, computes the logits and runs the engine)."""
    check_stages(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (stage >= num_stages - extra) for stage in range(num_stages)]
    starts = itertools.accumulate(sizes, initial=0)
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=False)]


def check_stages(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers: each stage "
                         "needs at least one")


def rank_classes(config: EngineConfig) -> tuple[Callable[..., TensorParallelGroup], type[ModelRunner]]:
    """The group (made from rank, world size, store, device) and runner of each rank of a multi-process engine."""
    if config.pipeline_parallel_size > 1:
        return partial(PipelineGroup, tp_size=config.tensor_parallel_size), PipelineRunner
    return TensorParallelGroup, ShardRunner


class PipelineGroup(TensorParallelGroup):
    """One rank's view: over all ranks, the step broadcast and `min_int` of tensor parallelism and point-to-point
    transfers of hidden states (gloo, or NCCL on CUDA); `shard`, the tensor-parallel group of its stage's ranks (None
    with one rank a stage). Rank r is tensor-parallel rank r % T of stage r // T."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, device: torch.device, tp_size: int = 1) -> None:
        super().__init__(rank, world_size, store, device)
        self.tp_size, self.num_stages = tp_size, world_size // tp_size
        self.stage, tp_rank = divmod(rank, tp_size)
        self.shard = None if tp_size == 1 else TensorParallelGroup(
            tp_rank, tp_size, dist.PrefixStore(f"stage{self.stage}", store), device)

    def send_hidden(self, tensor: torch.Tensor, to: int) -> tuple:
        """Start sending `tensor` to rank `to`; `wait` for the handle (it keeps the tensor alive until then)."""
        return self.compute.send([tensor], to, 0), tensor

    def receive_hidden(self, rows: int, width: int, dtype: torch.dtype, source: int) -> torch.Tensor:
        tensor = torch.empty(rows, width, dtype=dtype, device=self.device)
        _finish(self.compute.recv([tensor], source, 0))
        return tensor

    def wait(self, sends: list[tuple]) -> None:
        for work, _ in sends:
            _finish(work)


def _finish(work) -> None:
    try:
        work.wait()
    except RuntimeError as error:  # gloo and NCCL raise this (DistBackendError) when a peer is gone
        raise RankFailure(f"a pipeline-parallel transfer failed: {error}") from error


class MicroBatch(NamedTuple):
    items: list[BatchItem]
    sample_rows: list[int]  # rows of its own flat batch whose hidden states become logits, in logits order


def split_items(items: list[BatchItem], count: int) -> list[list[BatchItem]]:
    """Whole sequences, in step order, in at most `count` parts of about equal tokens: each item goes to the part
    its middle token falls in."""
    total = sum(len(item.token_ids) for item in items)
    parts: list[list[BatchItem]] = [[] for _ in range(count)]
    done = 0
    for item in items:
        parts[min(count - 1, int((done + len(item.token_ids) / 2) * count / total))].append(item)
        done += len(item.token_ids)
    return [part for part in parts if part]


def _rows_of(items: list[BatchItem], block_size: int) -> dict:
    """Each sequence's rows in the flat batch of `items` (its layout only: no tensors are built)."""
    return build_step_batch(items, block_size, lambda values: values)[1]


def micro_batches(step: StepInput, count: int, block_size: int) -> tuple[list[MicroBatch], list[int] | None]:
    """The step in at most `count` micro-batches, and for each of the step's logits rows its place among the
    micro-batches' rows put end to end (None: the same order)."""
    if not step.items:
        return [], None
    parts = split_items(step.items, count)
    if len(parts) == 1:
        return [MicroBatch(step.items, step.sample_rows)], None
    row_owner = {rows.first + offset: (seq_id, offset)
                 for seq_id, rows in _rows_of(step.items, block_size).items() for offset in range(rows.count)}
    part_of = {item.seq.seq_id: index for index, part in enumerate(parts) for item in part}
    part_rows = [_rows_of(part, block_size) for part in parts]
    samples: list[list[int]] = [[] for _ in parts]
    placed = []  # (micro-batch, index among its logits rows) of each of the step's logits rows
    for row in step.sample_rows:
        seq_id, offset = row_owner[row]
        index = part_of[seq_id]
        placed.append((index, len(samples[index])))
        samples[index].append(part_rows[index][seq_id].first + offset)
    starts = list(itertools.accumulate((len(s) for s in samples), initial=0))
    order = [starts[index] + position for index, position in placed]
    return ([MicroBatch(part, rows) for part, rows in zip(parts, samples, strict=True)],
            None if order == list(range(len(order))) else order)


def load_stage(model_dir: Path, hf_config, max_positions: int, dtype: torch.dtype, device: torch.device,
               layers: range) -> LlamaForCausalLM:
    """The stage of the model in `model_dir` that holds `layers` (the first also the embedding and LM head), reading
    only its own tensors."""
    from safetensors import safe_open

    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_positions, layers)
    materialize(model, device)

    def weights():
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if model.stage_name(name) is not None:
                        yield name, f.get_tensor(name)

    model.load_hf_weights(weights())
    return finish_loading(model, hf_config, max_positions, dtype, device)


class PipelineRunner(ModelRunner):
    """A stage's runner: its layers, and a KV pool (and memory plan) for them alone. Every rank splits each step the
    same way into micro-batches; a stage runs them in order, receiving each from the stage before and sending it on
    (or, from the last stage, its logits rows' hidden states back to rank 0) without waiting for the send."""

    tp: PipelineGroup
    split_steps = 0  # steps run in more than one micro-batch

    def load(self, model_dir: Path, hf_config) -> LlamaForCausalLM:
        group = self.tp
        self.layer_range = stage_layers(hf_config.num_hidden_layers, group.num_stages)[group.stage]
        if group.shard is None:
            return load_stage(model_dir, hf_config, self.max_model_len, self.dtype, self.device, self.layer_range)
        return load_shard(model_dir, hf_config, self.max_model_len, self.dtype, self.device, group.shard,
                          self.layer_range)

    def run(self, step: StepInput, batch=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This stage's layers over the step's micro-batches (`batch`, the whole step's, is not used); on rank 0 the
        logits of the step's sample rows and their hidden states (None without any, and on the other ranks). Each
        rank of a stage trades with the rank of the same tensor-parallel rank in the stage before and after it."""
        group, width = self.tp, self.model.config.hidden_size
        first, last = group.stage == 0, group.stage == group.num_stages - 1
        stride = group.tp_size  # between the same tensor-parallel rank of neighbouring stages
        self.transfer.apply(step)
        parts, order = micro_batches(step, self.config.pipeline_micro_batches or group.num_stages, self.block_size)
        self.split_steps += len(parts) > 1
        sends: list[tuple] = []
        try:
            with group.shard.collectives() if group.shard is not None else nullcontext():
                for part in parts:
                    part_batch, _ = self.prepare(part.items)
                    hidden = None if first else group.receive_hidden(len(part_batch.positions), width, self.dtype,
                                                                     group.rank - stride)
                    self.attention.begin_step(part_batch)
                    out = self.model(part_batch.input_ids, part_batch.positions, self.attention.forward, hidden=hidden)
                    if not last:
                        sends.append(group.send_hidden(out, group.rank + stride))
                    elif part.sample_rows:
                        rows = out.index_select(0, self.tensor(part.sample_rows))
                        sends.append(group.send_hidden(rows, group.rank % stride))
                if not (first and step.sample_rows):
                    return None
                return self.logits(parts, order, group.rank + (group.num_stages - 1) * stride)
        finally:
            group.wait(sends)

    def logits(self, parts: list[MicroBatch], order: list[int] | None,
               last_stage_rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first stage: the logits of the rows the last stage sends back, in the step's order, and those rows
        (on rank 0; None on the stage's other tensor-parallel ranks, which gather their vocabulary columns to it)."""
        group, width = self.tp, self.model.config.hidden_size
        received = [group.receive_hidden(len(part.sample_rows), width, self.dtype, last_stage_rank)
                    for part in parts if part.sample_rows]
        hidden = torch.cat(received) if len(received) > 1 else received[0]
        if order is not None:
            hidden = hidden.index_select(0, self.tensor(order))
        logits = self.model.compute_logits(hidden)
        if group.shard is None:
            return logits, hidden
        logits = group.shard.gather_columns(logits)
        return None if logits is None else (logits[:, :self.vocab_size], hidden)
