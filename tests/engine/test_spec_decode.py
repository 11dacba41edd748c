"""Speculative decoding on the real model: greedy output identical to Hugging Face (and so to the engine
without speculation) with each proposer, also under preemption; sampled outputs stay well-formed."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.identity import PASSAGE, HFVerdict

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from tokenmill.bench.workload import chat_ids, questions

    copying = [chat_ids(tokenizer, f"Repeat this text exactly:\n{PASSAGE[:200 + 40 * i]}") for i in range(8)]
    return copying + [chat_ids(tokenizer, q) for q in questions()[:8]]


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return HFVerdict(hf_model, MAX_TOKENS)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    """A different draft with the target's tokenizer: the target with noise on its layers' weights (about four
    drafts in five accepted)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("draft")
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        if name.startswith("model.layers.") and tensor.dim() == 2:
            tensor = tensor + 0.1 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        weights[name] = tensor.contiguous()
    save_file(weights, path / "model.safetensors")
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, path / file.name)
    return path


CASES = {
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
    "ngram-preemption": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                             num_kv_blocks=24, max_num_batched_tokens=64),
    "self": dict(speculative_config={"method": "self", "num_speculative_tokens": 3, "draft_layers": 8,
                                     "min_acceptance": 0.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_speculation_matches_hugging_face(case, model_dir, prompts, reference):
    assert len(prompts) >= 16
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, **CASES[case])
    k = CASES[case]["speculative_config"]["num_speculative_tokens"]
    # drafts every step, by the text alone: the controller's choice reads step timings, and on a busy machine it
    # drafted nothing at all
    llm.engine.spec.control.lookahead = lambda num_decoding: k if num_decoding else 0
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    failures, allowances = reference.compare(prompts, [o.outputs[0].token_ids for o in outputs])
    spec = llm.engine.spec.stats
    print(f"{case}: {spec.snapshot()}, {allowances} near-tie allowances, "
          f"{llm.engine.get_stats().num_preemptions} preemptions")
    assert not failures, failures
    assert allowances <= 1
    assert spec.draft_tokens > 0
    if case == "ngram":
        assert spec.accepted_tokens > 0
    if case == "self":
        assert_the_memory_plan_counted_the_draft(llm, own_weights=False)
    if case == "ngram-preemption":
        assert llm.engine.get_stats().num_preemptions > 0
    kv = llm.engine.kv_manager
    assert kv.pool.num_free_blocks == kv.usable_blocks and not any(kv.pool.ref_counts)


def assert_the_memory_plan_counted_the_draft(llm, own_weights: bool) -> None:
    """The draft's pool (and its own weights) were in the memory plan, as allocated."""
    plan, draft = llm.engine.runner.kv_plan, llm.engine.spec.draft
    pool = draft.attention.k_caches + draft.attention.v_caches
    assert sum(t.nbytes for t in pool) == plan.num_blocks * plan.draft_bytes_per_block > 0
    assert plan.draft_weights_bytes == (sum(p.nbytes for p in draft.model.parameters()) if own_weights else 0)
    assert plan.total_bytes <= plan.budget_bytes


def test_a_different_draft_model_is_verified_every_step(model_dir, draft_dir, prompts, reference):
    """Greedy output stays Hugging Face's while the verifier turns down about one draft in four: a verifier that
    accepted every draft would change the text."""
    chosen = [0, 1, 2, 8, 9, 10]  # three copying prompts and three questions
    llm = LLM(str(model_dir), dtype="float32", num_threads=2,
              speculative_config={"method": "draft", "num_speculative_tokens": 3, "model": str(draft_dir)})
    llm.engine.spec.control.lookahead = lambda num_decoding: 3  # verify drafts every step, paying or not
    outputs = llm.generate([prompts[i] for i in chosen], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    failures, allowances = reference.compare([prompts[i] for i in chosen], [o.outputs[0].token_ids for o in outputs])
    assert not failures and allowances <= 1, failures
    spec = llm.engine.spec.stats
    assert spec.speculative_steps >= 6 and 0.3 < spec.acceptance_rate < 0.95, spec.snapshot()
    assert_the_memory_plan_counted_the_draft(llm, own_weights=True)


def test_sampled_speculation_respects_limits_and_seeds(model_dir, tokenizer):
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, kv_cache_memory=64 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.spec.control.lookahead = lambda num_decoding: 4  # drafts by the text alone, not by the step timings
    prompt = tokenizer.encode("Repeat: " + PASSAGE[:300] + "\n" + PASSAGE[:300])
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0]
    again = llm.generate([prompt], params)[0].outputs[0]
    assert len(first.token_ids) == 30 and first.finish_reason == "length"
    assert first.token_ids == again.token_ids
    assert llm.engine.spec.stats.draft_tokens > 0


@pytest.mark.real_model
def test_bad_speculative_config_is_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(speculative_config={"method": "magic"})
    with pytest.raises(ValueError, match="needs \"model\""):
        LLM(speculative_config={"method": "draft"})


def test_jobs_switching_speculative_settings_keep_a_bounded_set_of_draft_pools(model_dir) -> None:
    """Per-job speculative settings: decoders of the same draft share its model and KV pool; at most
    MAX_SPEC_DECODERS decoders and MAX_DRAFT_PROPOSERS distinct drafts stay, however many settings jobs bring."""
    from engine import LLMEngine
    from engine.spec_decode.decoders import MAX_DRAFT_PROPOSERS, MAX_SPEC_DECODERS

    def self_draft(layers: int, k: int) -> dict:  # max_verify_tokens 2: a quick cost calibration
        return {"method": "self", "draft_layers": layers, "num_speculative_tokens": k, "max_verify_tokens": 2}

    engine = LLMEngine.from_engine_args(model=str(model_dir), dtype="float32", num_threads=2, num_kv_blocks=32)
    engine.set_speculative_config(self_draft(4, 2))
    first = engine.spec.draft
    engine.set_speculative_config(self_draft(4, 3))
    assert engine.spec.draft is first, "the same draft depth reuses the proposer and its KV pool"
    for layers in (2, 3, 5):
        engine.set_speculative_config(self_draft(layers, 1))
    engine.set_speculative_config({"method": "ngram", "max_verify_tokens": 2})
    drafts = {id(d.draft) for d in engine.spec_decoders.decoders.values() if d.draft is not None}
    assert len(engine.spec_decoders.decoders) <= MAX_SPEC_DECODERS and len(drafts) <= MAX_DRAFT_PROPOSERS
    assert first not in [d.draft for d in engine.spec_decoders.decoders.values()], "the least recently used draft went"
    assert next(reversed(engine.spec_decoders.decoders.values())) is engine.spec  # the latest is kept
    engine.set_speculative_config(self_draft(5, 1))
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
