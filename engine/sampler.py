"""Token sampling for one step: logits processors and grammar masks, greedy, temperature, top-k, top-p,
draft verification and logprobs; per-request seeded streams.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p;
a request with a seed draws its E from its own generator, so its text does not depend on the batch.
In batch-invariant mode a seeded request's E for its n-th output token comes from a stream seeded by (seed, n), so
verifying drafts samples each position exactly as decoding without them would (see `sample_positions`).
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
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.sample_seed)
        return self.generators[seq.seq_id]

    def exponential(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """Exp(1) noise, one row per sequence, each from that sequence's stream."""
        noise = torch.empty(len(seqs), width).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None and self.batch_invariant:
                noise[row] = position_noise(seq.sample_seed, seq.num_output_tokens, width)
            elif seq.sample_seed is not None:
                noise[row].exponential_(generator=self.generator_of(seq))
        return noise

    def sample_positions(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """Batch-invariant mode, a seeded sequence: logits [m, vocab] of its next m positions -> the token it samples
        at each, as it would one step at a time."""
        probs = self.probabilities(logits, [seq.params] * logits.shape[0])
        noise = torch.stack([position_noise(seq.sample_seed, seq.num_output_tokens + i, logits.shape[-1])
                             for i in range(logits.shape[0])])
        return (probs / noise).argmax(dim=-1)

    def uniform(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """U(0, 1) draws, one row per sequence, each from that sequence's stream."""
        draws = torch.rand(len(seqs), width, generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                draws[row] = torch.rand(width, generator=self.generator_of(seq))
        return draws


def position_noise(seed: int, index: int, width: int) -> torch.Tensor:
    """Exp(1) noise for output token `index` of a request seeded `seed`: the same however the tokens are batched."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + index) % (1 << 63))
    return torch.empty(width).exponential_(generator=generator)


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
