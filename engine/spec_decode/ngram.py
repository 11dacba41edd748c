"""Prompt-lookup (n-gram) proposer: find the sequence's last n tokens earlier in its own prompt and
output, and propose the tokens that followed them there."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the longest matching suffix."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram, excluding the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
