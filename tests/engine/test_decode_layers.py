"""The decoder layers in one C call (cpu_kernel.DecodeLayers) give the same bits as the model's Python loop over the
same kernels, on the real model: token ids and logprobs for plain decodes in bfloat16, and in batch-invariant mode
(every token, prefill included, through the decode kernel) for the self-speculative draft in bfloat16 (its leading
layers only, beside the target's verify steps) and for float32. Speculation runs batch-invariant here: its
adaptive control makes the batches, so the bfloat16 logprobs, differ between two runs of either path otherwise."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_gemm
from tests.engine.cpu_flags import amx_expected, avx512_expected

PROMPTS = ["The three primary colors are red, yellow and", "Write a haiku about the sea at night.",
           "one two three four five six, one two three four five six, one two"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True, logprobs=2)
CASES = {
    "bfloat16": dict(dtype="bfloat16"),
    "bfloat16, batch-invariant, self-speculative draft": dict(
        dtype="bfloat16", batch_invariant=True,
        speculative_config={"method": "self", "num_speculative_tokens": 2, "draft_layers": 8}),
    "float32, batch-invariant": dict(dtype="float32", batch_invariant=True),
}


def own_gemm_runs(dtype: torch.dtype) -> bool:
    """From the CPU's flags: bfloat16 on AMX or avx512_bf16, float32 on avx512f."""
    return (dtype == torch.bfloat16 and amx_expected()) or avx512_expected(dtype)


@pytest.fixture(scope="module", params=CASES)
def case_llm(request, model_dir):
    """(case, its LLM), built once for both tests of the case."""
    kwargs = CASES[request.param]
    with pytest.MonkeyPatch.context() as patch:
        if kwargs["dtype"] == "float32" and avx512_expected(torch.float32):
            patch.setenv("TOKENMILL_FLOAT32_GEMM", "avx512")  # not the timed choice: every projection on ours
        return request.param, LLM(str(model_dir), num_threads=2, max_model_len=256, kv_cache_memory=96 << 20,
                                  **kwargs)


def results(llm, salt: str) -> list:
    outputs = llm.generate(PROMPTS * 2, [GREEDY] * 3 + [SEEDED] * 3, cache_salt=salt)
    return [(o.outputs[0].token_ids, [{t: (lp.logprob, lp.rank) for t, lp in step.items()}
                                      for step in o.outputs[0].logprobs]) for o in outputs]


def test_the_one_call_is_built_exactly_where_our_gemm_kernels_run_the_dtype(case_llm):
    """Elsewhere (e.g. an AVX2 CPU) the Python loop runs."""
    case, llm = case_llm
    dtype = getattr(torch, CASES[case]["dtype"])
    assert (llm.engine.runner.model.decode_layers is not None) == own_gemm_runs(dtype)


def test_one_call_layers_give_the_python_loops_bits(case_llm):
    case, llm = case_llm
    model = llm.engine.runner.model
    if model.decode_layers is None:  # checked above: none of our GEMM kernels runs this dtype
        pytest.skip(f"no GEMM kernel of ours runs {CASES[case]['dtype']} on this CPU: no one-call layers")
    calls = {"tokens": 0}
    run = model.decode_layers.run

    def counted(residual, *args, **kwargs):
        calls["tokens"] += residual.shape[0]
        return run(residual, *args, **kwargs)

    model.decode_layers.run = counted
    one_call = results(llm, "one-call")
    # most decode steps took the one call (with speculation: the draft's, the target verifying in Python)
    assert calls["tokens"] >= (20 if "speculative" in case else len(PROMPTS) * 2 * 10)
    if "invariant" in case:
        assert calls["tokens"] >= sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS)  # prefills too
    model.decode_layers = None
    assert results(llm, "python-loop") == one_call
    assert all(len(tokens) == 12 for tokens, _ in one_call)


@pytest.mark.skipif(not amx_expected(), reason="no AMX on this CPU: the row limit exists for the AMX kernel only")
def test_the_one_call_stops_where_amx_hands_long_prefills_to_onednn(model_dir):
    llm = LLM(str(model_dir), dtype="bfloat16", num_threads=2, max_model_len=256, kv_cache_memory=96 << 20)
    model = llm.engine.runner.model
    assert model.decode_layers is not None and model.decode_rows_max == cpu_gemm.AMX_MAX_ROWS
    model.set_row_tile(cpu_gemm.INVARIANT_ROWS)  # batch-invariant mode: the AMX kernel at any number of rows
    assert model.decode_layers is not None and model.decode_rows_max is None
