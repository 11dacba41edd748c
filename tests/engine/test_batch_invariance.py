"""Batch-invariant mode on the real model, in bfloat16 and float32: a request's token ids and logprobs are
bit-identical alone or among 64 others, chunked or whole, from the prefix cache or computed, with speculation on
or off, with one thread or two, greedy or seeded sampling. Each run after the first uses its own cache salt, so it
computes its prompt unless the test means it to hit the prefix cache."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.cpu_gemm import INVARIANT_ROWS, Linear
from engine.spec_decode.cost import StepCost
from tests.engine.cpu_flags import expected_bfloat16_kernel, expected_fixed_float32_kernel

PROMPT = "The three primary colors are red, yellow and"
REPEATING = "one two three four five six, one two three four five six, one two three four five six, one two"
# 3 tokens: the prefill's and two decode steps' (the second over a KV entry a decode step wrote); on CPUs without
# our GEMM kernels every step costs GEMMs over 64-row tiles, whatever its rows
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=3, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
salts = (f"run-{i}" for i in itertools.count())


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def llm(request, model_dir):
    return LLM(str(model_dir), dtype=request.param, batch_invariant=True, num_threads=2, max_model_len=256,
               kv_cache_memory=96 << 20, max_num_seqs=80)


def result(output) -> tuple[list[int], list[dict[int, tuple[float, int]]]]:
    """Token ids and, per token, {token: (logprob, rank)}: compared exactly."""
    sample = output.outputs[0]
    return sample.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in sample.logprobs]


def generate(llm, prompts, params, salt=None) -> list:
    return [result(o) for o in llm.generate(prompts, params, cache_salt=salt or next(salts))]


@pytest.fixture(scope="module")
def alone(llm) -> dict:
    """PROMPT alone, greedy and seeded, each in its own run: the reference of several tests, computed once."""
    return {name: generate(llm, [PROMPT], params)[0] for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def others(llm, count: int) -> list[list[int]]:
    """`count` short prompts of varied lengths (2 to 9 tokens), none sharing PROMPT's first block."""
    ids = llm.get_tokenizer().encode("Write a short story about a lighthouse keeper and the sea at night")
    return [[1] + ids[i % 5:i % 5 + 1 + i % 8] for i in range(count)]


def test_alone_or_among_64_others(llm, alone):
    crowd = others(llm, 64)
    batched = generate(llm, crowd[:40] + [PROMPT, PROMPT] + crowd[40:], [GREEDY] * 40 + [GREEDY, SEEDED]
                       + [SEEDED] * 24)
    assert batched[40:42] == [alone["greedy"], alone["seeded"]]
    assert all(len(tokens) == 3 and len(steps) == 3 for tokens, steps in alone.values())


def test_chunked_or_whole_prefill(llm, alone):
    whole = alone["greedy"]
    limits = llm.engine.scheduler.limits
    limits.long_prefill_token_threshold = 3  # the prompt in chunks of 3 tokens, beside the crowd's decodes
    try:
        chunked = generate(llm, [PROMPT] + others(llm, 4), GREEDY)
    finally:
        limits.long_prefill_token_threshold = 0
    assert chunked[0] == whole


def test_served_from_the_prefix_cache_or_computed(llm):
    prompt = llm.get_tokenizer().encode(PROMPT + " blue. " * 6)  # a few full blocks to cache
    outs = llm.generate([prompt], GREEDY, cache_salt="shared")
    (again,) = llm.generate([prompt], GREEDY, cache_salt="shared")
    assert outs[0].num_cached_tokens == 0 and again.num_cached_tokens >= 16
    # a longer prompt over the cached one: part cached, part computed, decoded beside another request
    longer = prompt + llm.get_tokenizer().encode(" Then green.")
    (computed,) = generate(llm, [longer], GREEDY)
    cached = llm.generate([longer, others(llm, 1)[0]], GREEDY, cache_salt="shared")
    assert cached[0].num_cached_tokens >= 16
    assert result(again) == result(outs[0])
    assert result(cached[0]) == computed


