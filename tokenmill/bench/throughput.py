"""`tokenmill bench throughput`: one workload through Hugging Face static batching, Hugging Face
continuous batching and tokenmill, in one process, plus the dense-matmul floor of that workload."""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.bench.workload import Workload

log = logging.getLogger("tokenmill.bench")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    system: str
    dtype: str
    seconds: float
    useful_tokens: int
    note: str = ""
    prefill_tokens: int | None = None  # prompt tokens actually run through the model (tokenmill only)
    preemptions: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds


@dataclass
class StepShape:
    num_tokens: int  # rows of every dense matmul in the step
    num_sampled: int  # rows of the LM head


@dataclass
class RequestLatency:
    ttft: float  # seconds from arrival to the first token
    tpot: float | None  # seconds per output token after the first (None with one token)


@dataclass
class TokenmillRun:
    result: Result
    steps: list[StepShape] = field(default_factory=list)
    latencies: list[RequestLatency] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)


def load_hf_model(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def hf_static(model_dir, workload: Workload, dtype: str, batch_size: int = 16) -> Result:
    """Padded batches in input order; each batch runs until its longest request is done."""
    model = load_hf_model(model_dir, DTYPES[dtype])
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[first:first + batch_size]
            steps = max(workload.output_lens[first:first + batch_size])
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, pad_token_id=pad)
            if out.shape[1] - width != steps:
                raise RuntimeError(f"HF static generated {out.shape[1] - width} tokens, expected {steps}")
    seconds = time.perf_counter() - started
    del model
    gc.collect()
    return Result("HF static batching", dtype, seconds, workload.useful_tokens, f"padded batches of {batch_size}")


HF_KV_MEMORY_SHARE = 0.2
HF_PAGE_SIZE = 256


