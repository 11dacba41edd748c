"""Embedding jobs through the bundled all-MiniLM-L6-v2: a Parquet `text` column (task embed) and OpenAI
`/v1/embeddings` JSONL rows become part files of float32 vectors and OpenAI embeddings responses, every
custom_id exactly once; row-level problems fail their rows with a message."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from ingest.intake import submit
from storage.formats import BATCH_OUTPUT_KEY, read_part
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job, no_engine, read_outputs, write_parquet
from tokenmill.bench.sentences import held_out_sentences
from workers.inprocess import run_job

MODEL = "all-minilm-l6-v2"
pytestmark = pytest.mark.real_model  # the bundled embedding model
LONG_TEXT = " ".join(held_out_sentences(40, seed=3))  # over 256 tokens


@pytest.fixture(scope="module")
def embedding_engine():
    from engine import EngineConfig
    from engine.embedding_engine import EmbeddingEngine

    return EmbeddingEngine(EngineConfig(model=MODEL, dtype="float32", num_threads=2))


def each_row_once(store, ids: list[str]) -> tuple[list[dict], list[dict]]:
    """As assert_each_id_once, for part rows of one record per input (a row's first input counts it)."""
    results, errors, _ = read_outputs(store)
    firsts = [r["custom_id"] for r in results if r["input_index"] == 0]
    assert sorted(firsts + [e["custom_id"] for e in errors]) == sorted(ids)
    return results, errors


def run(sessions, engine, input_path: Path, output: Path, **fields):
    job = submit(sessions, new_job(str(input_path), str(output), MODEL, **fields)).job
    return run_job(sessions, job.id, lambda settings: engine)


def test_parquet_text_column(sessions, embedding_engine, tmp_path: Path) -> None:
    texts = held_out_sentences(20, seed=11)
    ids = [f"s-{i}" for i in range(20)] + ["empty", "too-long"]
    path = write_parquet(tmp_path / "in.parquet", {"custom_id": ids, "text": texts + [None, LONG_TEXT]},
                         row_group_size=8)
    job = run(sessions, embedding_engine, path, tmp_path / "out", task="embed", shard_size=8, openai_output=True)
    assert job.status == "completed", job.error
    store = open_store(str(tmp_path / "out"))
    results, errors, manifest = assert_each_id_once(store, ids)
    assert {e["custom_id"]: e["code"] for e in errors} == {"empty": "missing_input",
                                                          "too-long": "context_length_exceeded"}
    assert "max_seq_length of 256" in next(e["message"] for e in errors if e["custom_id"] == "too-long")
    part = read_part(store, manifest["files"]["parts"][0]["key"])
    assert part.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    alone = embedding_engine.embed_token_ids([embedding_engine.encode(texts[3])])[0].numpy()
    vector = np.array(next(r["embedding"] for r in results if r["custom_id"] == "s-3"))
    assert float(vector @ alone / np.linalg.norm(alone)) > 0.99999
    assert manifest["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in results) > 0
    assert manifest["counts"] == {"total": 22, "completed": 20, "failed": 2}
    line = json.loads(store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()[0])
    assert line["response"]["body"]["data"][0]["object"] == "embedding"


def test_openai_jsonl_embeddings(sessions, embedding_engine, tmp_path: Path) -> None:
    def row(custom_id, url="/v1/embeddings", **body):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}

    rows = [row("one", input="The cat sat on the mat."),
            row("two-base64", input=["First text.", "Second, longer text here."], encoding_format="base64"),
            row("dims", input="x", dimensions=128),
            row("other-model", input="x", model="text-embedding-3-small"),
            row("chat", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
            row("long", input=LONG_TEXT),
            row("bad-format", input="x", encoding_format="int8")]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = run(sessions, embedding_engine, path, tmp_path / "out", openai_output=True)
    assert job.status == "completed", job.error
    store = open_store(str(tmp_path / "out"))
    results, errors = each_row_once(store, [r["custom_id"] for r in rows])
    codes = {e["custom_id"]: (e["code"], e["message"]) for e in errors}
    assert codes["dims"] == ("invalid_parameter", f"model {MODEL} does not support 'dimensions' (it is not a "
                                                  "Matryoshka model): its embeddings have 384 dimensions")
    assert codes["other-model"][0] == "model_not_found"
    assert codes["chat"][0] == "invalid_request" and "embeds" in codes["chat"][1]
    assert codes["long"][0] == "context_length_exceeded" and codes["bad-format"][0] == "invalid_parameter"

    lines = {json.loads(x)["custom_id"]: json.loads(x) for x in store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()}
    one = lines["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == MODEL and len(one["data"][0]["embedding"]) == 384
    assert one["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    two = lines["two-base64"]["response"]["body"]
    assert [d["index"] for d in two["data"]] == [0, 1]
    decoded = np.frombuffer(base64.b64decode(two["data"][1]["embedding"]), dtype="<f4")
    stored = next(r["embedding"] for r in results if r["custom_id"] == "two-base64" and r["input_index"] == 1)
    assert np.array_equal(decoded, np.array(stored, dtype=np.float32))
    assert lines["dims"]["error"] is None and lines["dims"]["response"]["status_code"] == 400
    assert lines["dims"]["response"]["body"]["error"]["code"] == "invalid_parameter"

    truncated = run(sessions, embedding_engine, path, tmp_path / "out-cut", truncate_inputs=True)
    _, errors = each_row_once(open_store(str(tmp_path / "out-cut")), [r["custom_id"] for r in rows])
    assert truncated.status == "completed" and "long" not in {e["custom_id"] for e in errors}


@pytest.mark.parametrize(("task", "columns", "message"), [
    ("generate", {"custom_id": ["a"], "text": ["x"]}, "a 'text' column is embedding input: run the job with task"),
    ("embed", {"custom_id": ["a"], "prompt": ["x"]}, "an embedding job's input needs a 'text' column"),
])
def test_input_columns_fit_the_task(sessions, tmp_path: Path, task, columns, message) -> None:
    path = write_parquet(tmp_path / "in.parquet", columns)
    job = submit(sessions, new_job(str(path), str(tmp_path / "out"), MODEL, task=task)).job
    job = run_job(sessions, job.id, no_engine)
    assert job.status == "failed" and message in job.error
