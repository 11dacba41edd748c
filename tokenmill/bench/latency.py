"""`tokenmill bench latency`: requests one at a time (batch 1), each timed step by step from outside the engine:
time to first token, the gaps between the steps that gave it tokens (inter-token latency), time per output
token and end to end, with their percentiles. Prompts are random token ids, distinct per request (no
prefix-cache hits); outputs are forced to their length (EOS ignored)."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from engine.sampling_params import SamplingParams
from tokenmill.bench.throughput import random_prompt


@dataclass
class RequestTiming:
    ttft: float  # seconds from add_request to the step that gave the first token
    token_gaps: list[float]  # seconds between consecutive steps that gave tokens, after the first
    e2e: float
    num_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.num_tokens - 1, 1)


@dataclass
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float


def time_request(engine, prompt: list[int], params: SamplingParams) -> RequestTiming:
    """Run one request alone; every token the engine generates in a step belongs to it."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the latency benchmark needs an idle engine")
    stats = engine.stats
    before = produced = stats.generation_tokens
    stamps: list[float] = []
    started = time.perf_counter()
    engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error:
                raise ValueError(f"the request failed: {output.error}")
        if stats.generation_tokens > produced:
            stamps.append(time.perf_counter())
            produced = stats.generation_tokens
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    return RequestTiming(stamps[0] - started, gaps, stamps[-1] - started, produced - before)


def measure(engine, prompt_tokens: int, output_tokens: int, requests: int, warmup: int = 1,
            seed: int = 0) -> list[RequestTiming]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    prompts = [random_prompt(rng, prompt_tokens, engine.runner.vocab_size) for _ in range(warmup + requests)]
    timings = [time_request(engine, prompt, params) for prompt in prompts]
    return timings[warmup:]


def percentiles(values: list[float]) -> Percentiles:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Percentiles(float(np.mean(values)), float(p50), float(p90), float(p99))


def summarize(timings: list[RequestTiming]) -> dict[str, Percentiles]:
    return {
        "time to first token": percentiles([t.ttft for t in timings]),
        "inter-token latency": percentiles([gap for t in timings for gap in t.token_gaps]),
        "time per output token": percentiles([t.tpot for t in timings]),
        "end to end": percentiles([t.e2e for t in timings]),
    }


def to_json(timings: list[RequestTiming]) -> dict:
    return {"summary_seconds": {name: asdict(p) for name, p in summarize(timings).items()},
            "requests": [{**asdict(t), "tpot": t.tpot} for t in timings]}
