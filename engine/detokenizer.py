"""Incremental detokenization, used to find stop strings as tokens arrive.

Decoding a sliding window (a few tokens of context plus the new ones) keeps each step O(1) and
handles tokenizers whose pieces only make sense together (byte fallback, leading spaces).
"""

from __future__ import annotations

CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = max(len(prompt_token_ids) - CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.output_start = len(prompt_token_ids)
        self.text = ""
        self.stopped = False

    def stop_at(self, index: int) -> None:
        """A stop string starts at text[index]: the text ends there, later tokens add nothing."""
        self.text = self.text[:index]
        self.stopped = True

    def update(self, token_ids: list[int]) -> str:
        """Feed the sequence's full token list; returns the newly readable text (maybe empty)."""
        if self.stopped:
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        prefix_text = decode(token_ids[self.prefix_offset:self.read_offset])
        full_text = decode(token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character: wait for more tokens
        new_text = full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += new_text
        return new_text


def find_stop(text: str, new_text_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_text_len` characters: (index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(len(text) - new_text_len - len(stop) + 1, 0)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
