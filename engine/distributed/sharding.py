"""One rank's shard of a Llama-family model, as Megatron-LM splits it: QKV and gate/up column-parallel (each rank
its own heads and intermediate columns), O and down row-parallel (partial sums, one all-reduce each), embedding
and LM head split over the vocabulary. Each rank reads only its slices from the safetensors files.

The shard is the ordinary `LlamaForCausalLM` built from a config with 1/N of the heads, KV heads, intermediate
size and vocabulary, with the row-parallel projections and the embedding swapped for the classes below."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import TensorParallelGroup
from engine.kernels.cpu_gemm import Linear
from engine.model_loader import finish_loading, materialize
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, head_dim_of

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def check_divisible(hf_config, world_size: int) -> None:
    """Refuse a model whose heads, KV heads or MLP width `world_size` does not divide."""
    counts = {"attention heads": hf_config.num_attention_heads, "KV heads": hf_config.num_key_value_heads,
              "intermediate size": hf_config.intermediate_size}
    for what, count in counts.items():
        if count % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {what} ({count}); "
                             f"choose a divisor of {count}")


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def shard_config(hf_config, world_size: int):
    """The config of one rank's shard: 1/N of the heads, KV heads and intermediate size. The vocabulary stays
    whole here (callers compare it with a draft model's); `swap_parallel_modules` splits it."""
    check_divisible(hf_config, world_size)
    shard = copy.deepcopy(hf_config)
    shard.head_dim = head_dim_of(hf_config)  # kept: derived from hidden_size / heads, it would change
    shard.num_attention_heads = hf_config.num_attention_heads // world_size
    shard.num_key_value_heads = hf_config.num_key_value_heads // world_size
    shard.intermediate_size = hf_config.intermediate_size // world_size
    return shard


class RowParallelLinear(Linear):
    """A projection over this rank's input columns: its output is a partial sum, all-reduced over the ranks.
    Only rank 0 keeps a bias, so it is added once."""

    group: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.group.all_reduce(out) if self.group.active else out


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [first, first + num_embeddings) of the embedding; a token outside them embeds to zeros,
    and the all-reduce sums each token's one non-zero row (exact)."""

    group: TensorParallelGroup
    first: int

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out) if self.group.active else out


def swap_parallel_modules(model: LlamaForCausalLM, group: TensorParallelGroup) -> None:
    """Replace the row-parallel projections, the embedding and the LM head of a shard built on the meta device."""
    for layer in model.layers:
        for name in ROW_PARALLEL:
            old = getattr(layer, name)
            new = RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
            new.group = group
            setattr(layer, name, new)
    if model.embed_tokens is None:  # a pipeline stage after the first
        return
    vocab = vocab_per_rank(model.config.vocab_size, group.world_size)
    embedding = VocabParallelEmbedding(vocab, model.config.hidden_size, device="meta")
    embedding.group, embedding.first = group, group.rank * vocab
    model.embed_tokens = embedding
    if model.lm_head is not None:  # untied: its own vocabulary rows (rank 0 gathers the logits)
        model.lm_head = Linear(model.config.hidden_size, vocab, bias=False, device="meta")


def shard_weights(files: list[Path], hf_config, rank: int, world_size: int, holds=lambda name: True):
    """(name, this rank's slice) for each checkpoint tensor it `holds`, read slice by slice: no rank holds a whole
    tensor."""
    from safetensors import safe_open

    vocab = vocab_per_rank(hf_config.vocab_size, world_size)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if holds(name):
                    yield name, _slice(name, f.get_slice(name), rank, world_size, vocab)


def _slice(name: str, tensor, rank: int, world_size: int, vocab: int) -> torch.Tensor:
    module = name.rsplit(".", 2)[-2]
    shape = tensor.get_shape()
    if module in COLUMN_PARALLEL:
        rows = shape[0] // world_size
        return tensor[rank * rows:(rank + 1) * rows]
    if module in ROW_PARALLEL:
        if name.endswith(".bias"):
            return tensor[:] if rank == 0 else torch.zeros(shape, dtype=_dtype(tensor))
        columns = shape[1] // world_size
        return tensor[:, rank * columns:(rank + 1) * columns]
    if module in VOCAB_PARALLEL:
        first, end = min(rank * vocab, shape[0]), min((rank + 1) * vocab, shape[0])
        rows = tensor[first:end]
        return F.pad(rows, (0, 0, 0, vocab - rows.shape[0]))  # the last rank's padding rows: zeros
    return tensor[:]


def _dtype(tensor) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[tensor.get_dtype()]


def load_shard(model_dir: Path, hf_config, max_positions: int, dtype: torch.dtype, device: torch.device,
               group: TensorParallelGroup, layers: range | None = None) -> LlamaForCausalLM:
    """This rank's shard of the model in `model_dir` (of a pipeline stage's `layers`), on `device` in `dtype`
    (packed for the CPU GEMMs on CPU)."""
    config = shard_config(hf_config, group.world_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, layers)
    swap_parallel_modules(model, group)
    materialize(model, device)
    files = sorted(model_dir.glob("*.safetensors"))
    model.load_hf_weights(shard_weights(files, hf_config, group.rank, group.world_size,
                                        lambda name: model.stage_name(name) is not None))
    return finish_loading(model, hf_config, max_positions, dtype, device)


class ShardRunner(ModelRunner):
    """A tensor-parallel rank's runner: its shard of the model."""

    def load(self, model_dir: Path, hf_config) -> LlamaForCausalLM:
        return load_shard(model_dir, hf_config, self.max_model_len, self.dtype, self.device, self.tp)
