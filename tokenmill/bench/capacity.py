"""`tokenmill bench capacity`: how many requests fit in a KV budget at once, contiguous max-length
reservation against paged blocks, both driven through the engine's real block pool (a contiguous
reservation is a pool whose block is the whole context)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from engine.block_pool import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

MODEL_SHAPES = {  # name: (layers, kv heads, head dim, bytes per element)
    "llama-3-8b": (32, 8, 128, 2),
    "llama-3-70b": (80, 8, 128, 2),
    "smollm2-135m": (30, 3, 64, 4),
}


def bytes_per_token(shape: str) -> int:
    layers, kv_heads, head_dim, element = MODEL_SHAPES[shape]
    return 2 * layers * kv_heads * head_dim * element


def pareto_lengths(count: int, mean: float, maximum: int, seed: int = 0, alpha: float = 2.0) -> list[int]:
    """Pareto(alpha) lengths with the given mean before capping at `maximum` (at least 1)."""
    scale = mean * (alpha - 1) / alpha
    rng = np.random.default_rng(seed)
    lengths = (rng.pareto(alpha, count) + 1) * scale
    return np.clip(lengths.astype(int), 1, maximum).tolist()


@dataclass
class Fill:
    scheme: str
    block_size: int
    requests: int  # requests resident at once
    used_tokens: int  # tokens the resident requests hold
    reserved_tokens: int  # KV slots allocated to them

    @property
    def wasted_tokens(self) -> int:
        return self.reserved_tokens - self.used_tokens

    @property
    def waste_per_request(self) -> float:
        return self.wasted_tokens / self.requests if self.requests else 0.0


def fill(budget_tokens: int, block_size: int, request_tokens: list[int], scheme: str) -> Fill:
    """Admit requests (cycling through `request_tokens`, each at its full length) into a pool of
    budget_tokens // block_size blocks until the next one does not fit."""
    kv = KVCacheManager(budget_tokens // block_size + 1, block_size, enable_caching=False)
    used = 0
    for seq_id, tokens in enumerate(itertools.cycle(request_tokens)):
        seq = Sequence(seq_id, str(seq_id), [1] * tokens, SamplingParams(max_tokens=1))
        if not kv.allocate_slots(seq, tokens):
            return Fill(scheme, block_size, seq_id, used, (kv.usable_blocks - kv.pool.num_free_blocks) * block_size)
        used += tokens
    raise AssertionError("unreachable")


def compare(budget_tokens: int, context: int, block_size: int, request_tokens: list[int]) -> tuple[Fill, Fill]:
    """(contiguous, paged): contiguous reserves the whole context per request, paged takes blocks."""
    if max(request_tokens) > context:
        raise ValueError(f"a request of {max(request_tokens)} tokens exceeds the {context}-token context")
    return (fill(budget_tokens, context, request_tokens, "contiguous (max-length reservation)"),
            fill(budget_tokens, block_size, request_tokens, f"paged ({block_size}-token blocks)"))
