"""Penalties, logit_bias and min_tokens on the real model, each checked against what it must do to the
model's own greedy choice."""

import pytest

from engine import LLM, SamplingParams

PROMPT = "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3,"
SPACE = 216  # the tokenizer's " ", the greedy first token after PROMPT


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory=64 << 20)


def test_penalties_bias_and_min_tokens(llm):
    tok = llm.get_tokenizer()
    greedy = dict(max_tokens=6, temperature=0)
    free, biased, repeated, frequency, early = (o.outputs[0] for o in llm.generate([PROMPT] * 5, [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logit_bias={tok.encode(" zebra")[0]: 100}),
        SamplingParams(**greedy, repetition_penalty=5.0),
        SamplingParams(**greedy, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[SPACE], min_tokens=3),
    ]))
    assert free.text == " 1, 2," and free.token_ids[0] == SPACE  # the loop the penalties must break
    assert biased.token_ids == [tok.encode(" zebra")[0]] * 6
    prompt_ids = set(tok.encode(PROMPT))
    assert sum(t in prompt_ids for t in repeated.token_ids) < 6  # prompt tokens pushed down
    assert len(set(frequency.token_ids)) > len(set(free.token_ids))  # fewer repeats
    assert len(early.token_ids) == 3 and SPACE not in early.token_ids[:2]  # the stop token was masked
    (alone,) = llm.generate([PROMPT], SamplingParams(**greedy))
    assert alone.outputs[0].token_ids == free.token_ids  # rows without them are unchanged beside them
    assert not llm.engine.structured._matchers and not llm.engine.sampler.generators  # state by id, released
    with pytest.raises(ValueError, match="presence_penalty and frequency_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 500})
