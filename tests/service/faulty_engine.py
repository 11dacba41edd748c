"""The engine factory of the service tests' workers: the real engine, except that a prompt holding POISON
kills the process tokenizing it with SIGKILL, as a row that crashes the engine every time would."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from workers.worker_engine import load_engine

POISON = "POISON-PILL"


class CheckedTokenizer:
    """The engine's tokenizer, calling `check` with the text of every call that tokenizes (one prompt, a batch of
    prompts, or chats through the template) first: the workers tokenize through `engine.encode` and, a shard's
    rows at once, through the tokenizer itself."""

    def __init__(self, tokenizer: Any, check: Callable[[str], None]) -> None:
        self._tokenizer, self._check = tokenizer, check

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(repr(text))
        return self._tokenizer(text, *args, **kwargs)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(repr(text))
        return self._tokenizer.encode(text, *args, **kwargs)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(repr(conversation))
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def check_tokenizing(engine, check: Callable[[str], None]):
    engine.tokenizer = CheckedTokenizer(engine.tokenizer, check)
    return engine


def die_on_poison(text: str) -> None:
    if POISON in text:
        os.kill(os.getpid(), signal.SIGKILL)


def load(settings: dict):
    return check_tokenizing(load_engine(settings), die_on_poison)
