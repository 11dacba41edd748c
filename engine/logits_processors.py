"""Per-request logit adjustments, as in vLLM and OpenAI: min_tokens, logit_bias, repetition, presence and
frequency penalties. Only steps with a row that asks for one run this (the sampler's fast path stays as is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.step_types import SampleLayout


def apply_logits_processors(logits: torch.Tensor, layout: SampleLayout, stop_token_ids: frozenset[int]) -> None:
    """In place on float32 logits [rows, vocab]."""
    vocab = logits.shape[-1]
    penalised: list[tuple[int, Sequence, list[int]]] = []
    for row, seq, drafts in layout.row_contexts():
        params = seq.params
        if params.min_tokens and seq.num_output_tokens + len(drafts) < params.min_tokens:
            logits[row, [t for t in stop_token_ids | set(params.stop_token_ids) if t < vocab]] = float("-inf")
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < vocab]
            logits[row, ids] += torch.tensor([float(params.logit_bias[t]) for t in ids], device=logits.device)
        if params.has_penalties:
            penalised.append((row, seq, drafts))
    if penalised:
        apply_penalties(logits, penalised)


def apply_penalties(logits: torch.Tensor, rows: list[tuple[int, Sequence, list[int]]]) -> None:
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor([row for row, _, _ in rows], device=device)
    counts = torch.zeros(len(rows), vocab, device=device)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for i, (_, seq, drafts) in enumerate(rows):
        outputs = torch.tensor(seq.output_token_ids + drafts, dtype=torch.long, device=device)
        counts[i].scatter_add_(0, outputs, torch.ones(len(outputs), device=device))
        seen[i, torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=device)] = True
    seen |= counts > 0
    params = [seq.params for _, seq, _ in rows]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    selected = logits[index]
    penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, penalised, selected)
    selected -= frequency * counts + presence * (counts > 0)
    logits[index] = selected
