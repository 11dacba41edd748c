"""Penalties, logit_bias and min_tokens on the real model, each checked against what it must do to the
model's own greedy choice."""

import pytest
import torch

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


def penalised(prompt, outputs, drafts=(), **params):
    """The logits rows (all zero before) of one sequence after the processors; with drafts, one row per draft
    position and one beyond."""
    from engine.logits_processors import apply_logits_processors
    from engine.sequence import Sequence
    from engine.step_types import SampleLayout

    seq = Sequence(0, "r", prompt, SamplingParams(**params))
    seq.token_ids += outputs
    layout = SampleLayout(seqs={0: seq}, first_row={0: 0}, drafts={0: list(drafts)} if drafts else {})
    logits = torch.zeros(1 + len(drafts), 8)
    apply_logits_processors(logits, layout, frozenset())
    return logits


def test_presence_and_frequency_penalties_each_subtract_their_own_amount():
    outputs = [3, 3, 3, 5]  # token 3 three times, token 5 once; token 1 only in the prompt
    presence = penalised([1, 2], outputs, presence_penalty=0.5)[0]
    assert presence.tolist() == [0, 0, 0, -0.5, 0, -0.5, 0, 0]
    frequency = penalised([1, 2], outputs, frequency_penalty=0.25)[0]
    assert frequency.tolist() == [0, 0, 0, -0.75, 0, -0.25, 0, 0]
    both = penalised([1, 2], outputs, presence_penalty=0.5, frequency_penalty=0.25)[0]
    assert both.tolist() == (presence + frequency).tolist()


def test_penalties_at_draft_positions_count_the_drafts_before_them():
    rows = penalised([1], [3], drafts=[5, 5], frequency_penalty=1.0)
    assert rows[:, 5].tolist() == [0, -1, -2] and rows[:, 3].tolist() == [-1, -1, -1]
