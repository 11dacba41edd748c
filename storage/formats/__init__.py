"""Input readers (Parquet, OpenAI Batch JSONL) and output writers. A reader yields, for each row in a
range, either a `Request` or a `RowError`; file-level problems raise `InputError` before rows are read."""

from __future__ import annotations

from typing import Protocol

from storage.formats.jsonl import JsonlInput
from storage.formats.outputs import (
    BATCH_OUTPUT_KEY,
    ERRORS_KEY,
    MANIFEST_KEY,
    PART_SCHEMA,
    batch_output_line,
    embedding_part_schema,
    error_record,
    line_error,
    part_key,
    read_part,
    write_jsonl,
    write_manifest,
    write_part,
)
from storage.formats.parquet import MAGIC, ParquetInput
from storage.formats.rows import CHAT, COMPLETIONS, EMBEDDINGS, ENDPOINTS, InputError, Limits, Request, RowError
from storage.objectstore import ObjectStore

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

__all__ = [
    "BATCH_OUTPUT_KEY", "CHAT", "COMPLETIONS", "EMBEDDINGS", "ENDPOINTS", "ERRORS_KEY", "MANIFEST_KEY", "PART_SCHEMA",
    "embedding_part_schema", "InputError", "InputReader", "JsonlInput", "Limits", "ParquetInput", "Request", "RowError",
    "batch_output_line", "error_record", "line_error", "open_input", "part_key", "read_part", "write_jsonl",
    "write_manifest", "write_part",
]


class InputReader(Protocol):
    format: str
    sha256: str | None  # the whole file's, when `validate` read it through (JSONL)

    @property
    def num_rows(self) -> int: ...

    def validate(self) -> None: ...

    def read(self, start: int, end: int): ...

    def close(self) -> None: ...


def open_input(store: ObjectStore, key: str, limits: Limits | None = None, pin: dict | None = None,
               task: str = "generate") -> InputReader:
    """A reader for store/key: JSONL by suffix (.jsonl, .ndjson, .json) or by a leading '{', else Parquet (whose
    columns depend on the job's `task`: generate or embed). With `pin` (the input's version at validation) it
    reads that version or raises `InputChanged`."""
    limits = limits or Limits()
    try:
        size = store.size(key)
        file = store.open(key) if pin is None else store.open_pinned(key, pin)
    except FileNotFoundError:
        raise InputError(f"input {store.uri_of(key)} does not exist") from None
    try:
        if key.lower().endswith(JSONL_SUFFIXES) or _starts_like_json(file):
            return JsonlInput(file, limits, size, name=key)
        return ParquetInput(file, limits, name=key, task=task)
    except BaseException:
        file.close()
        raise


def _starts_like_json(file) -> bool:
    head = file.read(64)
    file.seek(0)
    return not head.startswith(MAGIC) and head.lstrip()[:1] == b"{"
