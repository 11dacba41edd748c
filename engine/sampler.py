"""Token sampling for one step: greedy, temperature, top-k, top-p; per-request seeded streams.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p;
a request with a seed draws its E from its own generator, so its text does not depend on the batch.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k <= 0 keeps all); ties at the k-th value are kept."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (the most likely always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] float32 -> one token per sequence."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.max(dim=-1).indices.tolist()  # first maximum, like argmax, and faster on CPU
        logits = logits.float()
        greedy_tokens = logits.argmax(dim=-1)
        probs = self.probabilities(logits, params)
        sampled = (probs / self.exponential(seqs, probs.shape[-1])).argmax(dim=-1)
        is_greedy = torch.tensor([p.temperature == 0 for p in params])
        return torch.where(is_greedy, greedy_tokens, sampled).tolist()

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's sampling distribution after temperature, top-k and top-p (greedy rows: T = 1)."""
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        scaled = logits.float() / temperature[:, None]
        if any(p.top_k > 0 for p in params):
            scaled = apply_top_k(scaled, torch.tensor([max(p.top_k, 0) for p in params]))
        if any(p.top_p < 1 for p in params):
            scaled = apply_top_p(scaled, torch.tensor([p.top_p for p in params]))
        return scaled.softmax(dim=-1)

    def generator_of(self, seq: Sequence) -> torch.Generator:
        """The sequence's own seeded stream, or the engine-wide one."""
        if seq.sample_seed is None:
            return self.generator
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed(seq.sample_seed)
        return seq.generator

    def exponential(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """Exp(1) noise, one row per sequence, each from that sequence's stream."""
        noise = torch.empty(len(seqs), width).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                noise[row].exponential_(generator=self.generator_of(seq))
        return noise

    def uniform(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """U(0, 1) draws, one row per sequence, each from that sequence's stream."""
        draws = torch.rand(len(seqs), width, generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                draws[row] = torch.rand(width, generator=self.generator_of(seq))
        return draws
