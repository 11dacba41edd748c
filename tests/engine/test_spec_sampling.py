"""Sampled speculative decoding on the real model: the tokens that go through the rejection sampler follow
the distribution of the target's own sampling (two-sample chi-square over many seeded samples), with a
self-draft (the draft-model proposer over the target's first 26 layers) whose distribution differs from the
target's; a verifier that accepts every draft fails the same test. The first output token comes from the
prefill, never from the verifier, so tokens 1 to 3 are compared."""

import pytest
import torch
from scipy.stats import chi2_contingency

import engine.spec_decode.verifier as verifier
from engine import LLM, SamplingParams

PROMPT = "Once upon a time, in a small village, there"
SAMPLES = 160  # the n samples of one request, each with its own seeded stream
SPEC = {"method": "self", "num_speculative_tokens": 2, "draft_layers": 26}


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_threads=2, max_model_len=128, kv_cache_memory=320 << 20, max_num_seqs=SAMPLES)


def sample_tokens(llm, seed, speculative):
    """[SAMPLES, 4] output tokens; with speculation, tokens 1 to 3 come out of the verifier."""
    llm.engine.set_speculative_config(SPEC if speculative else None)
    if speculative:  # verify 2 drafts every step, whatever the adaptive control would pick for this batch
        llm.engine.spec.control.lookahead = lambda num_decoding: 2
    params = SamplingParams(n=SAMPLES, max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    llm.engine.set_speculative_config(None)
    return torch.tensor([o.token_ids for o in out.outputs])


def two_sample_p_value(a, b, min_count=8):
    """Chi-square test that two samples of tokens come from one distribution (rare tokens pooled)."""
    tokens, counts = torch.cat([a, b]).unique(return_counts=True)
    common = tokens[counts >= min_count].tolist()
    table = [[int((x == t).sum()) for t in common] + [int((~torch.isin(x, tokens[counts >= min_count])).sum())]
             for x in (a, b)]
    return chi2_contingency(table).pvalue, len(common)


@pytest.fixture(scope="module")
def plain(llm):
    return sample_tokens(llm, 1, speculative=False)


def test_speculated_tokens_follow_the_targets_own_sampling(llm, plain):
    speculated = sample_tokens(llm, 101, speculative=True)
    (decoder,) = llm.engine.spec_decoders.decoders.values()
    stats = decoder.stats
    assert stats.drafted_by_position[1] >= SAMPLES  # every sample verified two drafts at once
    assert 0.2 < stats.acceptance_rate < 0.9  # the draft differs from the target: both paths are taken
    for position in (1, 2, 3):
        p_value, categories = two_sample_p_value(plain[:, position], speculated[:, position])
        assert categories >= 3
        assert p_value > 1e-3, (position, p_value)


def test_a_verifier_that_accepts_every_draft_fails_the_same_test(llm, plain, monkeypatch):
    def accept_all(target, drafts, num_drafts, draft_probs, uniforms, noise):
        return verifier.greedy_verify(torch.cat([drafts, target[:, -1].argmax(-1, keepdim=True)], 1), drafts,
                                      num_drafts)

    monkeypatch.setattr(verifier, "rejection_sample", accept_all)
    speculated = sample_tokens(llm, 101, speculative=True)
    assert min(two_sample_p_value(plain[:, p], speculated[:, p])[0] for p in (1, 2, 3)) < 1e-4
