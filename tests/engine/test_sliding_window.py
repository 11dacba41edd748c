"""Sliding-window layers in the torch backend (Gemma 3's local layers): a query at position p attends to its sequence's
keys in (p - W, p], in decodes, whole prompts, chunks after a cached context and verified drafts alike, against
attention computed key by key; the layers without a window attend as before."""

import math
import random

import pytest
import torch

import engine.attention.torch_backend as tb
from engine.attention.base import PrefillGroup, StepBatch, allocate_kv_pool
from engine.kernels import cpu_kernel

HKV, HQ, BS, D, NUM_BLOCKS = 1, 4, 4, 16, 600


def mixed_batch(rng: random.Random, decode_lens: list[int], query_lens: list[int], context_lens: list[int],
                windows: list[int | None]):
    """Decodes of `decode_lens` tokens, then prefills whose last `query_lens` of `context_lens` tokens are queries,
    in a pool of len(windows) layers whose earlier tokens hold random keys and values."""
    layers = len(windows)
    k, v = allocate_kv_pool(layers, HKV, NUM_BLOCKS, BS, D, torch.float32, torch.device("cpu"))
    for pool in k + v:
        pool.normal_()
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    lens = decode_lens + context_lens
    queries = [1] * len(decode_lens) + query_lens
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = [p for q, n in zip(queries, lens, strict=True) for p in range(n - q, n)]
    slots = [t[p // BS] * BS + p % BS for t, q, n in zip(tables, queries, lens, strict=True) for p in range(n - q, n)]
    num_decodes = len(decode_lens)
    prefill = PrefillGroup(query_lens, context_lens, padded[num_decodes:]) if query_lens else None
    batch = StepBatch(torch.zeros(len(positions), dtype=torch.long), torch.tensor(positions), torch.tensor(slots),
                      num_decodes, torch.tensor(decode_lens, dtype=torch.long), padded[:num_decodes],
                      max(decode_lens, default=0), prefill, torch.tensor([]), 0, decode_lens)
    tokens = len(positions)
    q, new_k, new_v = (torch.randn(tokens, n * D) for n in (HQ, HKV, HKV))
    return tb.TorchAttention(k, v, HQ, windows), batch, (q, new_k, new_v), tables, queries, lens


def key_by_key(attention, layer: int, q, tables, queries, lens, window: int | None) -> torch.Tensor:
    """Each token's attention over its own sequence's keys in the window, the keys read from the pool position by
    position, scores masked outside (p - window, p]."""
    k_pool, v_pool = attention.k_caches[layer], attention.v_caches[layer]
    outs, row = [], 0
    for table, query_len, n in zip(tables, queries, lens, strict=True):
        blocks = torch.tensor([table[j // BS] for j in range(n)])
        offsets = torch.tensor([j % BS for j in range(n)])
        keys = k_pool[:, blocks, offsets].repeat_interleave(HQ // HKV, 0)  # [HQ, n, D]: position j's key at [:, j]
        values = v_pool[:, blocks, offsets].repeat_interleave(HQ // HKV, 0)
        query = q[row:row + query_len].view(query_len, HQ, D).transpose(0, 1)  # [HQ, query_len, D]
        position = torch.arange(n - query_len, n)[:, None]
        key = torch.arange(n)[None, :]
        seen = (key <= position) & (key > position - (window or n + 1))
        scores = (query @ keys.transpose(1, 2) / math.sqrt(D)).masked_fill(~seen, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(query_len, -1))
        row += query_len
    return torch.cat(outs)


CASES = {  # decode lengths, prefill query lengths, their context lengths
    "decodes": ([1, 3, 7, 8, 9, 30, 61], [], []),
    "prompts": ([], [5, 23, 40], [5, 23, 40]),
    "chunks-after-cached-context": ([], [4, 9, 13], [20, 50, 13]),
    "decodes-and-prefills": ([2, 19, 44], [6, 1, 31, 3], [6, 26, 31, 60]),
}


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("window", [1, 6, 13, 61])  # 61: no context is longer, the global groups serve
@pytest.mark.parametrize("case", list(CASES))
def test_a_sliding_window_layer_attends_to_the_last_window_of_keys(case, window, kernel, monkeypatch):
    """Layer 0 global, layer 1 windowed: each equals attention computed key by key; with the CPU kernel available
    (it writes the KV and runs the global layer's decodes) and without it."""
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "available", lambda dtype: False)
    decode_lens, query_lens, context_lens = CASES[case]
    attention, batch, (q, new_k, new_v), tables, queries, lens = mixed_batch(
        random.Random(window), decode_lens, query_lens, context_lens, [None, window])
    attention.begin_step(batch)
    assert list(attention.window_groups) == [window]
    assert (attention.window_groups[window] is attention.groups) == (max(lens) <= window)
    for layer, layer_window in enumerate([None, window]):
        out = attention.forward(layer, q, new_k, new_v)
        expected = key_by_key(attention, layer, q, tables, queries, lens, layer_window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_windowed_group_reads_only_the_blocks_its_windows_touch():
    """A decode at position 99 with a window of 8 reads 3 blocks (keys 92..99 span blocks 23 and 24, plus one of
    slack for an unaligned window), not the 25 of its context."""
    attention, batch, *_ = mixed_batch(random.Random(0), [100], [], [], [8])
    attention.begin_step(batch)
    [group] = attention.window_groups[8]
    assert group.suffix_len == 3 * BS


def test_no_window_leaves_the_backend_as_it_was():
    attention, batch, *_ = mixed_batch(random.Random(0), [10, 20], [5], [5], [None, None])
    assert attention.layer_windows is None
    attention.begin_step(batch)
    assert attention.window_groups == {}


def test_batch_invariant_mode_refuses_sliding_windows():
    attention, *_ = mixed_batch(random.Random(0), [10], [], [], [None, 4])
    with pytest.raises(RuntimeError, match="sliding-window"):
        attention.set_batch_invariant(True)
