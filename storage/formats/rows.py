"""What input readers yield (a `Request` or a `RowError` per row), input limits, and row-level checks
shared by the Parquet and JSONL readers."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"  # OpenAI's Responses API: a chat row underneath (`storage.formats.responses`)
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
ENCODING_FORMATS = ("float", "base64")
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings row, as OpenAI
PARAM_NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "response_format", "logprobs",
               "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
               "min_tokens", "beam_width")
# OpenAI body fields tokenmill does not honour: a row that sets one fails with `unsupported_parameter`, so
# nothing is silently dropped (a no-op value such as false, 0, [] or null is accepted)
UNSUPPORTED_PARAMS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                      "modalities", "prediction", "web_search_options", "echo", "best_of", "suffix", "stream",
                      "reasoning_effort")
NO_OP_VALUES = {"tool_choice": ("none",), "best_of": (1,), "modalities": (["text"],)}
MAX_CUSTOM_ID = 512  # characters
MAX_MESSAGES = 1024  # messages in one chat row
MAX_ROLE = 64  # characters of a message's role


class InputError(ValueError):
    """A file-level problem: the job fails in `validating` with this message (it names the column or limit)."""


@dataclass(frozen=True)
class Limits:
    """Checked against the Parquet footer (or the JSONL size) before any row is read."""

    max_rows: int = 1_000_000
    max_row_groups: int = 10_000
    max_uncompressed_bytes: int = 8 << 30  # Parquet: sum of the row groups' uncompressed sizes
    max_row_group_bytes: int = 1 << 30  # Parquet: one row group is read into memory at a time
    max_footer_bytes: int = 64 << 20  # Parquet: the footer is parsed before any limit can be checked
    max_file_bytes: int = 8 << 30  # JSONL
    max_line_bytes: int = 16 << 20  # JSONL

    ENV_PREFIX = "TOKENMILL_LIMIT_"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Limits:
        known = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in (data or {}).items() if k in known})

    @classmethod
    def from_env(cls, **overrides: int | None) -> Limits:
        """Defaults, then `$TOKENMILL_LIMIT_<NAME>` (e.g. TOKENMILL_LIMIT_MAX_ROWS), then the overrides given."""
        values = {f.name: int(os.environ[cls.ENV_PREFIX + f.name.upper()]) for f in fields(cls)
                  if os.environ.get(cls.ENV_PREFIX + f.name.upper())}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def check(self, name: str, value: int, what: str) -> None:
        limit = getattr(self, name)
        if value > limit:
            raise InputError(f"input {what} is {value:,}, over the limit {name}={limit:,}")


@dataclass(slots=True)
class Request:
    row: int  # 0-based position in the input
    custom_id: str
    endpoint: str  # CHAT, COMPLETIONS, EMBEDDINGS or RESPONSES
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # per-row overrides of the job's sampling defaults
    inputs: list[str | list[int]] | None = None  # EMBEDDINGS: the texts (or token ids) to embed, one vector each
    model: str | None = None  # the row's `model` (OpenAI body, Parquet column): the job's model, an alias or an adapter
    openai: bool = False  # an OpenAI Batch line (JSONL): fields beyond OpenAI's (beam_width) need the job's consent
    response_echo: dict[str, Any] | None = None  # RESPONSES: fields its Response repeats (instructions, text)


@dataclass(slots=True)
class RowError:
    row: int
    custom_id: str | None  # None when the row has no usable custom_id
    code: str
    message: str


def check_unsupported(row: int, custom_id: str, source: dict[str, Any], names: tuple[str, ...] = UNSUPPORTED_PARAMS,
                      no_ops: dict[str, tuple] = NO_OP_VALUES) -> RowError | None:
    """The row's error when it sets one of `names`, fields tokenmill does not honour (tools, audio, logprobs...),
    to anything but an empty value or one of its `no_ops`."""
    used = [name for name in names if source.get(name) not in (None, False, 0, [], {}, "", *no_ops.get(name, ()))]
    if not used:
        return None
    return RowError(row, custom_id, "unsupported_parameter",
                    f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} not supported by tokenmill")


def check_custom_id(row: int, value: Any) -> RowError | None:
    if isinstance(value, str) and len(value) > MAX_CUSTOM_ID:
        return RowError(row, None, "invalid_custom_id", f"custom_id is {len(value)} characters long, over the limit "
                                                        f"of {MAX_CUSTOM_ID} (it starts {value[:40]!r})")
    if isinstance(value, str) and value:
        return None
    return RowError(row, None, "missing_custom_id", f"custom_id must be a non-empty string, got {value!r:.200}")


def parse_messages(row: int, custom_id: str, value: Any) -> list[dict[str, str]] | RowError:
    """A non-empty list of {role, content}; content may be a string or a list of text parts."""
    if value is None or (isinstance(value, list) and not value):
        return RowError(row, custom_id, "missing_messages", "messages is null or empty")
    if not isinstance(value, list):
        return RowError(row, custom_id, "invalid_messages", f"messages must be a list, got {type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        return RowError(row, custom_id, "invalid_messages", f"messages holds {len(value)} messages, over the limit "
                                                            f"of {MAX_MESSAGES}")
    messages = []
    for i, message in enumerate(value):
        if kinds := _non_text_parts(message):
            return RowError(row, custom_id, "unsupported_content",
                            f"messages[{i}] has {', '.join(kinds)} content: only text is supported")
        role = message.get("role") if isinstance(message, dict) else None
        content = _text_content(message.get("content")) if isinstance(message, dict) else None
        if not isinstance(role, str) or not role or len(role) > MAX_ROLE or content is None:
            return RowError(row, custom_id, "invalid_messages",
                            f"messages[{i}] must have a string 'role' (at most {MAX_ROLE} characters) and a string "
                            f"(or text parts) 'content'")
        messages.append({"role": role, "content": content})
    return messages


def _non_text_parts(message: Any) -> list[str]:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    kinds = {p.get("type") for p in content if isinstance(p, dict) and isinstance(p.get("type"), str)}
    return sorted(kinds - {"text"})


def _text_content(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


def parse_prompt(row: int, custom_id: str, value: Any) -> str | list[int] | RowError:
    """A non-empty string, a list of token ids, or a one-element list holding a string."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if value is None or value == "":
        return RowError(row, custom_id, "missing_prompt", "prompt is null or empty")
    return RowError(row, custom_id, "invalid_prompt",
                    f"prompt must be a string or a list of token ids, got {type(value).__name__}")


