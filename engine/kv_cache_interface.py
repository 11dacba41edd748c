"""What memory planning reads of the loaded model and what it hands the runner, as plain data (vLLM v1's
kv_cache_interface): `ModelShape`, `ModelProbe` (the model to run while planning) and `KVPlan`, the plan the runner
allocates its KV pool from (`ModelRunner.initialize_kv_cache`), with an FP8 pool's `KVScales`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelShape:
    """The loaded model as the memory plan, the FP8 scales, the KV connector and the draft proposers see it: this
    rank's (a tensor-parallel shard's heads, a pipeline stage's layers) and the pool's block size."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_model_len: int
    weights_bytes: int
    num_ranks: int = 1  # processes sharing the host: tensor-parallel ranks or pipeline stages
    cuda_graphs: bool = False  # decode steps replay CUDA graphs, whose pool the plan counts

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class ModelProbe(NamedTuple):
    """What planning runs: the loaded model (FP8 scales are calibrated on it, CUDA profiles a forward of it), the
    attention factory over a scratch pool and the tensor maker."""

    model: Any
    make_attention: Callable[..., Any]  # (k caches, v caches) -> an AttentionBackend
    to_tensor: Callable[[list], torch.Tensor]


@dataclass
class KVScales:
    """Per layer and KV head, float32 [layers, Hkv]: the K and the V scales of an FP8 pool (engine/kv_quant.py)."""

    k: torch.Tensor
    v: torch.Tensor

    def to_dict(self) -> dict[str, list[list[float]]]:
        return {"k": self.k.tolist(), "v": self.v.tolist()}


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
    kv_scales: KVScales | None = None  # FP8 pool: its per-layer, per-head scales; None: the model's dtype
    model_dtype_bytes_per_block: int = 0  # FP8 pool: a block's bytes in the model's dtype, for the log

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
                f"total {self.total_bytes / mib:.0f} MiB of a {self.budget_bytes / mib:.0f} MiB budget"
                + self.describe_fp8())

    def describe_fp8(self) -> str:
        if self.kv_scales is None:
            return ""
        ratio = self.model_dtype_bytes_per_block / self.bytes_per_block
        return (f"; FP8 (e4m3) blocks of {self.bytes_per_block / 2**10:.0f} KiB instead of "
                f"{self.model_dtype_bytes_per_block / 2**10:.0f} KiB: {ratio:.2f}x the blocks in the same memory")
