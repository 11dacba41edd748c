"""Constrained decoding on the real model: every output parses and validates, in a batch mixed with free rows
whose greedy output does not change; n > 1, prefix caching and n-gram speculation keep the constraint."""

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
FREE = ["The capital of France is", "One, two, three,"]


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON), **kwargs)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory=256 << 20)


def test_json_schema_rows_validate_and_free_greedy_rows_do_not_change(llm):
    tok = llm.get_tokenizer()
    chat = llm.apply_chat_template(PROMPT)
    free = SamplingParams(max_tokens=10, temperature=0)
    alone = llm.generate(FREE, free)
    prompts = [chat, chat, chat, *FREE]
    params = [json_params(temperature=0), json_params(temperature=1.0, seed=1), json_params(temperature=1.0, n=2),
              free, free]
    outs = llm.generate(prompts, params)
    texts = [c.text for o in outs[:3] for c in o.outputs]
    assert len(texts) == 4
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert [o.outputs[0].token_ids for o in outs[3:]] == [o.outputs[0].token_ids for o in alone]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert llm.engine.structured.compiled == 1  # one schema, compiled once
    assert tok.decode(outs[0].outputs[0].token_ids[-1:]) == tok.eos_token


def test_regex_choice_grammar_and_json_object(llm):
    cases = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
             StructuredOutputsParams(choice=["positive", "negative"]),
             StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
             StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    outs = llm.generate(["Text: I loved it. Answer:"] * 4,
                        [SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured_outputs=c) for c in cases])
    regex, choice, grammar, obj = (o.outputs[0].text for o in outs)
    assert len(regex) >= 6 and regex[:3].isdigit() and regex[3] == "-" and regex[4:].isalpha()
    assert choice in ("positive", "negative") and grammar in ("yes", "no")
    assert outs[3].outputs[0].finish_reason == "length" or isinstance(json.loads(obj), dict)
    assert obj.startswith("{") and "\n" not in obj


@pytest.mark.parametrize("bad", [StructuredOutputsParams(json={"type": "nonsense"}),
                                 StructuredOutputsParams(json="{not json"),
                                 StructuredOutputsParams(regex="(unclosed"),
                                 StructuredOutputsParams(grammar="root ::= ")])
def test_invalid_constraints_are_refused_when_added(llm, bad):
    with pytest.raises(ValueError, match="invalid"):
        llm.engine.add_request(None, "x", SamplingParams(structured_outputs=bad))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured._matchers


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_speculation_and_prefix_cache_keep_the_constraint(model_dir):
    spec = LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory=256 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec.engine.spec.control.lookahead = lambda num_decoding: 4  # speculate every step, paying or not
    example = 'Describe a person as JSON with a name and an age, like {"name": "Ann Lee", "age": 30}.'
    chat = spec.apply_chat_template([{"role": "user", "content": example}])  # text the n-gram lookup can find
    outs = spec.generate([chat] * 3, [json_params(temperature=0)] * 2 + [json_params(temperature=1.0, seed=5)])
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert outs[0].outputs[0].text == outs[1].outputs[0].text
    assert outs[1].num_cached_tokens > 0 or outs[0].num_cached_tokens > 0
    assert spec.engine.spec.stats.draft_tokens > 0


def test_drafts_the_grammar_rejects_are_never_accepted(model_dir):
    """A self-draft proposes what the free model would say; the grammar forbids it, so the verifier must reject
    those drafts: every output is still one of the choices, and drafts were proposed and turned down."""
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory=64 << 20,
              speculative_config={"method": "self", "num_speculative_tokens": 3, "draft_layers": 24})
    llm.engine.spec.control.lookahead = lambda num_decoding: 3  # speculate every step
    choices = ["a bright yellow submarine", "a bright yellow sun over the sea"]
    params = [SamplingParams(max_tokens=40, temperature=temperature, seed=4,
                             structured_outputs=StructuredOutputsParams(choice=choices)) for temperature in (0, 1.0)]
    outs = llm.generate(["The capital of France is"] * 2, params)
    assert all(o.outputs[0].text in choices for o in outs)
    stats = llm.engine.spec.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens < stats.draft_tokens
