"""`tokenmill bench swap`: swap against recompute preemption. Long prompts in a KV pool too small for them, so
running sequences are preempted over and over; recompute drops a victim's KV and prefills it again, swap copies it
to host memory and back. Same prompts, same greedy settings, one engine per mode."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.workload import PASSAGES

MODES = {"recompute": "recompute", "swap": "swap", "auto": None}  # bench name -> preemption_mode


@dataclass
class SwapResult:
    mode: str
    seconds: float
    generated_tokens: int
    prompt_tokens: int
    prefill_tokens: int  # tokens prefilled: the prompts, and again what recompute preemption recomputed
    preemptions: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def recomputed_tokens(self) -> int:
        return self.prefill_tokens - self.prompt_tokens


def long_prompts(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Distinct long prompts, lengths uniform in [min_tokens, max_tokens]: numbered notes made of the bench
    passages in an order of each prompt's own, under a heading that differs in the first block (no shared prefix)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        target = rng.randint(min_tokens, max_tokens)
        text = f"Document {index} of {num_prompts}. Summarise the notes below in three sentences.\n\n"
        note = 0
        while len(tokenizer.encode(text)) < target:
            order = rng.sample(PASSAGES, len(PASSAGES))
            for passage in order:
                note += 1
                text += f"Note {note}. {passage}\n"
        prompts.append(tokenizer.encode(text)[:target])
    return prompts


def pool_blocks(prompts: list[list[int]], max_tokens: int, resident: float, block_size: int = 16) -> int:
    """A KV pool holding about `resident` of these requests at their full length (and the null block)."""
    mean = sum(len(p) for p in prompts) / len(prompts) + max_tokens
    longest = max(len(p) for p in prompts) + max_tokens
    per_request = -(-int(mean) // block_size)
    return max(int(resident * per_request), -(-longest // block_size)) + 1


def run_mode(model_dir: Path, prompts: list[list[int]], max_tokens: int, mode: str, num_kv_blocks: int,
             dtype: str, threads: int, swap_space: float, enable_prefix_caching: bool,
             max_num_batched_tokens: int) -> SwapResult:
    """One engine with `preemption_mode` MODES[mode]; a short warm-up first, then every prompt at once, timed."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, num_threads=threads, num_kv_blocks=num_kv_blocks,
              preemption_mode=MODES[mode], swap_space=swap_space, enable_prefix_caching=enable_prefix_caching,
              max_num_batched_tokens=max_num_batched_tokens)
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, temperature=0))
    before = llm.engine.get_stats().snapshot()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    after = llm.engine.get_stats().snapshot()

    def moved(key: str) -> int:
        return after[key] - before[key]

    return SwapResult(mode, seconds, moved("generation_tokens"), sum(map(len, prompts)),
                      moved("computed_prefill_tokens"), moved("num_preemptions"), moved("kv_blocks_swapped_out"),
                      moved("kv_blocks_swapped_in"), [list(o.outputs[0].token_ids) for o in outputs])


def swap_table(results: list[SwapResult], title: str):
    from rich.table import Table

    table = Table("preemption", "seconds", "generated tok/s", "x recompute", "preemptions", "recomputed tokens",
                  "blocks swapped out", "blocks swapped in", "identical to recompute", title=title)
    reference = next((r for r in results if r.mode == "recompute"), None)
    for r in results:
        speedup = f"{reference.seconds / r.seconds:.2f}x" if reference and r.seconds else "-"
        same = "-"
        if reference is not None:
            same = f"{sum(a == b for a, b in zip(r.output_token_ids, reference.output_token_ids, strict=True))}/" \
                   f"{len(r.output_token_ids)}"
        table.add_row(r.mode, f"{r.seconds:.1f}", f"{r.tokens_per_second:.1f}", speedup, str(r.preemptions),
                      f"{r.recomputed_tokens:,}", f"{r.blocks_swapped_out:,}", f"{r.blocks_swapped_in:,}", same)
    return table
