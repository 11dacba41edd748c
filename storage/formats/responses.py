"""OpenAI's Responses API in batch lines (`/v1/responses`): a request body becomes a chat row
(`parse_responses_body`), and a row's results become a Response object (`responses_body`).

Text in, text out: `input` (a string or message items of text parts), `instructions` (a system message placed
first), `max_output_tokens`, `temperature`, `top_p` and `text.format` (json_schema or json_object, the chat path's
`response_format`). Tools, reasoning, stored conversations, background runs and streaming fail the row."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from storage.formats.rows import MAX_MESSAGES, RESPONSES, Request, RowError, check_unsupported

UNSUPPORTED_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "previous_response_id",
                      "conversation", "prompt", "reasoning", "background", "stream", "stream_options", "include",
                      "top_logprobs", "truncation")
# values that ask for nothing tokenmill lacks (tools are never given, so no tool choice matters)
NO_OP_FIELDS = {"tool_choice": ("none", "auto"), "parallel_tool_calls": (True,), "truncation": ("disabled",)}
INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")  # output_text: an earlier assistant turn given back as input
SAMPLED = ("max_output_tokens", "temperature", "top_p")  # echoed as the row ran (its job's defaults filled in)


class _Refused(ValueError):
    """A body the row cannot run: its code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def parse_responses_body(row: int, custom_id: str, body: dict[str, Any]) -> Request | RowError:
    """A Responses request body as a chat row, or the row's error."""
    if unsupported := check_unsupported(row, custom_id, body, UNSUPPORTED_FIELDS, NO_OP_FIELDS):
        return unsupported
    try:
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _Refused("invalid_parameter", f"instructions must be a string, got {type(instructions).__name__}")
        messages = _input_messages(body.get("input"))
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        response_format, format_echo = _text_format(body.get("text"))
        params = {name: body[name] for name in ("temperature", "top_p") if body.get(name) is not None}
        if (limit := body.get("max_output_tokens")) is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise _Refused("invalid_parameter", f"max_output_tokens must be a positive integer, got {limit!r}")
            params["max_tokens"] = limit
    except _Refused as refused:
        return RowError(row, custom_id, refused.code, refused.message)
    if response_format is not None:
        params["response_format"] = response_format
    return Request(row, custom_id, RESPONSES, messages=messages, params=params, model=body.get("model"), openai=True,
                   response_echo={"instructions": instructions, "text": {"format": format_echo}})


def _input_messages(value: Any) -> list[dict[str, str]]:
    """`input` as chat messages: a string is one user message; `developer` items become system messages."""
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if value is None or value in ("", []):
        raise _Refused("missing_input", "input is null or empty")
    if not isinstance(value, list):
        raise _Refused("invalid_input", f"input must be a string or a list of message items, got "
                                        f"{type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise _Refused("invalid_input", f"input holds {len(value)} items, over the limit of {MAX_MESSAGES}")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _Refused("invalid_input", f"input[{i}] must be a message item (an object), got {type(item).__name__}")
        if (kind := item.get("type", "message")) != "message":
            raise _Refused("unsupported_content",
                           f"input[{i}] is a {kind!r:.100} item: only message items are supported")
        role = INPUT_ROLES.get(item.get("role"))
        if role is None:
            raise _Refused("invalid_input", f"input[{i}].role must be one of {', '.join(INPUT_ROLES)}, got "
                                            f"{item.get('role')!r:.100}")
        messages.append({"role": role, "content": _item_text(i, item.get("content"))})
    return messages


def _item_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise _Refused("invalid_input", f"input[{index}].content must be a string or a list of content parts")
    if kinds := sorted({str(part.get("type")) for part in content} - set(TEXT_PARTS)):
        raise _Refused("unsupported_content", f"input[{index}] has {', '.join(kinds)} content: only text "
                                              f"({', '.join(TEXT_PARTS)}) is supported")
    texts = [part.get("text") for part in content]
    if not all(isinstance(text, str) for text in texts):
        raise _Refused("invalid_input", f"input[{index}].content: each text part needs a string 'text'")
    return "".join(texts)


def _text_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` as the chat path's response_format (None: free text) and the format the Response echoes."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise _Refused("invalid_parameter", f"text must be an object, got {type(text).__name__}")
    if text.get("verbosity") not in (None, "medium"):
        raise _Refused("unsupported_parameter", "text.verbosity is not supported by tokenmill")
    spec = text.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}, {"type": "json_object"}
    if kind != "json_schema":
        raise _Refused("invalid_response_format",
                       f"text.format.type must be text, json_object or json_schema, got {kind!r:.100}")
    name, schema = spec.get("name"), spec.get("schema")
    if not isinstance(name, str) or not name:
        raise _Refused("invalid_response_format", "text.format.name must be a non-empty string")
    if not isinstance(schema, dict):
        raise _Refused("invalid_response_format", "text.format.schema must be a JSON schema object")
    echo = {key: spec[key] for key in ("type", "name", "schema", "description", "strict") if spec.get(key) is not None}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": spec.get("strict")}}, echo


def request_echo(request: Request, params: Any) -> str | None:
    """A RESPONSES row's echoed fields as JSON text for its part records: its own, and the sampling it ran with."""
    if request.endpoint != RESPONSES:
        return None
    sampled = {"max_output_tokens": getattr(params, "max_tokens", None),
               "temperature": getattr(params, "temperature", None), "top_p": getattr(params, "top_p", None)}
    return json.dumps({**(request.response_echo or {}), **sampled}, ensure_ascii=False)


def responses_body(model: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's Response for a row's part records (one output message per choice); `incomplete` when the length
    limit ended one."""
    record = records[0]
    echo = json.loads(record.get("request_echo") or "{}")
    cut = any(r["finish_reason"] == "length" for r in records)
    created = int(time.time())
    prompt, completion = record["prompt_tokens"], sum(r["completion_tokens"] for r in records)
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": created,
        "status": "incomplete" if cut else "completed",
        "completed_at": None if cut else created,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": echo.get("instructions"),
        "model": model,
        "output": [_message(r) for r in records],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        **{name: echo.get(name) for name in SAMPLED},
        "text": echo.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                  "input_tokens_details": {"cached_tokens": record["cached_tokens"] or 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _message(record: dict[str, Any]) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}",
            "status": "incomplete" if record["finish_reason"] == "length" else "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": record["text"], "annotations": []}]}
