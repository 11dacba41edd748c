"""Turn the target's logits at each draft position into each sequence's accepted tokens."""

from __future__ import annotations

import torch

from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.spec_decode.rejection import greedy_verify, rejection_sample


def pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack [n_i, ...] tensors into [len(rows), length, ...], repeating each one's last row as padding."""
    return torch.stack([torch.cat([r, r[-1:].expand(length - r.shape[0], *r.shape[1:])]) for r in rows])


def verify_drafts(logits: list[torch.Tensor], seqs: list[Sequence], sampler: Sampler) -> list[list[int]]:
    """logits[i]: [1 + len(drafts), vocab] for seqs[i]. Greedy sequences accept exactly the target's argmax;
    sampled ones go through exact rejection sampling. Returns each sequence's new tokens."""
    out: dict[int, list[int]] = {}
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
    sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
    if greedy:
        _collect(out, greedy, *_verify_greedy([logits[i] for i in greedy], [seqs[i] for i in greedy]))
    if sampled:
        _collect(out, sampled, *_verify_sampled([logits[i] for i in sampled], [seqs[i] for i in sampled], sampler))
    return [out[i] for i in range(len(seqs))]


def _collect(out: dict[int, list[int]], indices: list[int], tokens: torch.Tensor, counts: torch.Tensor) -> None:
    for row, (index, count) in enumerate(zip(indices, counts.tolist(), strict=True)):
        out[index] = tokens[row, :count].tolist()


def _drafts(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = max(len(s.spec_token_ids) for s in seqs)
    drafts = torch.tensor([s.spec_token_ids + [0] * (k - len(s.spec_token_ids)) for s in seqs], dtype=torch.long)
    return drafts, torch.tensor([len(s.spec_token_ids) for s in seqs]), k


def _verify_greedy(logits: list[torch.Tensor], seqs: list[Sequence]):
    drafts, num_drafts, k = _drafts(seqs)
    argmax = pad_rows([row.max(dim=-1).indices for row in logits], k + 1)
    return greedy_verify(argmax, drafts, num_drafts)


def _verify_sampled(logits: list[torch.Tensor], seqs: list[Sequence], sampler: Sampler):
    drafts, num_drafts, k = _drafts(seqs)
    probs = [sampler.probabilities(rows, [s.params] * rows.shape[0]) for rows, s in zip(logits, seqs, strict=True)]
    target = pad_rows(probs, k + 1)
    draft_probs = None
    if seqs[0].spec_draft_probs is not None:
        draft_probs = pad_rows([s.spec_draft_probs.float() for s in seqs], k)
    uniforms = sampler.uniform(seqs, k)
    noise = sampler.exponential(seqs, target.shape[-1])
    return rejection_sample(target, drafts, num_drafts, draft_probs, uniforms, noise)
