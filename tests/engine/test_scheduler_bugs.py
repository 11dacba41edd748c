"""Regressions on the real model: one request cannot fail every request; forked samples decode before prefills."""

from engine import LLM, LLMEngine, SamplingParams


def test_a_request_that_needs_the_whole_pool_runs_and_the_others_too(model_dir):
    llm = LLM(str(model_dir), num_threads=2, num_kv_blocks=11, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long, short = llm.generate([[1] + [504] * 156, [1, 504, 3458]], params)
    assert long.error is None and short.error is None
    assert [len(o.outputs[0].token_ids) for o in (long, short)] == [3, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in (long, short))


def test_forked_samples_decode_before_a_long_chunked_prefill(model_dir):
    engine = LLMEngine.from_engine_args(model=str(model_dir), num_threads=2, max_num_batched_tokens=8,
                                        enable_prefix_caching=False, max_model_len=512, kv_cache_memory=64 << 20)
    engine.add_request("fork", [1] + [504] * 4, SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=1,
                                                                ignore_eos=True))
    engine.add_request("long", [1] + [504] * 159, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finished_at = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            finished_at[out.request_id] = step
    # 1 prefill step + 11 decode steps of the three samples; the long prompt's chunks use what is left
    # (before the fix the samples waited behind all 160 prompt tokens)
    assert finished_at["fork"] == 12
    assert finished_at["fork"] < finished_at["long"]
