"""Parquet input: footer and schema checks first, then row groups streamed one at a time.

Columns: `custom_id` (string) and exactly one of `prompt` (string) or `messages` (list of struct{role,
content}); optional per-row sampling columns (see `rows.PARAM_NAMES`) and `model` (string: the job's model, one of
its served names or a LoRA adapter it serves; null: the job's model). An embedding job (task `embed`) reads
`custom_id` and `text` (string) instead, one vector per row.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from storage.faults import is_transient
from storage.formats.rows import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    PARAM_NAMES,
    UNSUPPORTED_PARAMS,
    InputError,
    Limits,
    Request,
    RowError,
    check_custom_id,
    check_unsupported,
    parse_messages,
    parse_prompt,
    pick_params,
)
from storage.formats.unique import HashedIds, first_duplicate

MAGIC = b"PAR1"
BATCH_ROWS = 1024


class ParquetInput:
    format = "parquet"

    def __init__(self, file: IO[bytes], limits: Limits, name: str = "input", task: str = "generate") -> None:
        self.file, self.limits, self.name, self.task = file, limits, name, task
        self._check_framing()
        try:
            self.parquet = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as error:
            if is_transient(error):  # the object store timed out or throttled: not the file's fault
                raise
            raise InputError(f"{name} is not a readable Parquet file (corrupt footer: {error})") from None
        self._check_footer_limits()
        self.prompt_column = self._check_schema()
        self.columns = ["custom_id", self.prompt_column] + [c for c in (*PARAM_NAMES, *UNSUPPORTED_PARAMS, "model")
                                                            if c in self.column_names and task != "embed"]
        metadata = self.parquet.metadata
        self.row_group_starts = [0]
        for i in range(metadata.num_row_groups):
            self.row_group_starts.append(self.row_group_starts[-1] + metadata.row_group(i).num_rows)

    @property
    def num_rows(self) -> int:
        return self.parquet.metadata.num_rows

    @property
    def column_names(self) -> list[str]:
        return self.parquet.schema_arrow.names

    def _check_framing(self) -> None:
        """Magic bytes at both ends and a footer length that fits, read from the last 8 bytes only."""
        size = self.file.seek(0, 2)
        self.file.seek(0)
        head = self.file.read(4)
        if head != MAGIC:
            raise InputError(f"{self.name} is not a Parquet file: it does not start with the 'PAR1' magic bytes")
        if size < 12:
            raise InputError(f"{self.name} is a truncated Parquet file ({size} bytes, no footer)")
        self.file.seek(size - 8)
        tail = self.file.read(8)
        if tail[4:] != MAGIC:
            raise InputError(f"{self.name} is a truncated Parquet file: it does not end with the 'PAR1' "
                             f"magic bytes, so the footer is missing")
        footer_length = int.from_bytes(tail[:4], "little")
        self.limits.check("max_footer_bytes", footer_length, "Parquet footer size in bytes")
        if footer_length + 12 > size:
            raise InputError(f"{self.name} is a truncated Parquet file: its footer claims {footer_length} bytes "
                             f"but the file has only {size}")
        self.file.seek(0)

    def _check_footer_limits(self) -> None:
        metadata, limits = self.parquet.metadata, self.limits
        limits.check("max_rows", metadata.num_rows, "row count (from the Parquet footer)")
        limits.check("max_row_groups", metadata.num_row_groups, "row group count (from the Parquet footer)")
        sizes = [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]
        limits.check("max_uncompressed_bytes", sum(sizes), "uncompressed size in bytes (from the Parquet footer)")
        limits.check("max_row_group_bytes", max(sizes, default=0), "largest row group in bytes (uncompressed)")

    def _check_schema(self) -> str:
        schema = self.parquet.schema_arrow
        if "custom_id" not in schema.names:
            raise InputError(f"missing required column 'custom_id' (columns: {', '.join(schema.names)})")
        _require(_is_string(schema.field("custom_id").type), "custom_id", "strings", schema)
        if self.task == "embed":
            if "text" not in schema.names:
                raise InputError(f"an embedding job's input needs a 'text' column (columns: {', '.join(schema.names)})")
            _require(_is_string(schema.field("text").type), "text", "strings", schema)
            return "text"
        present = [c for c in ("prompt", "messages") if c in schema.names]
        if len(present) != 1:
            found = "both" if present else "neither"
            hint = "; a 'text' column is embedding input: run the job with task embed" if "text" in schema.names else ""
            raise InputError(f"the input needs exactly one of the columns 'prompt' or 'messages' (found {found}){hint}")
        if "model" in schema.names:
            _require(_is_string(schema.field("model").type), "model", "strings (a model or adapter name)", schema)
        column = present[0]
        if column == "prompt":
            _require(_is_string(schema.field("prompt").type), "prompt", "strings", schema)
        else:
            _require(_is_messages(schema.field("messages").type), "messages",
                     "a list of struct<role: string, content: string>", schema)
        return column

    sha256 = None  # validating reads the footer and one column, not the whole file: the store hashes it

    def validate(self) -> None:
        """File-level checks that need data: `custom_id` must be unique (one column, streamed)."""
        ids = HashedIds()
        for _, custom_id in self._custom_ids():
            if custom_id is not None:
                ids.add(custom_id)
        if (suspects := ids.repeated_hashes()) and (duplicate := first_duplicate(self._custom_ids(), suspects)):
            custom_id, first, row = duplicate
            raise InputError(f"duplicate custom_id {custom_id!r} in rows {first} and {row}: "
                             f"column 'custom_id' must be unique")

    def _custom_ids(self) -> Iterator[tuple[int, str | None]]:
        """(row, custom_id) of every row: one column, streamed a row group at a time."""
        row = 0
        for batch in self._batches(["custom_id"], range(self.parquet.num_row_groups)):
            for custom_id in batch.column(0).to_pylist():
                yield row, custom_id
                row += 1

    def read(self, start: int, end: int) -> Iterator[Request | RowError]:
        """Rows [start, end), reading only the row groups that hold them."""
        first = bisect.bisect_right(self.row_group_starts, start) - 1
        last = bisect.bisect_left(self.row_group_starts, end)
        position = self.row_group_starts[first]
        for batch in self._batches(self.columns, range(first, min(last, self.parquet.num_row_groups))):
            for offset, values in enumerate(batch.to_pylist()):
                row = position + offset
                if start <= row < end:
                    yield self._parse(row, values)
            position += batch.num_rows
            if position >= end:
                return

    def _batches(self, columns: list[str], row_groups: range) -> Iterator[pa.RecordBatch]:
        if not row_groups:
            return
        try:
            yield from self.parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=list(row_groups), columns=columns)
        except (pa.ArrowException, OSError) as error:
            if is_transient(error):
                raise
            raise InputError(f"{self.name}: corrupt Parquet data in row groups "
                             f"{row_groups.start}..{row_groups.stop - 1}: {error}") from None

    def _parse(self, row: int, values: dict) -> Request | RowError:
        custom_id = values["custom_id"]
        if error := check_custom_id(row, custom_id):
            return error
        if unsupported := check_unsupported(row, custom_id, values):
            return unsupported
        if self.prompt_column == "text":
            text = values["text"]
            if not isinstance(text, str) or not text:
                return RowError(row, custom_id, "missing_input", "text is null or empty")
            return Request(row, custom_id, EMBEDDINGS, inputs=[text], params={"encoding_format": "float"})
        params, model = pick_params(values), values.get("model")
        if self.prompt_column == "messages":
            messages = parse_messages(row, custom_id, values["messages"])
            if isinstance(messages, RowError):
                return messages
            return Request(row, custom_id, CHAT, messages=messages, params=params, model=model)
        prompt = parse_prompt(row, custom_id, values["prompt"])
        if isinstance(prompt, RowError):
            return prompt
        return Request(row, custom_id, COMPLETIONS, prompt=prompt, params=params, model=model)

    def close(self) -> None:
        self.file.close()


def _is_string(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def _is_messages(type_: pa.DataType) -> bool:
    if not (pa.types.is_list(type_) or pa.types.is_large_list(type_)):
        return False
    item = type_.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return "role" in names and "content" in names and _is_string(names["role"]) and _is_string(names["content"])


def _require(ok: bool, column: str, expected: str, schema: pa.Schema) -> None:
    if not ok:
        raise InputError(f"column {column!r} must hold {expected}, but its type is {schema.field(column).type}")