def hf_cache_blocks(model_config, workload: Workload, dtype: str) -> int:
    """KV blocks for every request of the workload at once, but at most HF_KV_MEMORY_SHARE of the machine's memory.
    Left to itself, HF sizes its cache on a CPU to a share of (total memory - its own RSS), whatever other processes
    hold: 4.6 GB for a 6-prompt workload, which on a loaded machine thrashed the page cache for minutes."""
    from engine.memory_plan import kv_bytes_per_block
    from engine.models.llama import head_dim_of

    need = sum(math.ceil((len(prompt) + length) / HF_PAGE_SIZE)
               for prompt, length in zip(workload.prompts, workload.output_lens, strict=True))
    block_bytes = kv_bytes_per_block(model_config.num_hidden_layers, model_config.num_key_value_heads, HF_PAGE_SIZE,
                                     head_dim_of(model_config), DTYPES[dtype].itemsize)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(need, int(memory * HF_KV_MEMORY_SHARE) // block_bytes))


def hf_continuous(model_dir, workload: Workload, dtype: str) -> Result:
    """transformers' own continuous batching (`init_continuous_batching`), per-request lengths, EOS off, its KV
    cache sized by `hf_cache_blocks`."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load_hf_model(model_dir, DTYPES[dtype])
    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                              pad_token_id=model.generation_config.pad_token_id)
    cache = ContinuousBatchingConfig(page_size=HF_PAGE_SIZE,
                                     num_blocks=hf_cache_blocks(model.config, workload, dtype))
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cache)
    manager.warmup()
    manager.start()
    started = time.perf_counter()
    try:
        for index, (prompt, length) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=length, eos_token_id=-1)
        done: dict[str, int] = {}
        while len(done) < len(workload.prompts):
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing")
                continue
            if result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=10)
    for index, length in enumerate(workload.output_lens):
        if done[f"r{index}"] != length:
            raise RuntimeError(f"HF continuous batching gave request {index} {done[f'r{index}']} tokens, not {length}")
    del manager, model
    gc.collect()
    return Result("HF continuous batching", dtype, seconds, workload.useful_tokens, "init_continuous_batching")


def tokenmill_run(model: str, workload: Workload, dtype: str, label: str = "tokenmill", structured=None,
                  **engine_kwargs) -> TokenmillRun:
    """`structured` (StructuredOutputsParams) constrains every request, e.g. to a JSON schema."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, **engine_kwargs)
    steps: list[StepShape] = []
    runner = llm.engine.runner
    execute = runner.execute

    def recording_execute(plan):
        steps.append(StepShape(plan.num_batched_tokens, sum(1 for s in plan.scheduled if s.sample)))
        return execute(plan)

    llm.generate(workload.prompts[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    llm.engine.kv_manager.pool.reset_prefix_cache()
    before = llm.engine.get_stats().snapshot()
    ranks = llm.engine.ranks
    reduce_before, calls_before, send_before = ((ranks.group.all_reduce_seconds, ranks.group.all_reduce_calls,
                                                 ranks.group.send_seconds) if ranks else (0, 0, 0))
    runner.execute = recording_execute
    mask_seconds = [0.0]
    if structured is not None:  # compiled before the clock starts, as a job's _prepare does
        llm.engine.structured.compile(structured)
        mask = llm.engine.structured.mask

        def timed_mask(logits, layout):
            begun = time.perf_counter()
            masked = mask(logits, layout)
            mask_seconds[0] += time.perf_counter() - begun
            return masked

        llm.engine.structured.mask = timed_mask
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, structured_outputs=structured)
              for n in workload.output_lens]
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - started
    runner.execute = execute
    for out, length in zip(outputs, workload.output_lens, strict=True):
        if len(out.outputs[0].token_ids) != length:
            raise RuntimeError(f"tokenmill generated {len(out.outputs[0].token_ids)} tokens, expected {length}")
    stats = llm.engine.get_stats().snapshot()
    prefill = stats["computed_prefill_tokens"] - before["computed_prefill_tokens"]
    preemptions = stats["num_preemptions"] - before["num_preemptions"]
    note = f"{len(steps)} steps, {preemptions} preemptions"
    if llm.engine.ranks is not None:  # rank 0's all-reduce time (waits for the slowest rank included)
        group = llm.engine.ranks.group
        step_seconds = stats["step_time_total"] - before["step_time_total"]
        note += (f", all-reduce {(group.all_reduce_seconds - reduce_before) / step_seconds:.1%} of step time "
                 f"({group.all_reduce_calls - calls_before} calls), step broadcast "
                 f"{(group.send_seconds - send_before) / step_seconds:.1%}")
        llm.engine.shutdown()
    if structured is not None:
        note += f", masks {mask_seconds[0]:.1f} s ({mask_seconds[0] / seconds:.1%})"
    del llm
    gc.collect()
    return TokenmillRun(Result(label, dtype, seconds, workload.useful_tokens, note, prefill, preemptions), steps,
                        [request_latency(out) for out in outputs], [list(o.outputs[0].token_ids) for o in outputs])


def request_latency(output) -> RequestLatency:
    metrics, num_tokens = output.metrics, len(output.outputs[0].token_ids)
    decode_seconds = metrics.finish_time - metrics.first_token_time
    return RequestLatency(metrics.time_to_first_token, decode_seconds / (num_tokens - 1) if num_tokens > 1 else None)


def dense_pass(matrices: list[list[torch.Tensor]], lm_head: torch.Tensor, x: torch.Tensor, h: torch.Tensor,
               head_in: torch.Tensor | None) -> None:
    for qkv, o, gate_up, down in matrices:
        F.linear(x, qkv)
        F.linear(x, o)
        F.linear(x, gate_up)
        F.linear(h, down)
    if head_in is not None:
        F.linear(head_in, lm_head)


@dataclass
class DenseWeights:
    """A model's dense matrices: per layer fused QKV, O, fused gate/up and down; and the LM head."""

    matrices: list[list[torch.Tensor]]
    lm_head: torch.Tensor

    def all(self) -> list[torch.Tensor]:
        return [m for layer in self.matrices for m in layer] + [self.lm_head]

    @property
    def num_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.all())

    @property
    def flops_per_token(self) -> int:
        return 2 * sum(m.numel() for m in self.all())


def load_dense_weights(model_dir, dtype: str) -> DenseWeights:
    from safetensors import safe_open

    torch_dtype = DTYPES[dtype]
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(torch_dtype)
    layers = sorted({int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")})
    matrices = []
    for i in layers:
        p = f"model.layers.{i}."
        matrices.append([
            torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            weights[p + "self_attn.o_proj.weight"],
            torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]),
            weights[p + "mlp.down_proj.weight"],
        ])
    return DenseWeights(matrices, weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))


