"""Scheduling policies and cache isolation on the real model: priority order, capped prefill chunks, cache salts.
These compare outputs across batch orders, chunkings and prefix-cache hits, so they run batch-invariant (in bf16,
where dtype auto picks it, near-ties go either way with the batch)."""

import pytest

from engine import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_threads=2, max_model_len=512, kv_cache_memory=64 << 20,
               scheduling_policy="priority", max_num_seqs=1, batch_invariant=True)


def test_priority_policy_runs_the_lowest_value_first(llm):
    prompts = ["The capital of France is", "One, two, three,", "def fibonacci(n):", "Hello"]
    # one runs at a time and the engine holds two: generate feeds them by priority too
    outs = llm.generate(prompts, GREEDY, priority=[3, 0, 2, 1])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 3, 2, 0]
    by_fcfs = llm.generate(prompts, GREEDY)  # same tokens whatever the order
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in by_fcfs]
    with pytest.raises(ValueError, match="2 priorities for 4 prompts"):
        llm.generate(prompts, GREEDY, priority=[0, 1])


def test_prefix_cache_blocks_are_shared_only_within_one_cache_salt(llm):
    prompt = [1] + list(range(600, 660))
    (first,) = llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    (other,) = llm.generate([prompt], GREEDY, cache_salt="tenant-b")
    (unsalted,) = llm.generate([prompt], GREEDY)
    (same,) = llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert first.num_cached_tokens == other.num_cached_tokens == unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == 48
    assert same.outputs[0].token_ids == other.outputs[0].token_ids == first.outputs[0].token_ids


def test_long_prefill_token_threshold_lets_a_short_prompt_finish_during_a_long_prefill(model_dir, llm):
    engine = LLMEngine.from_engine_args(model=str(model_dir), num_threads=2, max_model_len=512,
                                        kv_cache_memory=64 << 20, max_num_batched_tokens=64,
                                        long_prefill_token_threshold=32, batch_invariant=True)
    long_prompt = [1] + [504] * 199
    engine.add_request("long", long_prompt, GREEDY)
    engine.add_request("short", [1, 504, 3458], GREEDY)
    finished_at, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            finished_at[out.request_id] = (step, out.outputs[0].token_ids)
    # uncapped, the long prompt's 64-token chunks would hold the short one back until step 4 (done at 7)
    assert finished_at["short"][0] == 4
    assert finished_at["long"][0] == 7 + 3  # ceil(200 / 32) chunks, then 3 decodes
    (uncapped,) = llm.generate([long_prompt], GREEDY)
    assert finished_at["long"][1] == uncapped.outputs[0].token_ids
