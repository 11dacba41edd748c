"""Rows grouped by adapter slot, on the device, for the gathered LoRA kernels (engine/lora/kernels.py)."""

from __future__ import annotations

import torch


def segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows grouped by slot, on slots' device without synchronizing: `order` (int64, the rows of slot 0, then
    slot 1, ..., then the base rows), and each slot's `starts` and `counts` in it (int64 [num_slots])."""
    keys = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_slots]
    return order, torch.cumsum(counts, 0) - counts, counts