def best_time(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def time_dense_pass(weights: DenseWeights, rows: int, sampled: int, repeats: int = 2) -> float:
    """Seconds of one step's dense matmuls with `rows` tokens, `sampled` of them through the LM head."""
    dtype = weights.lm_head.dtype
    hidden, inter = weights.lm_head.shape[1], weights.matrices[0][3].shape[1]
    with torch.inference_mode():
        x = torch.randn(rows, hidden, dtype=dtype)
        h = torch.randn(rows, inter, dtype=dtype)
        head_in = x[:sampled] if sampled else None
        return best_time(lambda: dense_pass(weights.matrices, weights.lm_head, x, h, head_in), repeats)


def dense_matmul_floor(model_dir, steps: list[StepShape], dtype: str, repeats: int = 2) -> Result:
    """Time of the model's dense matmuls alone (fused QKV, O, gate/up, down for every layer, and the LM
    head for the sampled rows) at each step's batch size, summed over the steps."""
    weights = load_dense_weights(model_dir, dtype)
    timings = {shape: time_dense_pass(weights, *shape, repeats=repeats)
               for shape in {(s.num_tokens, s.num_sampled) for s in steps}}
    seconds = sum(timings[(s.num_tokens, s.num_sampled)] for s in steps)
    useful = sum(s.num_sampled for s in steps)
    return Result("dense matmul floor", dtype, seconds, useful, "tokenmill's schedule, matmuls only")


# ---- throughput against concurrency, under the roofline ----------------------------------------------------

@dataclass
class ConcurrencyPoint:
    batch: int
    decode_tokens_per_s: float  # tokenmill, decode-only steps with `batch` sequences running
    matmul_tokens_per_s: float  # the dense matmuls alone at this batch
    compute_roof: float  # peak matmul FLOP/s over FLOPs per token
    memory_roof: float  # reading every weight once per step at the measured copy bandwidth

    @property
    def roof(self) -> float:
        return min(self.compute_roof, self.memory_roof)


def matmul_peak_flops(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    a, b = (torch.randn(size, size, dtype=DTYPES[dtype]) for _ in range(2))
    with torch.inference_mode():
        return 2 * size**3 / best_time(lambda: a @ b, repeats)


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write)."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src), repeats)


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Random token ids (clear of the low ids where special tokens live): no two prompts share a prefix."""
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def decode_rate(engine, batch: int, prompt_tokens: int, output_tokens: int) -> float:
    """Generated tokens per second over the decode-only steps of `batch` requests run together."""
    from engine import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"sweep-{batch}-{i}", random_prompt(rng, prompt_tokens, engine.runner.vocab_size), params)
    stats, seconds, tokens = engine.stats, 0.0, 0
    while engine.has_unfinished_requests():
        prefill_before, generated_before = stats.computed_prefill_tokens, stats.generation_tokens
        engine.step()
        if stats.computed_prefill_tokens == prefill_before:
            seconds += stats.step_times[-1]
            tokens += stats.generation_tokens - generated_before
    if not tokens:
        raise ValueError("no decode steps: the sweep needs at least 2 output tokens per request")
    return tokens / seconds


def concurrency_sweep(model_dir, dtype: str, batch_sizes: list[int], prompt_tokens: int, output_tokens: int,
                      **engine_kwargs) -> list[ConcurrencyPoint]:
    """tokenmill's decode throughput at each batch size beside the dense-matmul floor and the roofline."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, max_num_seqs=max(batch_sizes), **engine_kwargs)
    llm.generate([[100] * prompt_tokens], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    decode = {batch: decode_rate(llm.engine, batch, prompt_tokens, output_tokens) for batch in batch_sizes}
    del llm
    gc.collect()
    weights = load_dense_weights(model_dir, dtype)
    peak, bandwidth = matmul_peak_flops(dtype), copy_bandwidth()
    return [ConcurrencyPoint(batch, decode[batch], batch / time_dense_pass(weights, batch, batch),
                             peak / weights.flops_per_token, batch * bandwidth / weights.num_bytes)
            for batch in batch_sizes]
