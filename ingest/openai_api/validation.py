"""OpenAI's validation of a batch's input file, at creation: every line parses as a request, its `url` is the
batch's endpoint, its `model` is one this server serves and its `custom_id` is new. The lines that fail are
listed as OpenAI's `errors.data` ({line, code, message, param}; lines counted from 1, blank ones included). The
valid lines' prompt tokens are estimated on the way (`estimated_tokens`), for the tenant's enqueued-token limit."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import IO, Any

from ingest.row_checks import unserved_model
from storage.formats import Limits, Request, RowError
from storage.formats.jsonl import parse_line, parse_value

MAX_LISTED = 100  # lines listed in errors.data; the message gives the total
BYTES_PER_TOKEN = 4  # a prompt's tokens, estimated before any tokenizer reads it: its UTF-8 bytes / 4
MESSAGE_TOKENS = 4  # a chat message's share of its template (role, separators)


class TooManyRows(ValueError):
    pass


@dataclass
class Checked:
    rows: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    invalid: int = 0  # lines refused (all of them; `errors` keeps the first MAX_LISTED)
    prompt_tokens: int = 0  # of the valid lines, estimated

    def refuse(self, line: int, code: str, message: str, param: str | None = None) -> None:
        self.invalid += 1
        if len(self.errors) < MAX_LISTED:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})

    def summary(self) -> str:
        listed = "" if self.invalid <= MAX_LISTED else f" (the first {MAX_LISTED} are listed)"
        return f"{self.invalid:,} of the input file's lines are invalid{listed}"


def check_lines(source: IO[bytes], endpoint: str, served: Collection[str], max_rows: int,
                max_line_bytes: int = Limits().max_line_bytes) -> Checked:
    """One streaming pass over the file; TooManyRows past `max_rows` non-blank lines."""
    checked, seen = Checked(), {}
    line_number = 0
    while line := source.readline(max_line_bytes + 1):
        line_number += 1
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            checked.refuse(line_number, "line_too_long", f"line is longer than {max_line_bytes:,} bytes")
            while (rest := source.readline(max_line_bytes + 1)) and not rest.endswith(b"\n"):
                pass
            continue
        if not line.strip():
            continue
        checked.rows += 1
        if checked.rows > max_rows:
            raise TooManyRows(max_rows)
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        url = value.get("url") if isinstance(value, dict) else None
        if isinstance(url, str) and url != endpoint:  # before the body, which is read as the url says
            checked.refuse(line_number, "invalid_url", f"url {url!r} is not the batch's endpoint {endpoint!r}", "url")
            continue
        request = parse_line(checked.rows - 1, line) if value is None else parse_value(checked.rows - 1, value)
        if isinstance(request, RowError):
            checked.refuse(line_number, request.code, request.message)
            continue
        if (first := seen.setdefault(request.custom_id, line_number)) != line_number:
            checked.refuse(line_number, "duplicate_custom_id",
                           f"duplicate custom_id {request.custom_id!r} (also on line {first})", "custom_id")
        elif (unserved := unserved_model(request.model, served)) is not None:
            checked.refuse(line_number, "model_not_found", unserved, "body.model")
        else:
            checked.prompt_tokens += estimated_tokens(request)
    return checked


def estimated_tokens(request: Request) -> int:
    """The request's prompt tokens, estimated without a tokenizer: what a tenant's queue counts."""
    if request.messages is not None:
        return sum(MESSAGE_TOKENS + _text_tokens(message.get("content")) for message in request.messages)
    if request.inputs is not None:
        return sum(_text_tokens(item) for item in request.inputs)
    return _text_tokens(request.prompt)


def _text_tokens(text: Any) -> int:
    if text is None:
        return 0
    if isinstance(text, list) and all(isinstance(item, int) for item in text):  # token ids
        return len(text)
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False)
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
