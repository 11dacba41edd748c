"""SamplingParams(logprobs=k) on the real model: the sampled token's and the top-k log probabilities match
Hugging Face's, with and without n-gram speculation; a constrained row reports the model's own probabilities."""

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputsParams

PROMPT = "Count: 1, 2, 3, 1, 2, 3, 1, 2,"


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [row[0].float().log_softmax(-1) for row in out.logits]


@pytest.fixture(scope="module")
def engines(model_dir):
    """One LLM per speculative setting, built on first use and shared by the tests of this module."""
    built: dict[str, LLM] = {}

    def get(spec: dict | None) -> LLM:
        key = str(spec)
        if key not in built:
            built[key] = LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=256,
                             kv_cache_memory=64 << 20, speculative_config=spec)
        return built[key]

    return get


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_logprobs_match_hugging_face(engines, reference, spec):
    llm = engines(spec)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    completion = out.outputs[0]
    tokens, rows = reference
    assert completion.token_ids == tokens
    assert len(completion.logprobs) == 8
    for token, entry, row in zip(tokens, completion.logprobs, rows, strict=True):
        assert entry[token].rank == 1 and len(entry) == 3
        top = row.topk(3)
        assert list(entry) == top.indices.tolist()
        assert [e.logprob for e in entry.values()] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in
                                                              zip(completion.logprobs, tokens, strict=True)))
    if spec is not None:  # some of these tokens came through verified drafts
        assert llm.engine.spec.stats.accepted_tokens > 0


def test_constrained_and_sampled_rows_report_the_chosen_token(engines):
    llm = engines(None)
    choice = StructuredOutputsParams(choice=["zebra", "yak"])
    outs = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=4, temperature=0, logprobs=0,
                                                      structured_outputs=choice),
                                       SamplingParams(max_tokens=4, temperature=1.0, seed=2, logprobs=1)])
    constrained, sampled = (o.outputs[0] for o in outs)
    assert constrained.text in ("zebra", "yak")
    assert all(len(e) == 1 for e in constrained.logprobs)
    assert constrained.logprobs[0][constrained.token_ids[0]].rank > 1  # not what the free model wanted
    for token, entry in zip(sampled.token_ids, sampled.logprobs, strict=True):
        assert token in entry and entry[token].logprob <= 0 and not math.isinf(entry[token].logprob)
    assert SamplingParams(max_tokens=1).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        SamplingParams(logprobs=21)
