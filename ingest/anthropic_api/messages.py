"""Anthropic's Messages request and result shapes, translated to and from the OpenAI Batch lines that tokenmill's
jobs read and write: a batch request's `params` become one `/v1/chat/completions` input line (`openai_line`), and
each line of the job's batch output becomes one line of the batch's results (`individual_response`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from storage.formats import CHAT, line_error

CUSTOM_ID = r"^[a-zA-Z0-9_-]{1,64}$"  # Anthropic's custom_id
UNRUN_RESULTS = {"batch_cancelled": "canceled", "batch_expired": "expired"}  # error codes of requests never run
# a failed request's code -> Anthropic's error type (else invalid_request_error)
ERROR_TYPES = {"model_not_found": "not_found_error", "engine_error": "api_error", "server_error": "api_error",
               "batch_failed": "api_error", "internal_error": "api_error"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field tokenmill does not honour is refused, never dropped


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: tokenmill's prefix cache needs no breakpoints


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock] = Field(min_length=1)


class Metadata(Strict):
    user_id: str | None = Field(default=None, max_length=256)


class MessageParams(Strict):
    """The Messages API's request body, the fields tokenmill serves."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None  # accepted and not used


class BatchRequest(Strict):
    custom_id: str = Field(pattern=CUSTOM_ID)
    params: MessageParams


class MessageBatchCreate(Strict):
    requests: list[BatchRequest] = Field(min_length=1)


def _content(value: str | list[TextBlock]) -> str | list[dict[str, str]]:
    return value if isinstance(value, str) else [{"type": "text", "text": block.text} for block in value]


def openai_line(request: BatchRequest) -> dict[str, Any]:
    """The request as an OpenAI Batch chat line: `system` first as a system message, `stop_sequences` as `stop`;
    text blocks stay text parts, joined as the job joins OpenAI's."""
    params = request.params
    messages = [{"role": "system", "content": _content(params.system)}] if params.system else []
    messages += [{"role": message.role, "content": _content(message.content)} for message in params.messages]
    body: dict[str, Any] = {"model": params.model, "max_tokens": params.max_tokens, "messages": messages}
    for ours, theirs in (("temperature", params.temperature), ("top_p", params.top_p), ("top_k", params.top_k),
                         ("stop", params.stop_sequences)):
        if theirs is not None:
            body[ours] = theirs
    return {"custom_id": request.custom_id, "method": "POST", "url": CHAT, "body": body}


def message(line: dict[str, Any]) -> dict[str, Any]:
    """A succeeded line's chat completion as Anthropic's Message. `stop_sequence` is the stop string that ended it
    where the output recorded one (its choice's `stop_reason`)."""
    body = line["response"]["body"]
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    matched = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    stop_reason = "max_tokens" if choice.get("finish_reason") == "length" else (
        "stop_sequence" if matched is not None else "end_turn")
    return {
        "id": f"msg_{line['id'].removeprefix('batch_req_')}", "type": "message", "role": "assistant",
        "model": body["model"], "content": [{"type": "text", "text": choice["message"]["content"] or ""}],
        "stop_reason": stop_reason, "stop_sequence": matched,
        # Anthropic's input_tokens leaves out the tokens read from the cache, which it counts apart
        "usage": {"input_tokens": usage.get("prompt_tokens", 0) - cached, "cache_read_input_tokens": cached,
                  "cache_creation_input_tokens": 0, "output_tokens": usage.get("completion_tokens", 0)},
    }


def individual_response(line: dict[str, Any]) -> dict[str, Any]:
    """One line of a message batch's results, from one line of its job's batch output."""
    error = line_error(line)
    if error is None:
        result: dict[str, Any] = {"type": "succeeded", "message": message(line)}
    elif error.get("code") in UNRUN_RESULTS:
        result = {"type": UNRUN_RESULTS[error["code"]]}
    else:
        kind = ERROR_TYPES.get(error.get("code"), "invalid_request_error")
        result = {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": error["message"]}}}
    return {"custom_id": line["custom_id"], "result": result}
