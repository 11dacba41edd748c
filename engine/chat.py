"""Chat prompts: a conversation rendered with the model's chat template, as token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_token_ids(tokenizer: Any, conversation: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                   **template_kwargs: Any) -> list[int]:
    """Token ids of a conversation; transformers returns a list, or a BatchEncoding in newer versions."""
    encoded = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                            tokenize=True, **template_kwargs)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
