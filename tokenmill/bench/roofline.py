"""`bench roofline`: how far a run of the engine is from the floor this machine sets for it.

A workload runs through tokenmill's engine and every step is recorded: its prompt (prefill) and decode tokens, the
rows through the LM head, the KV tokens its attention reads, and its time. The floor of a step is a roofline:

    step floor = max(GEMM FLOPs / peak FLOP rate, (weight bytes + KV bytes read) / stream bandwidth)

GEMM FLOPs are the dense matmuls' (2 x every layer weight for each token of the step, 2 x the LM head for each
sampled row) at the fastest FLOP rate `bench peak` measures here (its limit's step of the model's own matmuls, each
shape, or the square 2048 matmul, whichever is fastest: the limit alone is beaten by prefill steps); the
weights are read once a step (the LM head only when a row is sampled); the KV read is every scheduled sequence's
context, its new tokens included, once: 2 (K and V) x layers x KV heads x head dim x the cache's element bytes
per token. The bandwidth is measured as STREAM measures it: copy, scale, add and triad over arrays several times
the caches, best of several repeats, on torch's threads; the floor takes the fastest of the four. Attention's
own FLOPs, norms, sampling and scheduling are left out, so the floor is a lower bound no run reaches.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tokenmill.bench.throughput import best_time
from tokenmill.bench.workload import Workload

PHASES = ("prefill", "decode")
STREAM_ELEMENT = torch.float64  # STREAM's arrays are doubles
STREAM_MIN_BYTES = 64 << 20


@dataclass
class StepRecord:
    """One engine step as the roofline sees it."""

    prefill_tokens: int  # prompt (or recomputed) tokens run through the model
    decode_tokens: int  # sequences that run one generated token
    sampled: int  # rows through the LM head
    kv_tokens_read: int  # KV tokens attention reads: each sequence's context, its new tokens included
    seconds: float = 0.0  # the engine's step time (EngineStats.step_times)

    @property
    def phase(self) -> str:
        """A step with any prompt tokens is a prefill step (with the decode rows it carries)."""
        return "prefill" if self.prefill_tokens else "decode"

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True)
class Roofline:
    """The model's costs per token and step, and this machine's limits."""

    layer_flops_per_token: float  # 2 x every layer's dense weights (fused QKV, O, gate/up, down)
    head_flops_per_token: float  # 2 x the LM head, per sampled row
    layer_weight_bytes: int
    head_weight_bytes: int
    kv_bytes_per_token: int  # 2 x layers x KV heads x head dim x the cache's element bytes
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s

    def parts(self, step: StepRecord) -> tuple[float, float, float]:
        """(GEMM seconds at peak, weights-read seconds, KV-read seconds) of one step."""
        flops = step.tokens * self.layer_flops_per_token + step.sampled * self.head_flops_per_token
        weights = self.layer_weight_bytes + (self.head_weight_bytes if step.sampled else 0)
        return (flops / self.peak_flops, weights / self.bandwidth,
                step.kv_tokens_read * self.kv_bytes_per_token / self.bandwidth)

    def floor(self, step: StepRecord) -> float:
        gemm, weights, kv = self.parts(step)
        return max(gemm, weights + kv)

    def raised_to(self, steps: list[StepRecord]) -> tuple[Roofline, list[str]]:
        """These limits, raised to any rate a step of the run itself reached (a limit measured on a busy machine
        comes out low, and a floor above the measured time says nothing), with what was raised."""
        timed = [step for step in steps if step.seconds > 0]
        flops = max((self.parts(s)[0] * self.peak_flops / s.seconds for s in timed), default=0.0)
        moved = max(((self.parts(s)[1] + self.parts(s)[2]) * self.bandwidth / s.seconds for s in timed), default=0.0)
        raised = []
        if flops > self.peak_flops:
            raised.append(f"GEMM peak raised to {flops / 1e9:.1f} GFLOP/s, a step of the run's own")
        if moved > self.bandwidth:
            raised.append(f"bandwidth raised to {moved / 1e9:.1f} GB/s, a step of the run's own")
        return replace(self, peak_flops=max(flops, self.peak_flops), bandwidth=max(moved, self.bandwidth)), raised


@dataclass
class PhaseFloor:
    phase: str
    steps: int = 0
    tokens: int = 0
    gemm_s: float = 0.0
    weights_s: float = 0.0
    kv_s: float = 0.0
    floor_s: float = 0.0
    measured_s: float = 0.0

    @property
    def share(self) -> float:
        """The floor as a share of the measured time (1.0: the run is at its floor)."""
        return self.floor_s / self.measured_s if self.measured_s else 0.0


def phase_floors(steps: list[StepRecord], roofline: Roofline, wall_seconds: float | None = None) -> list[PhaseFloor]:
    """Prefill, decode and total: each part summed over the phase's steps, the floor summed step by step (so it is
    at least the larger of the summed parts' sides, not their maximum). The total's measured time is
    `wall_seconds` when given (the whole run, what lies between steps too), else the steps' time."""
    rows = {phase: PhaseFloor(phase) for phase in (*PHASES, "total")}
    for step in steps:
        gemm, weights, kv = roofline.parts(step)
        for row in (rows[step.phase], rows["total"]):
            row.steps += 1
            row.tokens += step.tokens
            row.gemm_s += gemm
            row.weights_s += weights
            row.kv_s += kv
            row.floor_s += max(gemm, weights + kv)
            row.measured_s += step.seconds
    if wall_seconds is not None:
        rows["total"].measured_s = wall_seconds
    return list(rows.values())