def pick_params(source: dict[str, Any]) -> dict[str, Any]:
    """The non-null per-row sampling parameters; OpenAI's `max_completion_tokens` counts as `max_tokens`."""
    params = {name: source[name] for name in PARAM_NAMES if source.get(name) is not None}
    if "max_tokens" not in params and source.get("max_completion_tokens") is not None:
        params["max_tokens"] = source["max_completion_tokens"]
    return params


def parse_embedding_body(row: int, custom_id: str, body: dict[str, Any]) -> Request | RowError:
    """An OpenAI embeddings body: `input` (a string, a list of strings, token ids or a list of token-id lists),
    `model`, `encoding_format` (float or base64), `dimensions`; `user` is accepted and ignored."""
    def error(code: str, message: str) -> RowError:
        return RowError(row, custom_id, code, message)

    inputs = body.get("input")
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(_is_token_id(t) for t in inputs)):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        return error("missing_input" if inputs in (None, []) else "invalid_input",
                     f"input must be a string, a list of strings or token ids, got {type(inputs).__name__}")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        return error("invalid_input", f"input holds {len(inputs)} items, over the limit of {MAX_EMBEDDING_INPUTS}")
    for i, item in enumerate(inputs):
        ok = (isinstance(item, str) and item) or (isinstance(item, list) and item and all(map(_is_token_id, item)))
        if not ok:
            return error("invalid_input", f"input[{i}] must be a non-empty string or list of token ids")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        return error("invalid_parameter", f"encoding_format must be float or base64, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_token_id(dimensions) or dimensions < 1):
        return error("invalid_parameter", f"dimensions must be a positive integer, got {dimensions!r}")
    params = {"encoding_format": encoding, **({"dimensions": dimensions} if dimensions is not None else {})}
    return Request(row, custom_id, EMBEDDINGS, inputs=inputs, params=params, model=body.get("model"))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
