"""The torch backend's decode groups: decodes cut by context length read fewer keys, same results; the CPU
decode kernel (no gather) gives the torch path's results, with and without a shared prefix, in float32 and
bfloat16."""

import random

import pytest
import torch

import engine.attention.torch_backend as tb
from engine.attention.base import StepBatch, allocate_kv_pool
from engine.kernels import cpu_kernel


def test_decode_groups_cut_sorted_lengths_where_it_saves_reading():
    assert tb.decode_groups([], 16) == []
    assert tb.decode_groups([100] * 20, 16) == [(0, 20)]  # equal lengths: nothing to save
    assert tb.decode_groups([10, 20, 30], 16) == [(0, 3)]  # too few to cut
    lens = [20] * 30 + [300] * 2
    assert tb.decode_groups(lens, 16) == [(0, 30), (30, 32)]
    rng = random.Random(0)
    groups = tb.decode_groups(sorted(rng.randint(20, 400) for _ in range(64)), 16)
    assert 2 <= len(groups) <= 4 and groups[0][0] == 0 and groups[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))


def decode_batch(rng: random.Random, shared: int = 0, dtype: torch.dtype = torch.float32, seqs: int = 40,
                 d: int = 16):
    """`seqs` decodes in a pool of one layer; the first `shared` blocks of every table are the same blocks."""
    hkv, hq, bs, num_blocks = 2, 6, 4, 1800
    k, v = allocate_kv_pool(1, hkv, num_blocks, bs, d, dtype, torch.device("cpu"))
    k[0].normal_()
    v[0].normal_()
    lens = sorted(rng.randint(3, 150) for _ in range(seqs))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared)]
    lens = [n + shared * bs for n in lens]
    tables = [prefix + [free.pop() for _ in range(-(-n // bs) - shared)] for n in lens]
    width = max(map(len, tables))
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    batch = StepBatch(torch.zeros(seqs, dtype=torch.long), torch.tensor([n - 1 for n in lens]), torch.tensor(slots),
                      seqs, torch.tensor(lens), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                      max(lens), None, torch.tensor([]), shared, lens)
    q, new_k, new_v = (torch.randn(seqs, width * d).to(dtype) for width in (hq, hkv, hkv))
    return tb.TorchAttention(k, v, hq), batch, (q, new_k, new_v)


def test_grouped_decode_attention_equals_one_group(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "available", lambda dtype: False)
    attention, batch, (q, new_k, new_v) = decode_batch(random.Random(1))
    attention.begin_step(batch)
    assert len(attention.groups) > 1
    grouped = attention.forward(0, q, new_k, new_v)
    monkeypatch.setattr(tb, "decode_groups", lambda *args, **kwargs: [])
    attention.begin_step(batch)
    assert len(attention.groups) == 1
    torch.testing.assert_close(grouped, attention.forward(0, q, new_k, new_v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 64, 256, 24])  # a whole vector, SmolLM2's, Gemma 3's, the scalar kernel
@pytest.mark.parametrize("seqs", [40, 3])  # tasks of all a sequence's KV heads, and of one head each
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 5])
def test_the_cpu_decode_kernel_gives_the_torch_paths_results(shared, dtype, seqs, head_dim, monkeypatch):
    """The kernel (and its KV write) against the torch path (gather, SDPA, index_copy_)."""
    assert cpu_kernel.available(dtype), "this machine has a C compiler: the kernel must build"
    attention, batch, (q, new_k, new_v) = decode_batch(random.Random(2), shared, dtype, seqs, head_dim)
    attention.begin_step(batch)
    assert [g.kernel_tables is not None for g in attention.groups] == [True]
    assert (attention.groups[0].prefix_index is not None) == (shared >= tb.MIN_SHARED_BLOCKS)
    fused = attention.forward(0, q, new_k, new_v)
    monkeypatch.setattr(cpu_kernel, "available", lambda dtype: False)
    attention.begin_step(batch)
    assert all(g.kernel_tables is None for g in attention.groups)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: one rounding of the output apart
    torch.testing.assert_close(fused, attention.forward(0, q, new_k, new_v), rtol=tolerance, atol=tolerance)


def prefill_batch(rng: random.Random, query_lens: list[int], context_lens: list[int], dtype: torch.dtype):
    """Prefills in a pool of one layer, each with `context_len - query_len` tokens already cached before its queries."""
    hkv, hq, bs, d, num_blocks = 2, 6, 4, 16, 1200
    k, v = allocate_kv_pool(1, hkv, num_blocks, bs, d, dtype, torch.device("cpu"))
    k[0].normal_()
    v[0].normal_()
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in context_lens]
    width = max(map(len, tables))
    positions = [p for q, n in zip(query_lens, context_lens, strict=True) for p in range(n - q, n)]
    slots = [t[p // bs] * bs + p % bs for t, q, n in zip(tables, query_lens, context_lens, strict=True)
             for p in range(n - q, n)]
    tokens = len(positions)
    group = tb.PrefillGroup(query_lens, context_lens, torch.tensor([t + [0] * (width - len(t)) for t in tables]))
    batch = StepBatch(torch.zeros(tokens, dtype=torch.long), torch.tensor(positions), torch.tensor(slots), 0,
                      torch.tensor([], dtype=torch.long), torch.zeros(0, width, dtype=torch.long), 0, group,
                      torch.tensor([]))
    q, new_k, new_v = (torch.randn(tokens, width * d).to(dtype) for width in (hq, hkv, hkv))
    return tb.TorchAttention(k, v, hq), batch, (q, new_k, new_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefills_attended_one_by_one_equal_the_padded_batch(dtype, monkeypatch):
    """A whole prompt, a chunk after a short cached context (zero rows lead it) and a short query after a long one
    (masked), each attended on its own with the kernel's causal mask, against one padded, masked batch."""
    query_lens, context_lens = [300, 200, 12, 5], [300, 260, 400, 5]
    assert tb.causal_pays(query_lens, context_lens, 400)
    assert not tb.causal_pays([30] * 64, [30] * 64, 32)  # many short prompts: one batched call is cheaper
    attention, batch, (q, new_k, new_v) = prefill_batch(random.Random(3), query_lens, context_lens, dtype)
    monkeypatch.setattr(tb, "prefill_runs", lambda query_lens, context_lens: [(0, len(query_lens))])
    attention.begin_step(batch)
    [group] = attention.groups
    assert [(s.lead, s.mask is not None) for s in group.causal_spans] == [(0, False), (60, False), (0, True),
                                                                          (0, False)]
    one_by_one = attention.forward(0, q, new_k, new_v)
    monkeypatch.setattr(tb, "causal_pays", lambda *args: False)
    attention.begin_step(batch)
    assert [g.causal_spans for g in attention.groups] == [None]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(one_by_one, attention.forward(0, q, new_k, new_v), rtol=tolerance, atol=tolerance)
