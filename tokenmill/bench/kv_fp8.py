"""`tokenmill bench kv-fp8`: the FP8 KV cache against the model's dtype: (a) blocks in the same KV memory, (b) greedy
agreement and the reference tokens' logprob gap on held-out prompts, (c) the CPU decode kernel's time over FP8 blocks
against bfloat16 (and float32) blocks."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Capacity:
    model_dtype: str
    cache: str
    blocks: int
    bytes_per_block: int


@dataclass
class Agreement:
    model_dtype: str
    prompts: int
    tokens: int
    same_prefix: int  # prompts whose first `tokens` greedy tokens equal the model-dtype cache's
    mean_gap: float  # mean |logprob| difference of the reference tokens, teacher-forced
    max_gap: float
    missing: int  # reference tokens outside FP8's top 20 (their logprob bounded by the 20th)
    first_divergence: list[int] = field(default_factory=list)
    reference: list[list[int]] = field(default_factory=list)  # the model-dtype cache's greedy tokens


def same_prefixes(rows: list[Agreement], first: str = "bfloat16", second: str = "float32") -> int | None:
    """Prompts whose greedy tokens are the same with the `first` model dtype as with the `second` (each with its own
    dtype's cache, no FP8): the scale for (b), the difference a model dtype alone makes."""
    by_dtype = {r.model_dtype: r.reference for r in rows}
    if first not in by_dtype or second not in by_dtype:
        return None
    return sum(a == b for a, b in zip(by_dtype[first], by_dtype[second], strict=True))


@dataclass
class KernelTime:
    query_dtype: str
    pool: str
    microseconds: float
    pool_bytes_read: int  # K and V bytes one call reads

    @property
    def gb_per_s(self) -> float:
        return self.pool_bytes_read / self.microseconds / 1e3


def engine(model_dir, dtype: str, cache: str, threads: int, memory: int, max_model_len: int):
    from engine import LLM

    return LLM(str(model_dir), dtype=dtype, kv_cache_dtype=cache, num_threads=threads, kv_cache_memory=memory,
               max_model_len=max_model_len, max_num_seqs=256)


def capacity(llm, dtype: str, cache: str) -> Capacity:
    plan = llm.engine.runner.kv_plan
    return Capacity(dtype, cache, plan.num_blocks, plan.bytes_per_block)


def greedy(llm, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[list[dict]]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=20)
    outputs = llm.generate(prompts, params)
    return ([o.outputs[0].token_ids for o in outputs],
            [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs])


def teacher_forced(llm, prompts: list[list[int]], reference: list[list[int]], own: list[list[int]],
                   own_logprobs: list[list[dict]]) -> list[list[float | None]]:
    """Each reference token's logprob under `llm`, given the prompt and the reference tokens before it: from its own
    greedy run up to where that run leaves the reference, then one 1-token request per later position (None where
    the token is not among the 20 most likely)."""
    from engine import SamplingParams

    out: list[list[float | None]] = []
    asks: list[tuple[int, int]] = []
    for index, (ref, mine, steps) in enumerate(zip(reference, own, own_logprobs, strict=True)):
        row: list[float | None] = []
        for position, token in enumerate(ref):
            if position == 0 or mine[:position] == ref[:position]:
                row.append(steps[position].get(token))
            else:
                row.append(None)
                asks.append((index, position))
        out.append(row)
    if asks:
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
        replies = llm.generate([prompts[i] + reference[i][:p] for i, p in asks], params)
        for (index, position), reply in zip(asks, replies, strict=True):
            out[index][position] = reply.outputs[0].logprobs[0].get(reference[index][position])
            if out[index][position] is not None:
                out[index][position] = out[index][position].logprob
    return out


def agreement(model_dir, prompts: list[list[int]], dtype: str, tokens: int, threads: int, memory: int,
              max_model_len: int) -> tuple[Agreement, list[Capacity]]:
    runs = {}
    capacities = []
    for cache in ("auto", "fp8"):
        llm = engine(model_dir, dtype, cache, threads, memory, max_model_len)
        capacities.append(capacity(llm, dtype, cache))
        ids, logprobs = greedy(llm, prompts, tokens)
        runs[cache] = (llm, ids, logprobs)
        if cache == "auto":
            del llm
            gc.collect()
    _, reference, reference_logprobs = runs["auto"]
    llm, ids, logprobs = runs["fp8"]
    forced = teacher_forced(llm, prompts, reference, ids, logprobs)
    gaps, missing = [], 0
    for ref, ref_steps, fp8_row in zip(reference, reference_logprobs, forced, strict=True):
        for position, token in enumerate(ref):
            value = fp8_row[position]
            if value is None:  # beyond the top 20: at most the 20th's logprob, so the gap is at least this
                missing += 1
                continue
            gaps.append(abs(ref_steps[position][token] - value))
    divergence = [next((i for i, (a, b) in enumerate(zip(r, f, strict=True)) if a != b), tokens)
                  for r, f in zip(reference, ids, strict=True)]
    result = Agreement(dtype, len(prompts), tokens, sum(d == tokens for d in divergence),
                       statistics.fmean(gaps) if gaps else 0.0, max(gaps, default=0.0), missing, divergence, reference)
    del llm, runs
    gc.collect()
    return result, capacities


def decode_kernel_call(query_dtype: torch.dtype, fp8: bool, seqs: int, context: int, kv_heads: int = 3,
                       group: int = 3, head_dim: int = 64, block_size: int = 16, seed: int = 0):
    """(a call of the C paged decode kernel over `seqs` sequences of `context` tokens each, their blocks scattered
    over a pool twice their size; the K and V bytes it reads)."""
    from engine.kernels import cpu_kernel
    from engine.kv_quant import quantize

    generator = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = 2 * seqs * per_seq + 1
    shape = (kv_heads, num_blocks, block_size, head_dim)
    scale = torch.full((kv_heads,), 0.02)
    pools = []
    for _ in range(2):
        values = torch.randn(shape, generator=generator)
        if fp8:
            pools.append(quantize(values.view(kv_heads, -1, head_dim).transpose(0, 1), scale).transpose(0, 1)
                         .reshape(shape).contiguous())
        else:
            pools.append(values.to(query_dtype))
    tables = (torch.randperm(num_blocks - 1, generator=generator)[:seqs * per_seq] + 1).view(seqs, per_seq).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, kv_heads * group * head_dim, generator=generator).to(query_dtype)
    kwargs = dict(k_scale=scale, v_scale=scale) if fp8 else {}

    def call() -> None:
        cpu_kernel.paged_decode(q, pools[0], pools[1], tables, lens, **kwargs)

    return call, 2 * seqs * context * kv_heads * head_dim * pools[0].element_size()