def test_speculation_on_or_off(llm, monkeypatch):
    # the lookahead is fixed below, so the step-cost model is unused: no calibration (a pass of every GEMM per
    # row count, each padded to 64 rows without our kernels: most of this test's time on an AVX2 CPU)
    monkeypatch.setattr(StepCost, "calibrate", classmethod(lambda cls, model, max_rows: cls({1: 1.0})))
    prompts = [REPEATING, REPEATING]  # n-gram drafts from the prompt's own repeats
    params = [GREEDY, SEEDED]
    plain = generate(llm, prompts, params)
    engine = llm.engine
    engine.set_speculative_config(NGRAM)
    engine.spec.control.lookahead = lambda num_decoding: 3  # verify 3 drafts every step
    try:
        speculated = generate(llm, prompts, params)
        assert engine.spec.stats.drafted_by_position[0] > 0 and engine.spec.stats.acceptance_rate > 0
    finally:
        engine.set_speculative_config(None)
    assert speculated == plain


def test_one_thread_or_two(llm, alone):
    two = alone["greedy"]  # computed with two threads
    torch.set_num_threads(1)
    try:
        one = generate(llm, [PROMPT] + others(llm, 2), GREEDY)[0]
    finally:
        torch.set_num_threads(2)
    assert one == two


def test_every_gemm_has_one_shape_and_a_kernel_fixed_by_dtype(llm):
    """Other worker processes run the same kernels: float32's is not the one timed fastest in this process."""
    model = llm.engine.runner.model
    packed = [m.packed for m in model.modules() if isinstance(m, Linear)] + [model.packed_head]
    assert all(p.row_tile == INVARIANT_ROWS for p in packed)
    if model.embed_tokens.weight.dtype == torch.float32:
        # every SmolLM2 side is a 32-column multiple: avx512f -> "avx512", else oneDNN (any x86 wheel), else MKL
        assert all(p.weight.shape[0] % 32 == 0 and p.weight.shape[1] % 32 == 0 for p in packed)
        expected = expected_fixed_float32_kernel()
        assert all(p.kind == expected for p in packed), ({p.kind for p in packed}, expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_turns_the_mode_on_exactly_where_our_gemm_kernels_make_it_free(model_dir, dtype, monkeypatch):
    """The CLI's and jobs' default: on where every GEMM runs on our own kernels (invariant without row tiles).
    From the CPU's flags: bfloat16 on AMX (amx_tile, amx_bf16) -> on ("amx"); else avx512_bf16 -> on ("avx512");
    else off (oneDNN). float32 on avx512f -> on ("avx512"); else off (MKL or oneDNN need row tiles)."""
    monkeypatch.delenv("TOKENMILL_BF16_GEMM", raising=False)
    monkeypatch.delenv("TOKENMILL_FLOAT32_GEMM", raising=False)
    expected = {"bfloat16": expected_bfloat16_kernel(), "float32": expected_fixed_float32_kernel()}[dtype]
    auto = LLM(str(model_dir), dtype=dtype, batch_invariant="auto", num_threads=2, max_model_len=64,
               kv_cache_memory=16 << 20)
    runner = auto.engine.runner
    assert runner.batch_invariant is (expected in ("amx", "avx512")), expected
    assert auto.engine.config.batch_invariant is runner.batch_invariant  # resolved once, for jobs' None too
    packed = [m.packed for m in runner.model.modules() if isinstance(m, Linear)] + [runner.model.packed_head]
    if runner.batch_invariant:
        assert all(p.invariant_kernel for p in packed)
        assert {p.kind for p in packed} == {expected}
    with pytest.raises(ValueError, match="batch_invariant must be true, false or 'auto'"):
        LLM(str(model_dir), batch_invariant="yes")


def test_the_command_line_default_is_auto_and_a_bare_flag_means_on():
    import argparse

    from tokenmill.options import add_engine_options, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] == "auto"
    assert engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args(["--batch-invariant", "off"]))["batch_invariant"] is False
