"""Runs inside vLLM's own virtualenv (see ops/vllm_venv.sh), started by tokenmill/bench/vllm_compare.py:
`python vllm_worker.py SPEC.json RESULT.json`. Imports only vLLM and the standard library.

SPEC: model (a Hugging Face directory), dtype, max_model_len, enable_prefix_caching, prompts (token
ids), output_lens, batch1_prompt and batch1_tokens; optionally lora: adapters (PEFT directories),
prompt_adapters (each prompt's index into adapters, or null for the base model), max_loras and
max_lora_rank. RESULT: seconds for the whole workload, and the batch-1 time per output token."""

import json
import sys
import time


def timed_generate(llm, prompts, lengths, lora_requests=None):
    from vllm import SamplingParams, TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
    started = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests)
    seconds = time.perf_counter() - started
    for out, n in zip(outputs, lengths, strict=True):
        if len(out.outputs[0].token_ids) != n:
            raise RuntimeError(f"vLLM generated {len(out.outputs[0].token_ids)} tokens, expected {n}")
    return seconds, [list(out.outputs[0].token_ids) for out in outputs]


def batch1_tpot(llm, prompt, tokens, repeats=3):
    """(time of `tokens` tokens - time of 1 token) / (tokens - 1), best of `repeats`: decode steps alone."""
    best = float("inf")
    for _ in range(repeats):
        one, _ = timed_generate(llm, [prompt], [1])
        many, _ = timed_generate(llm, [prompt], [tokens])
        best = min(best, (many - one) / (tokens - 1))
    return best


def lora_requests(lora):
    """Each prompt's LoRARequest (None: the base model), and one request per adapter for the warm-up."""
    from vllm.lora.request import LoRARequest

    adapters = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(lora["adapters"])]
    return [None if i is None else adapters[i] for i in lora["prompt_adapters"]], adapters


def main(spec_path, result_path):
    from vllm import LLM

    with open(spec_path) as f:
        spec = json.load(f)
    lora = spec.get("lora")
    lora_options = {}
    if lora:
        lora_options = dict(enable_lora=True, max_loras=lora["max_loras"], max_lora_rank=lora["max_lora_rank"])
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=spec["enable_prefix_caching"], seed=0, **lora_options)
    startup = time.perf_counter() - started
    if lora:  # the warm-up loads every adapter, as tokenmill's does
        per_prompt, adapters = lora_requests(lora)
        timed_generate(llm, spec["prompts"][:1] * len(adapters), [2] * len(adapters), adapters)
    else:
        per_prompt = None
        timed_generate(llm, spec["prompts"][:2], [2, 2])  # warm-up
    llm.reset_prefix_cache()
    seconds, tokens = timed_generate(llm, spec["prompts"], spec["output_lens"], per_prompt)
    result = {"seconds": seconds, "startup_seconds": startup, "output_token_ids": tokens}
    if spec.get("batch1_tokens"):
        result["batch1_tpot"] = batch1_tpot(llm, spec["batch1_prompt"], spec["batch1_tokens"])
    import vllm

    result["version"] = vllm.__version__
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine core: LLM(...) must not run at import time
    main(sys.argv[1], sys.argv[2])