# ---- the machine: STREAM bandwidth ---------------------------------------------------------------------------

@dataclass
class Stream:
    array_bytes: int
    rates: dict[str, float] = field(default_factory=dict)  # kernel -> bytes/s, STREAM's counting

    @property
    def best(self) -> float:
        return max(self.rates.values())


def cache_bytes() -> int:
    """The CPU caches of all cores together (each shared cache once), from sysfs; 0 where it cannot be read."""
    seen, total = set(), 0
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            size = (index / "size").read_text().strip()
            key = ((index / "level").read_text().strip(), (index / "type").read_text().strip(),
                   (index / "shared_cpu_list").read_text().strip())
        except OSError:
            continue
        if key in seen or not size[:-1].isdigit():
            continue
        seen.add(key)
        total += int(size[:-1]) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
    return total


def stream_array_bytes() -> int:
    """STREAM's rule: each array at least 4x the caches together (here at least 64 MiB), whole MiB."""
    need = max(4 * cache_bytes(), STREAM_MIN_BYTES)
    return -(-need // (1 << 20)) << 20


def stream_bandwidth(array_bytes: int | None = None, repeats: int = 10) -> Stream:
    """STREAM's four kernels over three float64 arrays of `array_bytes` each, torch ops on torch's threads; bytes
    counted as STREAM counts them (copy and scale 2 arrays, add and triad 3, no write-allocate traffic), each
    kernel's best of `repeats`."""
    array_bytes = array_bytes or stream_array_bytes()
    n = array_bytes // STREAM_ELEMENT.itemsize
    a, b, c = (torch.full((n,), value, dtype=STREAM_ELEMENT) for value in (1.0, 2.0, 0.0))
    q = 3.0
    kernels = {"copy": (lambda: c.copy_(a), 2), "scale": (lambda: torch.mul(c, q, out=b), 2),
               "add": (lambda: torch.add(a, b, out=c), 3), "triad": (lambda: torch.add(b, c, alpha=q, out=a), 3)}
    stream = Stream(n * STREAM_ELEMENT.itemsize)
    with torch.inference_mode():
        for name, (kernel, arrays) in kernels.items():
            stream.rates[name] = arrays * stream.array_bytes / best_time(kernel, repeats)
    return stream  # the arrays go with the frame


def gemm_peak(peak) -> tuple[float, str]:
    """The fastest FLOP rate `bench peak` measured (a `peak.Peak`), and where: its limit (a step of the model's
    matmuls at its best batch), one of the model's shapes at some batch, or the square 2048 matmul. The limit alone
    is no floor: its batches are decode's (16-256 rows), and a prefill step of a few hundred rows beats it."""
    rates = {f"the limit's step at {peak.limit_rows} rows": peak.limit * peak.flops_per_token,
             "a square 2048 matmul": peak.square_gflops * 1e9}
    for name, _, _, by_rows in peak.shapes:
        for rows, gflops in by_rows.items():
            rates[f"{name} at {rows} rows"] = gflops * 1e9
    where = max(rates, key=rates.get)
    return rates[where], where


# ---- the model's costs ---------------------------------------------------------------------------------------

def kv_bytes_per_token(model_dir, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) x layers x KV heads x head dim x element bytes (1 for the FP8 cache)."""
    from engine.hf_files import load_config
    from engine.memory_plan import kv_bytes_per_block
    from engine.models.llama import head_dim_of
    from tokenmill.bench.throughput import DTYPES

    config = load_config(model_dir)
    element = DTYPES[dtype].itemsize if kv_cache_dtype == "auto" else 1
    return kv_bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, 1, head_dim_of(config), element)


def roofline_for(model_dir, dtype: str, kv_cache_dtype: str, peak_flops: float, bandwidth: float) -> Roofline:
    from tokenmill.bench.throughput import load_dense_weights

    weights = load_dense_weights(model_dir, dtype)
    head = weights.lm_head
    head_bytes = head.numel() * head.element_size()
    return Roofline(weights.flops_per_token - 2 * head.numel(), 2 * head.numel(), weights.num_bytes - head_bytes,
                    head_bytes, kv_bytes_per_token(model_dir, dtype, kv_cache_dtype), peak_flops, bandwidth)


# ---- the run -------------------------------------------------------------------------------------------------

@dataclass
class RecordedRun:
    steps: list[StepRecord]
    wall_seconds: float  # llm.generate's, the steps and what lies between them
    num_prompts: int
    output_tokens: int


def record_run(model: str, workload: Workload, dtype: str, **engine_kwargs) -> RecordedRun:
    """The workload through tokenmill's engine (warmed up, prefix cache emptied, lengths forced with EOS ignored,
    as `bench throughput` runs it), every step recorded: what the runner got (the scheduler's plan, before the
    sequences' counts move on) and the step's time (a step observer reading EngineStats)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, **engine_kwargs)
    engine = llm.engine
    llm.generate(workload.prompts[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    engine.kv_manager.pool.reset_prefix_cache()
    steps: list[StepRecord] = []
    execute, stats, counted = engine.runner.execute, engine.stats, [engine.stats.num_steps]

    def recording_execute(plan):
        prefill = decode = kv = 0
        for s in plan.scheduled:
            if s.num_new_tokens == 1 and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens:
                decode += 1
            else:
                prefill += s.num_new_tokens
            kv += s.seq.num_computed_tokens + s.num_new_tokens
        steps.append(StepRecord(prefill, decode, sum(1 for s in plan.scheduled if s.sample), kv))
        return execute(plan)

    def observe(_outputs) -> None:
        if stats.num_steps > counted[0]:  # a step that ran (an empty plan records no time)
            counted[0] = stats.num_steps
            steps[-1].seconds = stats.step_times[-1]

    engine.runner.execute = recording_execute
    engine.step_observers.append(observe)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    try:
        started = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        wall = time.perf_counter() - started
    finally:
        engine.runner.execute = execute
        engine.step_observers.remove(observe)
    for out, length in zip(outputs, workload.output_lens, strict=True):
        if len(out.outputs[0].token_ids) != length:
            raise RuntimeError(f"tokenmill generated {len(out.outputs[0].token_ids)} tokens, expected {length}")
    del llm, engine
    gc.collect()
    return RecordedRun(steps, wall, len(workload.prompts), workload.useful_tokens)


# ---- the table -----------------------------------------------------------------------------------------------

CAPTION = ("Roofline per step: floor = max(GEMM FLOPs / peak, (weights + KV read) / stream bandwidth), summed over "
           "the steps. GEMM FLOPs: 2 x the layers' dense weights per token, 2 x the LM head per sampled row, at "
           "the fastest rate `bench peak` measured; "
           "weights read once a step; KV read: every scheduled sequence's context once, {kv} bytes a token. A step "
           "with prompt tokens is a prefill step. Measured: the engine's step times; total: llm.generate's wall "
           "time. % of floor = floor / measured. Attention FLOPs, norms, sampling and scheduling are not in the "
           "floor.")


def roofline_table(rows: list[PhaseFloor], roofline: Roofline, title: str):
    from rich.table import Table

    table = Table("phase", "steps", "tokens", "GEMM s at peak", "weights-read s", "KV-read s", "floor s",
                  "measured s", "% of floor", title=title,
                  caption=CAPTION.format(kv=f"{roofline.kv_bytes_per_token:,}"))
    for row in rows:
        table.add_row(row.phase, f"{row.steps:,}", f"{row.tokens:,}",
                      *[f"{seconds:.4g}" for seconds in (row.gemm_s, row.weights_s, row.kv_s, row.floor_s,
                                                         row.measured_s)], f"{100 * row.share:.1f}%")
    return table


def stream_line(stream: Stream) -> str:
    rates = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in stream.rates.items())
    return (f"stream bandwidth: {stream.best / 1e9:.1f} GB/s (the best of STREAM's {rates} GB/s; 3 float64 arrays "
            f"of {stream.array_bytes >> 20} MiB, {torch.get_num_threads()} threads)")