def time_decode_kernels(seqs: int, context: int, repeats: int) -> list[KernelTime]:
    """Queries in bfloat16 and float32, over blocks of their dtype and FP8: the calls interleaved round by round (so
    a busy moment of the machine hits all of them), the median of `repeats` rounds each, in microseconds."""
    setups = [(dtype, fp8, *decode_kernel_call(dtype, fp8, seqs, context))
              for dtype in (torch.bfloat16, torch.float32) for fp8 in (False, True)]
    times: list[list[float]] = [[] for _ in setups]
    for round_index in range(repeats + 3):  # 3 rounds of warm-up
        for index, (_, _, call, _) in enumerate(setups):
            started = time.perf_counter()
            call()
            if round_index >= 3:
                times[index].append(time.perf_counter() - started)
    return [KernelTime(str(dtype).removeprefix("torch."), "fp8 (e4m3)" if fp8 else "model dtype",
                       statistics.median(spent) * 1e6, read)
            for (dtype, fp8, _, read), spent in zip(setups, times, strict=True)]


def capacity_table(rows: list[Capacity]):
    from rich.table import Table

    table = Table(title="(a) KV blocks in the same KV memory")
    for column in ("model dtype", "KV cache", "blocks", "bytes/block", "vs bfloat16 cache"):
        table.add_column(column, justify="right")
    base = next((r.blocks for r in rows if r.model_dtype == "bfloat16" and r.cache == "auto"), None)
    for r in rows:
        ratio = f"{r.blocks / base:.2f}x" if base else "-"
        table.add_row(r.model_dtype, r.cache, str(r.blocks), f"{r.bytes_per_block:,}", ratio)
    return table


def agreement_table(rows: list[Agreement]):
    from rich.table import Table

    table = Table(title="(b) held-out prompts: FP8 cache against the model-dtype cache, greedy")
    for column in ("model dtype", "prompts", "first N tokens identical", "mean |logprob gap|/token",
                   "max gap", "ref tokens outside FP8's top 20", "median first divergence"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.model_dtype, str(r.prompts), f"{r.same_prefix}/{r.prompts} ({r.same_prefix / r.prompts:.0%}) "
                      f"at N={r.tokens}", f"{r.mean_gap:.4f}", f"{r.max_gap:.3f}", str(r.missing),
                      str(statistics.median(r.first_divergence)))
    return table


def kernel_table(rows: list[KernelTime], seqs: int, context: int):
    from rich.table import Table

    table = Table(title=f"(c) CPU paged decode kernel: {seqs} sequences x {context} tokens, 3 KV heads x 3 queries, "
                        "head dim 64, blocks of 16 scattered")
    for column in ("queries", "KV blocks", "µs/call", "KV GB/s read", "speed vs model-dtype blocks"):
        table.add_column(column, justify="right")
    base = {r.query_dtype: r.microseconds for r in rows if r.pool == "model dtype"}
    for r in rows:
        table.add_row(r.query_dtype, r.pool, f"{r.microseconds:.0f}", f"{r.gb_per_s:.1f}",
                      f"{base[r.query_dtype] / r.microseconds:.2f}x" if r.query_dtype in base else "-")
    return table
