"""`tokenmill bench spec`: speculative decoding against none, and Hugging Face's prompt lookup against its
greedy decoding, in one run."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from tokenmill.bench.workload import Workload


@dataclass
class SpecResult:
    scenario: str
    system: str
    seconds: float
    tokens: int
    acceptance: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def tokenmill_spec(model: str, workload: Workload, scenario: str, label: str, speculative_config: dict | None,
                   one_at_a_time: bool, ignore_eos: bool, **engine_kwargs) -> tuple[SpecResult, list[list[int]]]:
    """Greedy generation of the workload; one request at a time or all at once."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=speculative_config, **engine_kwargs)
    llm.generate(workload.prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos) for n in workload.output_lens]
    started = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([p], [sp])[0] for p, sp in zip(workload.prompts, params, strict=True)]
    else:
        outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - started
    tokens = [o.outputs[0].token_ids for o in outputs]
    spec = llm.engine.spec
    acceptance = spec.stats.acceptance_rate if spec else None
    del llm
    gc.collect()
    return SpecResult(scenario, label, seconds, sum(map(len, tokens)), acceptance), tokens


def hf_one_at_a_time(model_dir, workload: Workload, scenario: str, prompt_lookup: int | None) -> SpecResult:
    """transformers' greedy generate, one request at a time, with or without prompt-lookup decoding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt, length in zip(workload.prompts, workload.output_lens, strict=True):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=length, do_sample=False, **extra)
            tokens += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - started
    del model
    gc.collect()
    label = f"HF prompt lookup ({prompt_lookup} tokens)" if prompt_lookup else "HF greedy"
    return SpecResult(scenario, label, seconds, tokens)
