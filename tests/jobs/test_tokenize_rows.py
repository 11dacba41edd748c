"""A shard's rows tokenized in batched calls give the ids one call a row gives; a row the template refuses is left
to `prepare_row`, which fails it alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.chat import chat_token_ids
from storage.formats import CHAT, COMPLETIONS, EMBEDDINGS, Request, RowError
from tokenmill.bench.tiny_model import CHAT_TEMPLATE, build_tokenizer
from workers.shards import tokenize_rows


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tokenizer()


def chat(row: int, content: str) -> Request:
    return Request(row, f"c{row}", CHAT, messages=[{"role": "user", "content": content}])


def test_batched_ids_equal_one_call_a_row(tiny_tokenizer):
    rows = [chat(0, "What is a black hole?"), Request(1, "p1", COMPLETIONS, prompt="Describe the water cycle."),
            RowError(2, "e2", "invalid_json", "bad"), chat(3, "Why do cats purr? (take 2)"),
            Request(4, "t4", COMPLETIONS, prompt=[5, 6, 7]), Request(5, "m5", EMBEDDINGS, inputs=["x"])]
    ids = tokenize_rows(SimpleNamespace(tokenizer=tiny_tokenizer), rows)
    assert sorted(ids) == [0, 1, 3]  # token-id prompts, embeddings and errors are left to prepare_row
    assert ids[0] == chat_token_ids(tiny_tokenizer, rows[0].messages)
    assert ids[3] == chat_token_ids(tiny_tokenizer, rows[3].messages)
    assert ids[1] == tiny_tokenizer.encode("Describe the water cycle.", add_special_tokens=True)


def test_a_row_the_template_refuses_leaves_the_chat_batch_to_one_call_a_row():
    refusing = build_tokenizer()
    refusing.chat_template = ("{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
                              + CHAT_TEMPLATE)
    rows = [chat(0, "fine"), chat(1, "boom"), Request(2, "p2", COMPLETIONS, prompt="still batched")]
    ids = tokenize_rows(SimpleNamespace(tokenizer=refusing), rows)
    assert sorted(ids) == [2]


def test_the_bundled_models_batched_ids_equal_one_call_a_row_on_awkward_rows(tokenizer):
    """SmolLM2's own template and tokenizer: many turns and roles, control tokens and template syntax typed as
    text, whitespace runs, non-ASCII, empty contents."""
    pieces = ["hello", " ", "  ", "\n", "\n\n", "\t", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>",
              "{{ x }}", "{% if %}", "é", "日本語", "🙂", "assistant\n", "'\"", "a" * 40, ""]
    rng = random.Random(0)
    rows = []
    for i in range(300):
        turns = [{"role": rng.choice(["system", "user", "assistant", "tool", "developer"]),
                  "content": "".join(rng.choices(pieces, k=rng.randint(0, 8)))} for _ in range(rng.randint(1, 4))]
        rows += [Request(2 * i, f"c{i}", CHAT, messages=turns),
                 Request(2 * i + 1, f"p{i}", COMPLETIONS, prompt="".join(rng.choices(pieces, k=rng.randint(1, 8))))]
    ids = tokenize_rows(SimpleNamespace(tokenizer=tokenizer), rows)
    assert sorted(ids) == list(range(len(rows)))
    for row in rows:
        alone = (chat_token_ids(tokenizer, row.messages) if row.messages is not None
                 else tokenizer.encode(row.prompt, add_special_tokens=True))
        assert ids[row.row] == alone, row
