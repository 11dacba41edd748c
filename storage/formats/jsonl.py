"""OpenAI Batch JSONL input: one `{"custom_id", "method": "POST", "url", "body"}` object per line; `url` is
/v1/chat/completions, /v1/completions, /v1/embeddings or /v1/responses.

One streaming pass (`validate`) counts the rows, enforces the size limits, rejects duplicate custom_ids,
remembers where each row starts, so a shard later seeks straight to its first row, and on the way hashes the file
(`sha256`, the pin of a local input) and counts the models its rows name (`models`, from which `tokenmill run`
picks its model): the validating step reads the file once.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator
from typing import IO, Any

from storage.formats.responses import parse_responses_body
from storage.formats.rows import (
    CHAT,
    EMBEDDINGS,
    ENDPOINTS,
    RESPONSES,
    InputError,
    Limits,
    Request,
    RowError,
    check_custom_id,
    check_unsupported,
    parse_embedding_body,
    parse_messages,
    parse_prompt,
    pick_params,
)
from storage.formats.unique import HashedIds, first_duplicate


class JsonlInput:
    format = "jsonl"

    def __init__(self, file: IO[bytes], limits: Limits, size: int, name: str = "input") -> None:
        self.file, self.limits, self.name = file, limits, name
        limits.check("max_file_bytes", size, "JSONL file size in bytes")
        self._offsets: array | None = None  # byte offset of each row's line
        self.sha256: str | None = None  # of the whole file, once `validate` read it through
        self.models: dict[Any, tuple[int, int]] | None = None  # once validated: as `models_named` gives them

    @property
    def num_rows(self) -> int:
        return len(self._index())

    def validate(self) -> None:
        self._index(check_duplicates=True)

    def _index(self, check_duplicates: bool = False) -> array:
        if self._offsets is not None and not check_duplicates:
            return self._offsets
        offsets, ids = array("q"), HashedIds()
        digest, models = (hashlib.sha256(), {}) if check_duplicates else (None, None)
        for line_number, offset, line in self._lines(digest=digest):
            if check_duplicates:
                custom_id, model = _peek(line)
                if custom_id is not None:
                    ids.add(custom_id)
                count, first = models.get(model, (0, line_number))
                models[model] = (count + 1, first)
            offsets.append(offset)
            self.limits.check("max_rows", len(offsets), "row count")
        if digest is not None:
            self.sha256, self.models = digest.hexdigest(), models
        if check_duplicates and (suspects := ids.repeated_hashes()):
            lines = ((line_number, _peek_custom_id(line)) for line_number, _, line in self._lines())
            if duplicate := first_duplicate(lines, suspects):
                custom_id, first, line_number = duplicate
                raise InputError(f"duplicate custom_id {custom_id!r} on lines {first} and {line_number}: "
                                 f"'custom_id' must be unique")
        self._offsets = offsets
        return offsets

    def _lines(self, start: int = 0, digest=None) -> Iterator[tuple[int, int, bytes]]:
        """(1-based line number, byte offset, line) of each non-blank line, from byte offset start; every byte read
        goes into `digest` too, when given."""
        self.file.seek(start)
        offset, line_number, limit = start, 0, self.limits.max_line_bytes
        while line := self.file.readline(limit + 1):
            line_number += 1
            if digest is not None:
                digest.update(line)
            if len(line) > limit and not line.endswith(b"\n"):
                raise InputError(f"line {line_number} of {self.name} is longer than the limit max_line_bytes={limit:,}")
            if line.strip():
                yield line_number, offset, line
            offset += len(line)

    def read(self, start: int, end: int) -> Iterator[Request | RowError]:
        offsets = self._index()
        if start >= min(end, len(offsets)):
            return
        row = start
        for _, _, line in self._lines(offsets[start]):
            if row >= end:
                return
            yield parse_line(row, line)
            row += 1

    def close(self) -> None:
        self.file.close()


def models_named(file: IO[bytes], max_line_bytes: int = Limits.max_line_bytes) -> dict[Any, tuple[int, int]]:
    """The `model` each row's body names (None: none), with its row count and first line: one streaming pass, for
    choosing a job's model before it is made. Lines that do not parse are left to the job's validation."""
    named: dict[Any, tuple[int, int]] = {}
    line_number = 0
    while line := file.readline(max_line_bytes + 1):
        line_number += 1
        if not line.strip() or len(line) > max_line_bytes:
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        body = value.get("body") if isinstance(value, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        model = model if model is None or isinstance(model, str) else repr(model)
        count, first = named.get(model, (0, line_number))
        named[model] = (count + 1, first)
    return named


def _peek_custom_id(line: bytes) -> str | None:
    return _peek(line)[0]


def _peek(line: bytes) -> tuple[str | None, Any]:
    """A line's custom_id (None: none, or not a string) and the model its body names (None: none; not a string:
    its repr), as `models_named` counts them."""
    try:
        value = json.loads(line)
    except ValueError:
        return None, None
    if not isinstance(value, dict):
        return None, None
    custom_id, body = value.get("custom_id"), value.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return (custom_id if isinstance(custom_id, str) else None,
            model if model is None or isinstance(model, str) else repr(model))


def parse_line(row: int, line: bytes) -> Request | RowError:
    try:
        value: Any = json.loads(line)
    except ValueError as error:
        return RowError(row, None, "invalid_json", f"line is not valid JSON: {error}")
    return parse_value(row, value)


def parse_value(row: int, value: Any) -> Request | RowError:
    """A line's decoded JSON as a request, or the row's error."""
    if not isinstance(value, dict):
        return RowError(row, None, "invalid_json", f"line must be a JSON object, got {type(value).__name__}")
    custom_id = value.get("custom_id")
    if error := check_custom_id(row, custom_id):
        return error
    if value.get("method", "POST") != "POST":
        return RowError(row, custom_id, "invalid_request", f"method must be POST, got {value.get('method')!r}")
    url, body = value.get("url"), value.get("body")
    if url not in ENDPOINTS:
        return RowError(row, custom_id, "invalid_request", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if not isinstance(body, dict):
        return RowError(row, custom_id, "invalid_request", "body must be a JSON object")
    if url == EMBEDDINGS:
        return parse_embedding_body(row, custom_id, body)
    if url == RESPONSES:
        return parse_responses_body(row, custom_id, body)
    if unsupported := check_unsupported(row, custom_id, body):
        return unsupported
    params, model = pick_params(body), body.get("model")
    if url == CHAT:
        messages = parse_messages(row, custom_id, body.get("messages"))
        return messages if isinstance(messages, RowError) else Request(row, custom_id, url, messages=messages,
                                                                        params=params, model=model, openai=True)
    prompt = parse_prompt(row, custom_id, body.get("prompt"))
    return prompt if isinstance(prompt, RowError) else Request(row, custom_id, url, prompt=prompt, params=params,
                                                               model=model, openai=True)
