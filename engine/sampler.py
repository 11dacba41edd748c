"""Token sampling for one step: logits processors and grammar masks, greedy, temperature, top-k, top-p,
draft verification and logprobs; per-request seeded streams.

Sampling inverts each row's CDF at one uniform draw u (the first token whose cumulative probability passes
u x total), which draws exactly from p at the cost of one cumulative sum: no noise over the vocabulary. A request
with a seed takes its u for its n-th output token from a hash of (seed, n) (`position_uniform`), so its text depends
neither on the batch nor on the mode, and verifying drafts samples each position exactly as decoding without them
would (see `sample_positions`). Rows without a seed draw u from the engine's stream. (Until 2026-12 sampling was an
exponential race with per-request generators: the same seeds now give other, equally distributed, texts.)
Speculative decoding's rejection sampler keeps its uniform and exponential draws (`uniform`, `exponential`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.logits_processors import apply_logits_processors
from engine.outputs import Logprob, SampleLogprobs
from engine.spec_decode.verifier import verify_drafts
from engine.step_types import SampleLayout, SamplerOutput

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from engine.structured_outputs import StructuredOutputs


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
    def __init__(self, seed: int = 0, stop_token_ids: frozenset[int] = frozenset(),
                 structured: StructuredOutputs | None = None) -> None:
        """`stop_token_ids`: EOS ids, masked under min_tokens; `structured`: the engine's grammars."""
        self.generator = torch.Generator().manual_seed(seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded stream
        self.stop_token_ids = stop_token_ids
        self.structured = structured
        self.batch_invariant = False  # seeded noise keyed by output position (set by the model runner)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished sequences' streams and grammar matchers."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        if self.structured is not None:
            self.structured.release(seq_ids)

    def sample(self, layout: SampleLayout, logits: torch.Tensor) -> SamplerOutput:
        """logits: the layout's rows -> each sequence's tokens: one sampled token, or the accepted drafts and
        then one recovered or bonus token."""
        seqs = layout.seqs
        logprobs = None
        extras = [s.params for s in seqs.values() if s.params.has_extras]
        if extras:
            if any(p.logprobs is not None for p in extras):  # the model's own, before any mask
                logprobs = logits.float().log_softmax(dim=-1)
            if any(p.has_penalties or p.logit_bias or p.min_tokens for p in extras):
                logits = logits.float()
                apply_logits_processors(logits, layout, self.stop_token_ids)
            if self.structured is not None and self.structured.constrains(seqs.values()):
                logits = self.structured.mask(logits, layout)
        tokens: dict[int, list[int]] = {}
        plain = layout.plain
        if plain:
            rows = [layout.first_row[i] for i in plain]
            plain_logits = logits if len(rows) == logits.shape[0] else logits[rows]  # all plain, in order: no gather
            tokens.update((i, [t]) for i, t in zip(plain, self(plain_logits, [seqs[i] for i in plain]), strict=True))
        if layout.drafts:
            ids = list(layout.drafts)
            rows = [logits[layout.first_row[i]:layout.first_row[i] + 1 + len(layout.drafts[i])] for i in ids]
            verified = verify_drafts(rows, [seqs[i] for i in ids], [layout.drafts[i] for i in ids],
                                     [layout.draft_probs.get(i) for i in ids], self)
            tokens.update(zip(ids, verified, strict=True))
        tokens = {i: tokens[i] for i in seqs}  # in layout order
        return SamplerOutput(tokens, record_logprobs(logprobs, layout, tokens) if logprobs is not None else {})

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] float32 -> one token per sequence."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.max(dim=-1).indices.tolist()  # first maximum, like argmax, and faster on CPU
        logits = logits.float()
        sampled = inverse_cdf(self.probabilities(logits, params), self.draws(seqs))
        if all(p.temperature > 0 for p in params):
            return sampled.tolist()
        is_greedy = torch.tensor([p.temperature == 0 for p in params])
        return torch.where(is_greedy, logits.argmax(dim=-1), sampled).tolist()

    def draws(self, seqs: list[Sequence]) -> torch.Tensor:
        """One U[0, 1) per sequence: a seeded one's keyed by its seed and output position, else the engine's."""
        if all(seq.sample_seed is not None for seq in seqs):
            return torch.tensor([position_uniform(seq.sample_seed, seq.num_output_tokens) for seq in seqs])
        shared = torch.rand(len(seqs), generator=self.generator).tolist()
        return torch.tensor([u if seq.sample_seed is None else position_uniform(seq.sample_seed, seq.num_output_tokens)
                             for u, seq in zip(shared, seqs, strict=True)])

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's sampling distribution after temperature, top-k and top-p (greedy rows: T = 1)."""
        temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        scaled = logits.float()
        if any(t != 1.0 for t in temperatures):
            scaled = scaled / torch.tensor(temperatures)[:, None]
        if any(p.top_k > 0 for p in params):
            scaled = apply_top_k(scaled, torch.tensor([max(p.top_k, 0) for p in params]))
        if any(p.top_p < 1 for p in params):
            scaled = apply_top_p(scaled, torch.tensor([p.top_p for p in params]))
        return scaled.softmax(dim=-1)

    def generator_of(self, seq: Sequence) -> torch.Generator:
        """The sequence's own seeded stream, or the engine-wide one."""
        if seq.sample_seed is None:
            return self.generator
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.sample_seed)
        return self.generators[seq.seq_id]

    def exponential(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """Exp(1) noise, one row per sequence, each from that sequence's stream."""
        noise = torch.empty(len(seqs), width).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                noise[row].exponential_(generator=self.generator_of(seq))
        return noise

    def sample_positions(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Batch-invariant mode, a seeded sequence: logits [m, vocab] of its next m positions -> the token it samples
        at each, as it would one step at a time."""
        probs = self.probabilities(logits.float(), [seq.params] * logits.shape[0])
        draws = torch.tensor([position_uniform(seq.sample_seed, seq.num_output_tokens + i)
                              for i in range(logits.shape[0])])
        return inverse_cdf(probs, draws)

    def uniform(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """U(0, 1) draws, one row per sequence, each from that sequence's stream."""
        draws = torch.rand(len(seqs), width, generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                draws[row] = torch.rand(width, generator=self.generator_of(seq))
        return draws


MASK64 = (1 << 64) - 1


def position_uniform(seed: int, index: int) -> float:
    """U[0, 1) on a 2^-24 grid for output token `index` of a request seeded `seed` (splitmix64 of the pair): the same
    however the tokens are batched."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


CDF_BLOCK = 256  # inverse_cdf sums blocks of this many tokens first, then scans one block


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (rows need not sum to 1), draws [B] in [0, 1) -> per row the first token whose cumulative
    probability exceeds draw x the row's total: the block of CDF_BLOCK tokens where the cumulative block sums pass
    it, then the token within that block. A zero-probability token is never taken; where rounding would reach past
    a block's last token (a chance near 2^-24), the row's most likely token is taken."""
    num_rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(num_rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    targets = draws.to(block_cdf.dtype) * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, targets[:, None], right=True).squeeze(1).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    within = blocks[torch.arange(num_rows), block].cumsum(dim=-1)
    offset = torch.searchsorted(within, (targets - before)[:, None], right=True).squeeze(1).clamp_(max=CDF_BLOCK - 1)
    tokens = (block * CDF_BLOCK + offset).clamp_(max=vocab - 1)
    missed = probs.gather(1, tokens[:, None]).squeeze(1) <= 0
    if bool(missed.any()):
        tokens = torch.where(missed, probs.argmax(dim=-1), tokens)
    return tokens


def record_logprobs(logprobs: torch.Tensor, layout: SampleLayout,
                    tokens: dict[int, list[int]]) -> dict[int, SampleLogprobs]:
    """For each sequence asking for logprobs, per new token {token: Logprob} for the sampled token and the top
    params.logprobs tokens of its row (a sequence with drafts: one row per accepted token)."""
    out: dict[int, SampleLogprobs] = {}
    for seq_id, seq in layout.seqs.items():
        k = seq.params.logprobs
        if k is None or not tokens[seq_id]:
            continue
        start = layout.first_row[seq_id]
        rows = logprobs[start:start + len(tokens[seq_id])]
        chosen = torch.tensor(tokens[seq_id], device=rows.device)[:, None]
        chosen_lp = rows.gather(1, chosen)
        ranks = ((rows > chosen_lp).sum(dim=-1) + 1).tolist()
        top = rows.topk(k, dim=-1) if k else None
        entries = out[seq_id] = []
        for i, token in enumerate(tokens[seq_id]):
            entry = {token: Logprob(chosen_lp[i, 0].item(), ranks[i])}
            if top is not None:
                for rank, (value, top_token) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist(),
                                                              strict=True), start=1):
                    entry.setdefault(top_token, Logprob(value, rank))
            entries.append(entry)
    return out
