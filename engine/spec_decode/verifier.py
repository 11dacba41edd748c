"""Turn the target's logits at each draft position into each sequence's accepted tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.spec_decode.rejection import greedy_verify, rejection_sample

if TYPE_CHECKING:
    from engine.sequence import Sequence


def pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack [n_i, ...] tensors into [len(rows), length, ...], repeating each one's last row as padding."""
    return torch.stack([torch.cat([r, r[-1:].expand(length - r.shape[0], *r.shape[1:])]) for r in rows])


def verify_drafts(logits: list[torch.Tensor], seqs: list[Sequence], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None], sampler) -> list[list[int]]:
    """logits[i]: [1 + len(drafts[i]), vocab] for seqs[i]; draft_probs[i]: the draft model's distributions at
    each draft (None: a deterministic proposer); sampler: the engine's `Sampler` (its streams). Greedy
    sequences accept exactly the target's argmax; sampled ones go through exact rejection sampling. Returns
    each sequence's new tokens."""
    out: dict[int, list[int]] = {}
    by_position = [i for i, s in enumerate(seqs)
                   if s.params.temperature > 0 and s.sample_seed is not None and sampler.batch_invariant]
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
    sampled = [i for i, s in enumerate(seqs) if s.params.temperature > 0 and i not in by_position]
    if greedy:
        _collect(out, greedy, *_verify_greedy([logits[i] for i in greedy], [drafts[i] for i in greedy]))
    if by_position:  # each position sampled as without drafts; the drafts up to the first miss are kept
        tokens = [sampler.sample_positions(logits[i], seqs[i]) for i in by_position]
        _collect(out, by_position, *_verify_tokens(tokens, [drafts[i] for i in by_position]))
    if sampled:
        _collect(out, sampled, *_verify_sampled([logits[i] for i in sampled], [seqs[i] for i in sampled],
                                                [drafts[i] for i in sampled], [draft_probs[i] for i in sampled],
                                                sampler))
    return [out[i] for i in range(len(seqs))]


def _collect(out: dict[int, list[int]], indices: list[int], tokens: torch.Tensor, counts: torch.Tensor) -> None:
    for row, (index, count) in enumerate(zip(indices, counts.tolist(), strict=True)):
        out[index] = tokens[row, :count].tolist()


def _padded(drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    k = max(map(len, drafts))
    padded = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long)
    return padded, torch.tensor([len(d) for d in drafts]), k


def _verify_greedy(logits: list[torch.Tensor], drafts: list[list[int]]):
    return _verify_tokens([row.max(dim=-1).indices for row in logits], drafts)


def _verify_tokens(target_tokens: list[torch.Tensor], drafts: list[list[int]]):
    """Accept each sequence's drafts while they equal the target's own token at that position."""
    padded, num_drafts, k = _padded(drafts)
    return greedy_verify(pad_rows(target_tokens, k + 1), padded, num_drafts)


def _verify_sampled(logits: list[torch.Tensor], seqs: list[Sequence], drafts: list[list[int]],
                    draft_probs: list[torch.Tensor | None], sampler):
    padded, num_drafts, k = _padded(drafts)
    probs = [sampler.probabilities(rows, [s.params] * rows.shape[0]) for rows, s in zip(logits, seqs, strict=True)]
    target = pad_rows(probs, k + 1)
    padded_probs = None if draft_probs[0] is None else pad_rows([p.float() for p in draft_probs], k)
    uniforms = sampler.uniform(seqs, k)
    noise = sampler.exponential(seqs, target.shape[-1])
    return rejection_sample(target, padded, num_drafts, padded_probs, uniforms, noise)
