"""Verification of proposed tokens: exact rejection sampling, and greedy verification.

Terms as in vLLM: a draft token is *accepted*; at the first rejection a *recovered* token is sampled
from normalise(max(0, target - draft)); when every draft is accepted a *bonus* token is sampled from
the target at the next position. The output is distributed exactly as the target model's.
"""

from __future__ import annotations

import torch


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of `probs` (rows need not be normalised) given Exp(1) noise."""
    return (probs / noise).argmax(dim=-1)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of a batch of sequences in one go.

    target_probs [B, K+1, V]: the target's distribution at each draft position and one beyond.
    draft_tokens [B, K], num_drafts [B] (<= K; the rest is padding).
    draft_probs [B, K, V] from a draft model, or None for a deterministic proposer (n-gram), whose
    distribution is a point mass on its token.
    uniforms [B, K] ~ U(0, 1) for the accept tests; noise [B, V] ~ Exp(1) for the one token sampled per row.
    Returns (tokens [B, K+1], counts [B]): each row's first counts[b] entries are its output tokens
    (the accepted drafts, then one recovered or bonus token).
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch)
    positions = torch.arange(k)
    target_at_draft = target_probs[:, :k].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)
    accepted = (uniforms * draft_at_draft < target_at_draft) & (positions[None, :] < num_drafts[:, None])
    num_accepted = torch.where(accepted.all(dim=1), k, (~accepted).int().argmax(dim=1))
    num_accepted = torch.minimum(num_accepted, num_drafts)

    last = target_probs[rows, num_accepted]  # [B, V] the target at the first rejected (or bonus) position
    rejected = num_accepted < num_drafts
    if rejected.any():
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            draft_row = torch.zeros_like(last).scatter_(1, draft_tokens[rows, at][:, None], 1.0)
        else:
            draft_row = draft_probs[rows, at]
        residual = (last - draft_row).clamp_(min=0)
        residual_ok = residual.sum(dim=1, keepdim=True) > 0  # p == q exactly: any token of p will do
        last = torch.where(rejected[:, None] & residual_ok, residual, last)
    final = race(last, noise)
    tokens = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=draft_tokens.dtype)], dim=1)
    tokens[rows, num_accepted] = final
    return tokens, num_accepted + 1


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; then take the target's argmax.

    target_argmax [B, K+1], draft_tokens [B, K], num_drafts [B]. Returns (tokens [B, K+1], counts [B])."""
    batch, k = draft_tokens.shape
    matches = (draft_tokens == target_argmax[:, :k]) & (torch.arange(k)[None, :] < num_drafts[:, None])
    num_accepted = torch.where(matches.all(dim=1), k, (~matches).int().argmax(dim=1))
    num_accepted = torch.minimum(num_accepted, num_drafts)
    tokens = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=draft_tokens.dtype)], dim=1)
    rows = torch.arange(batch)
    tokens[rows, num_accepted] = target_argmax[rows, num_accepted]
    return tokens, num_accepted + 1
