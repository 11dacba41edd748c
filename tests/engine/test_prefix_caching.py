"""Prefix caching and parallel sampling on the real model."""

import pytest

from engine import LLM, SamplingParams
from tests.engine.identity import PASSAGE, HFVerdict

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def shared_prompts(tokenizer):
    from tokenmill.bench.workload import chat_ids, questions

    system = "Use this background when it helps.\n" + PASSAGE * 4
    prompts = []
    for question in questions()[:10]:
        encoded = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    assert chat_ids(tokenizer, "x")  # the helper renders like the engine's chat()
    return prompts


@pytest.fixture(scope="module")
def reference(hf_model, shared_prompts):
    return HFVerdict(hf_model, MAX_TOKENS)


@pytest.mark.parametrize(
    "config",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True, num_kv_blocks=100, block_size=4, max_num_batched_tokens=128),
        dict(enable_prefix_caching=True, long_prefill_token_threshold=48, scheduling_policy="priority",
             max_num_batched_tokens=160),
    ],
    ids=["on", "off", "on-kv-pressure", "on-capped-chunks-priority"],
)
def test_greedy_is_identical_with_prefix_caching_on_and_off(config, model_dir, shared_prompts, reference):
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, **config)
    outputs = llm.generate(shared_prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    failures, allowances = reference.compare(shared_prompts, [o.outputs[0].token_ids for o in outputs])
    assert not failures, failures
    assert allowances <= 1
    stats = llm.engine.get_stats()
    prompt_len = min(map(len, shared_prompts))
    if config["enable_prefix_caching"]:
        assert stats.prefix_cache_hits > 0
        assert all(o.num_cached_tokens > 0 for o in outputs[1:])
        assert stats.computed_prefill_tokens < sum(map(len, shared_prompts)) - 5 * prompt_len // 2
    else:
        assert stats.prefix_cache_hits == 0 and all(o.num_cached_tokens == 0 for o in outputs)
        assert stats.computed_prefill_tokens >= sum(map(len, shared_prompts))
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0
    if config["enable_prefix_caching"]:  # each prompt looked up once, however often it was preempted
        assert stats.prefix_cache_queries == sum(map(len, shared_prompts))
    kv = llm.engine.kv_manager
    assert kv.pool.num_free_blocks == kv.usable_blocks and not any(kv.pool.ref_counts)


def test_hits_are_counted_in_tokens(model_dir, tokenizer):
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, kv_cache_memory=64 << 20)
    prompt = tokenizer.encode(PASSAGE)  # well over 3 blocks
    first = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_queries == 2 * len(prompt) and stats.prefix_cache_hits == again.num_cached_tokens


def test_n_samples_share_the_prompt_blocks_and_are_reproducible(model_dir, tokenizer):
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, kv_cache_memory=64 << 20)
    engine = llm.engine
    prompt = tokenizer.encode(PASSAGE)[:40]  # 2 full blocks and a partial one of 8 tokens
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("fan", prompt, params)
    peak, outputs = 0, []
    pool = engine.kv_manager.pool
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, engine.kv_manager.usable_blocks - pool.num_free_blocks)
    (out,) = outputs
    # per sample: 60 tokens = 4 blocks; shared: the 2 full prompt blocks; own: 2 blocks each
    assert peak <= 2 + 4 * 2
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 4
    again = llm.generate([prompt], params)[0]
    assert [c.text for c in again.outputs] == texts
    assert pool.num_free_blocks == engine.kv_manager.usable_blocks
    greedy = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_each_of_n_samples_matches_a_standalone_request_with_its_seed_stream(model_dir, tokenizer, monkeypatch):
    """Forked samples share the prompt's blocks and copy the partial last one before writing it: each sample
    gives what a request alone with that sample's seed gives, also when samples are preempted and recomputed."""
    from engine.sequence import Sequence

    llm = LLM(str(model_dir), dtype="float32", num_threads=2, num_kv_blocks=9)
    prompt = tokenizer.encode(PASSAGE)[:40]  # 2 full blocks of 16 and a partial one of 8 tokens
    params = dict(max_tokens=16, temperature=1.0, ignore_eos=True)
    runner, copies = llm.engine.runner.transfer, []
    copy_blocks = runner.copy_blocks
    monkeypatch.setattr(runner, "copy_blocks", lambda pairs: (copies.extend(pairs), copy_blocks(pairs)))
    (fanned,) = llm.generate([prompt], SamplingParams(n=4, seed=11, **params))
    assert copies and llm.engine.get_stats().num_preemptions > 0
    assert len({tuple(c.token_ids) for c in fanned.outputs}) == 4
    for sample in fanned.outputs:
        seed = Sequence(0, "r", prompt, SamplingParams(n=4, seed=11, **params))
        seed.sample_index = sample.index
        (alone,) = llm.generate([prompt], SamplingParams(seed=seed.sample_seed, **params))
        assert alone.outputs[0].token_ids == sample.token_ids, sample.index
