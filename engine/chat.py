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


# Gemma's chat format, as google/gemma-3-*-it's tokenizer_config.json writes it: a system message goes before the first
# user turn, the assistant's turns are the "model" role, and each turn ends with <end_of_turn>. Gemma GGUFs of the
# pretrained models carry no template; this one is what their instruction-tuned twins were trained on.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)

# model_type -> (the chat template its GGUFs may lack, the token that ends a turn: a stop beside EOS)
CHAT_FORMATS = {"gemma3_text": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>")}


def complete_chat_files(model_type: str, tokenizer: Any, generation_config: Any) -> None:
    """Give a converted model of a known chat format what its GGUF left out: the chat template (where the tokenizer
    has none) and the end-of-turn token among the generation config's EOS ids (what `generate` and the engine stop
    on), as the family's Hugging Face files have them."""
    if model_type not in CHAT_FORMATS:
        return
    template, end_of_turn = CHAT_FORMATS[model_type]
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    if turn_id is None or turn_id == tokenizer.unk_token_id:
        return
    eos = generation_config.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    if turn_id not in eos:
        eos.append(turn_id)
    generation_config.eos_token_id = eos
