"""Output files under a job's output prefix: `part-NNNNN.parquet`, `errors.jsonl`, the optional OpenAI Batch
output `batch_output.jsonl`, and `manifest.json` (written last; its presence means the job is complete)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.formats.responses import responses_body
from storage.formats.rows import CHAT, EMBEDDINGS, RESPONSES, RowError
from storage.objectstore import ObjectStore

ERRORS_KEY = "errors.jsonl"
MANIFEST_KEY = "manifest.json"
BATCH_OUTPUT_KEY = "batch_output.jsonl"
# error codes of requests a batch never ran, written as OpenAI writes them: a top-level `error`, no `response`
BATCH_ERROR_CODES = frozenset({"batch_cancelled", "batch_expired", "batch_failed"})
SERVER_ERROR_CODES = frozenset({"engine_error", "server_error"})  # a request's failure that is not its own fault

PART_SCHEMA = pa.schema([
    pa.field("custom_id", pa.string(), nullable=False),
    pa.field("text", pa.string()),
    pa.field("finish_reason", pa.string()),  # stop | length
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("cached_tokens", pa.int32()),  # prompt tokens served from the prefix cache
    pa.field("ttft_ms", pa.float64()),  # time to first token, from when the request entered the engine
    pa.field("latency_ms", pa.float64()),  # from entering the engine to the last token
    pa.field("row_index", pa.int64()),  # 0-based row of the input
    pa.field("endpoint", pa.string()),  # /v1/chat/completions, /v1/completions or /v1/responses
    pa.field("logprobs", pa.string()),  # when the row asked for logprobs: OpenAI's choice.logprobs as JSON text
    pa.field("choice_index", pa.int32()),  # which of the row's n completions (one part row each)
    pa.field("model", pa.string()),  # the name the row asked for (an alias, an adapter); null: the job's model
    pa.field("stop_reason", pa.string()),  # the stop string that ended it; null: end of sequence, length, or unknown
    pa.field("request_echo", pa.string()),  # /v1/responses rows: the request fields its Response repeats (JSON text)
])


def embedding_part_schema(size: int | None) -> pa.Schema:
    """An embedding job's part rows: one per input (a row of the OpenAI endpoint may hold several, `input_index`);
    `embedding` is a fixed-size list of float32 (a variable one when rows asked for other `dimensions`)."""
    vector = pa.list_(pa.float32(), size) if size else pa.list_(pa.float32())
    return pa.schema([
        pa.field("custom_id", pa.string(), nullable=False),
        pa.field("embedding", vector),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("latency_ms", pa.float64()),  # from entering the engine to its vector
        pa.field("row_index", pa.int64()),  # 0-based row of the input
        pa.field("input_index", pa.int32()),  # which of the row's inputs
        pa.field("endpoint", pa.string()),  # /v1/embeddings
        pa.field("encoding_format", pa.string()),  # float | base64: how batch_output.jsonl writes it
        pa.field("model", pa.string()),  # the name the row asked for; null: the job's model
    ])


def part_key(index: int, job_id: str, claim: int) -> str:
    """A shard's part file, unique to the job and the claim: a stale worker (of this job, or of an earlier job on
    the same prefix) can neither replace the part the database committed (the shard row's `output_key`) nor
    delete it when it cleans up after itself."""
    return f"part-{index:05d}-{job_id}-c{claim}.parquet"


def write_part(store: ObjectStore, index: int, records: list[dict[str, Any]], job_id: str, claim: int,
               embedding_size: int | None = None) -> str:
    """One shard's results, in input order, written once (atomically) under its claim's key. Returns the key.
    `embedding_size`: an embedding job's part (the model's vector size)."""
    if embedding_size is None:
        schema = PART_SCHEMA
        records = sorted(records, key=lambda r: (r["row_index"], r["choice_index"]))
    else:
        same = all(len(r["embedding"]) == embedding_size for r in records)
        schema = embedding_part_schema(embedding_size if same else None)
        records = sorted(records, key=lambda r: (r["row_index"], r["input_index"]))
    table = pa.Table.from_pylist(records, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    key = part_key(index, job_id, claim)
    store.put_bytes(key, sink.getvalue().to_pybytes())
    return key


def read_part(store: ObjectStore, key: str) -> pa.Table:
    with store.open(key) as f:
        return pq.read_table(f)


def error_record(error: RowError) -> dict[str, Any]:
    return {"custom_id": error.custom_id, "row_index": error.row, "code": error.code, "message": error.message}


@contextmanager
def spooled_upload(store: ObjectStore, key: str) -> Iterator[Any]:
    """A local temp file to write into; uploaded (atomically) as key when the block ends without error."""
    fd, path = tempfile.mkstemp(prefix="tokenmill-", suffix=os.path.splitext(key)[1])
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        store.put_file(key, path)
    finally:
        os.unlink(path)


def write_jsonl(store: ObjectStore, key: str, records: Iterable[dict[str, Any]]) -> int:
    count = 0
    with spooled_upload(store, key) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_manifest(store: ObjectStore, manifest: dict[str, Any]) -> None:
    store.put_bytes(MANIFEST_KEY, (json.dumps(manifest, indent=2, default=str) + "\n").encode())


def batch_output_line(job_id: str, model: str, record: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """One line of the OpenAI Batch output file, for a row's result records (its part rows, one per choice)
    or its error record: a failed request as an HTTP error `response` (`failed_response`), one the batch never ran
    as a top-level `error`."""
    records = record if isinstance(record, list) else [record]
    record = records[0]
    row_index = record["row_index"]
    line_id = f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, f'{job_id}/{row_index}').hex}"
    if "code" in record:
        if record["code"] in BATCH_ERROR_CODES:  # a request the batch never ran: OpenAI's top-level error
            return {"id": line_id, "custom_id": record["custom_id"], "response": None,
                    "error": {"code": record["code"], "message": record["message"]}}
        return {"id": line_id, "custom_id": record["custom_id"], "error": None,
                "response": failed_response(line_id, record["code"], record["message"])}
    model = record.get("model") or model  # OpenAI's bodies name the model the request asked for
    body = BODY_OF.get(record["endpoint"], _completion_body)(model, records)
    return {"id": line_id, "custom_id": record["custom_id"], "error": None,
            "response": {"status_code": 200, "request_id": line_id, "body": body}}


def failed_response(request_id: str, code: str, message: str) -> dict[str, Any]:
    """A failed request's `response`, as OpenAI's API would have answered it: 500 `server_error` for a failure of
    the server or engine, 404 for an unknown model, else 400 `invalid_request_error`."""
    if code in SERVER_ERROR_CODES:
        status, kind = 500, "server_error"
    else:
        status, kind = 404 if code == "model_not_found" else 400, "invalid_request_error"
    return {"status_code": status, "request_id": request_id,
            "body": {"error": {"message": message, "type": kind, "param": None, "code": code}}}


def line_error(line: dict[str, Any]) -> dict[str, Any] | None:
    """A batch output line's error (`code`, `message`): its top-level `error`, or its failed response's; None for
    a line that succeeded."""
    if line.get("error") is not None:
        return line["error"]
    response = line.get("response") or {}
    if response.get("status_code", 200) < 400:
        return None
    error = (response.get("body") or {}).get("error") or {}
    return {"code": error.get("code") or error.get("type"), "message": error.get("message", "")}


def _embeddings_body(model: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's embeddings response: one `data` item per input, in input order."""
    import base64

    import numpy as np

    def vector(record: dict[str, Any]) -> list[float] | str:
        if record["encoding_format"] == "base64":  # little-endian float32 bytes, as OpenAI's
            return base64.b64encode(np.asarray(record["embedding"], dtype="<f4").tobytes()).decode()
        return record["embedding"]

    tokens = sum(r["prompt_tokens"] for r in records)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": r["input_index"], "embedding": vector(r)} for r in records],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _choice(record: dict[str, Any], chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": record.get("choice_index") or 0, "finish_reason": record["finish_reason"]}
    if record.get("stop_reason"):  # which stop string ended it, as vLLM's server says it
        choice["stop_reason"] = record["stop_reason"]
    logprobs = json.loads(record["logprobs"]) if record.get("logprobs") else None
    if chat:
        choice.update(message={"role": "assistant", "content": record["text"]}, logprobs=logprobs)
    else:
        choice.update(text=record["text"], logprobs=logprobs)
    return choice


def _completion_body(model: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    record = records[0]
    chat = record["endpoint"] == CHAT
    prompt, completion = record["prompt_tokens"], sum(r["completion_tokens"] for r in records)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(r, chat) for r in records],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": record["cached_tokens"]}},
    }


# a result line's body by its row's endpoint (chat and completions: `_completion_body`)
BODY_OF = {EMBEDDINGS: _embeddings_body, RESPONSES: responses_body}
