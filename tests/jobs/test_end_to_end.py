"""Jobs through the real model, on both stacks: SQLite + a local folder, PostgreSQL + SeaweedFS S3.
Every custom_id must land exactly once in the part files or the error file, and `job_status` must agree."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from sqlalchemy import text

from ingest.intake import submit
from storage import db
from storage import repository as repo
from storage.formats import BATCH_OUTPUT_KEY
from storage.objectstore import S3Options, open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job, prompt_rows, write_parquet
from workers.inprocess import cancel_job, run_job
from workers.progress import NoProgress

pytestmark = pytest.mark.real_model
GREEDY_8 = {"max_tokens": 8, "temperature": 0.0}


def job_status_row(sessions, job_id: str):
    with sessions() as session:
        return session.execute(text("SELECT * FROM job_status WHERE job_id = :id"), {"id": job_id}).one()


def row_level_problems_input(path: Path) -> tuple[Path, dict[str, str]]:
    """Six good rows and one row for each row-level problem, with the message each must produce."""
    ids = [f"ok-{i}" for i in range(6)] + ["null-prompt", "too-long", "negative-max-tokens", "string-temperature"]
    prompts = [f"Count from {i} to {i + 3}:" for i in range(6)] + [None, "word " * 9000, "Hi", "Hello"]
    max_tokens = [None, 2, None, None, None, None, None, None, -5, None]
    temperature = [None] * 9 + ["0.7"]
    schema = pa.schema([("custom_id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int64()),
                        ("temperature", pa.string())])
    write_parquet(path, {"custom_id": ids, "prompt": prompts, "max_tokens": max_tokens,
                         "temperature": temperature}, row_group_size=4, schema=schema)
    return path, {
        "null-prompt": "missing_prompt: prompt is null or empty",
        "too-long": "context_length_exceeded: prompt (9001 tokens) + max_tokens (8) exceeds max_model_len (8192), "
                    "the model's context",
        "negative-max-tokens": "invalid_parameter: max_tokens must be an integer >= 1, got -5",
        "string-temperature": "invalid_parameter: temperature must be a number >= 0, got '0.7'",
    }


def test_sqlite_and_local_folder_with_row_level_problems(sessions, engine_provider, tmp_path: Path) -> None:
    path, expected_errors = row_level_problems_input(tmp_path / "in.parquet")
    output = tmp_path / "out"
    job = submit(sessions, new_job(str(path), str(output), "smollm2-135m", sampling=GREEDY_8, shard_size=4,
                                   openai_output=True)).job
    job = run_job(sessions, job.id, engine_provider)
    assert job.status == "completed", job.error
    store = open_store(str(output))
    ids = [f"ok-{i}" for i in range(6)] + list(expected_errors)
    results, errors, manifest = assert_each_id_once(store, ids)

    assert {e["custom_id"]: f"{e['code']}: {e['message']}" for e in errors} == expected_errors
    assert sorted(store.list()) == ["batch_output.jsonl", "errors.jsonl", "manifest.json",
                                    *(f"part-{i:05d}-{job.id}-c1.parquet" for i in range(3))]
    by_id = {r["custom_id"]: r for r in results}
    assert by_id["ok-1"]["completion_tokens"] <= 2  # the per-row max_tokens override
    assert all(r["finish_reason"] in ("stop", "length") and r["text"] for r in results)
    assert all(0 < r["ttft_ms"] <= r["latency_ms"] for r in results)
    assert [r["row_index"] for r in results] == [0, 1, 2, 3, 4, 5]

    status = job_status_row(sessions, job.id)
    assert (status.requests_total, status.requests_completed, status.requests_failed) == (10, 6, 4)
    assert (status.shards_total, status.shards_completed, status.progress) == (3, 3, 1.0)
    assert status.completion_tokens == sum(r["completion_tokens"] for r in results) > 0
    assert status.tokens_per_s > 0 and status.finished_at is not None
    assert manifest["counts"] == {"total": 10, "completed": 6, "failed": 4}
    assert manifest["tokens"]["completion"] == status.completion_tokens

    lines = [json.loads(line) for line in store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()]
    assert [line["custom_id"] for line in lines] == ids[:6] + ["null-prompt", "too-long", "negative-max-tokens",
                                                              "string-temperature"]
    ok = lines[0]["response"]["body"]
    assert ok["object"] == "text_completion" and ok["choices"][0]["text"] == by_id["ok-0"]["text"]
    assert lines[6]["error"] is None and lines[6]["response"]["status_code"] == 400
    assert lines[6]["response"]["body"]["error"]["code"] == "missing_prompt"


def test_openai_batch_jsonl_input(sessions, engine_provider, tmp_path: Path) -> None:
    lines = [{"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a color."}],
                       "max_completion_tokens": 4}},
             {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "The sky is", "max_tokens": 3}},
             {"custom_id": "bad-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = run_job(sessions, submit(sessions, new_job(str(path), str(tmp_path / "out"), "smollm2-135m",
                                                     sampling=GREEDY_8, openai_output=True)).job.id, engine_provider)
    assert job.status == "completed", job.error
    store = open_store(str(tmp_path / "out"))
    results, errors, _ = assert_each_id_once(store, ["chat-1", "text-1", "bad-1"])
    assert {r["custom_id"]: r["endpoint"] for r in results} == {"chat-1": "/v1/chat/completions",
                                                               "text-1": "/v1/completions"}
    assert all(r["completion_tokens"] <= 4 for r in results)
    assert errors[0]["code"] == "invalid_request"
    batch = [json.loads(line) for line in store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()]
    assert batch[0]["response"]["body"]["object"] == "chat.completion"
    assert batch[0]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"


def test_postgres_and_seaweedfs_s3(pg_url: str, seaweedfs: S3Options, s3_prefix: str, engine_provider,
                                   tmp_path: Path) -> None:
    sessions = db.session_factory(db.make_engine(pg_url))
    rows = 13
    messages = [[{"role": "user", "content": f"Say the number {i}."}] for i in range(rows)]
    messages[6] = None
    path = write_parquet(tmp_path / "chat.parquet", {"custom_id": [f"c-{i:02d}" for i in range(rows)],
                                                      "messages": messages}, row_group_size=4)
    open_store(s3_prefix, seaweedfs).put_file("in/chat.parquet", path)
    spec = new_job(f"{s3_prefix}/in/chat.parquet", f"{s3_prefix}/out", "smollm2-135m", sampling=GREEDY_8,
                   shard_size=5, s3=seaweedfs)  # shards 0-4, 5-9, 10-12 cut across the row groups of 4
    job = run_job(sessions, submit(sessions, spec).job.id, engine_provider)
    assert job.status == "completed", job.error
    store = open_store(f"{s3_prefix}/out", seaweedfs)
    results, errors, manifest = assert_each_id_once(store, [f"c-{i:02d}" for i in range(rows)])
    assert [(e["custom_id"], e["code"]) for e in errors] == [("c-06", "missing_messages")]
    assert [r["custom_id"] for r in results] == [f"c-{i:02d}" for i in range(rows) if i != 6]
    assert manifest["files"]["parts"][2] == {"key": f"part-00002-{job.id}-c1.parquet", "shard": 2, "row_start": 10,
                                             "row_end": 13, "rows": 3}
    status = job_status_row(sessions, job.id)
    assert (status.status, status.requests_total, status.requests_completed, status.requests_failed) == (
        "completed", 13, 12, 1)
    assert (status.shards_total, status.shards_completed) == (3, 3) and status.duration_s > 0
    sessions.kw["bind"].dispose()


class CancelAfterRows(NoProgress):
    """Asks to cancel the job (as `tokenmill cancel` would, from another session) once `rows` rows are done."""

    def __init__(self, sessions, job_id: str, rows: int) -> None:
        self.sessions, self.job_id, self.rows, self.done = sessions, job_id, rows, 0

    def advance(self, rows: int, tokens: int) -> None:
        self.done += rows
        if self.done >= self.rows and self.rows:
            cancel_job(self.sessions, self.job_id)
            self.rows = 0


def test_cancel_aborts_the_shards_in_flight_keeps_finished_ones_and_a_rerun_finishes(
        sessions, engine_provider, llm_engine, tmp_path: Path) -> None:
    """Shard 0's rows are short, so it completes while shards 1 and 2 (all in the engine at once) decode their
    long rows; the cancel then aborts those rows in the engine and ends both shards cancelled."""
    columns = {**prompt_rows(9), "max_tokens": [2] * 3 + [400] * 6}  # long enough to outlast a poll interval
    path = write_parquet(tmp_path / "in.parquet", columns)
    spec = new_job(str(path), str(tmp_path / "out"), "smollm2-135m", sampling={"temperature": 0.0,
                                                                               "ignore_eos": True}, shard_size=3)
    job = submit(sessions, spec).job
    generated = llm_engine.stats.generation_tokens
    job = run_job(sessions, job.id, engine_provider, CancelAfterRows(sessions, job.id, 3))
    assert job.status == "cancelled" and job.cancelling_at <= job.cancelled_at
    assert not llm_engine.has_unfinished_requests(), "the cancelled shards' rows must be aborted in the engine"
    assert llm_engine.stats.generation_tokens - generated < 3 * 2 + 6 * 400, "the long rows ran to their end"
    with sessions() as session:
        before = {s.index: (s.status, s.attempts, s.finished_at) for s in repo.shards(session, job.id)}
    assert before[0][:2] == ("completed", 1)
    assert [before[i][:2] for i in (1, 2)] == [("cancelled", 1), ("cancelled", 1)]
    assert [k for k in open_store(str(tmp_path / "out")).list() if k.startswith("part-")] == [
        f"part-00000-{job.id}-c1.parquet"]
    assert not (tmp_path / "out" / "manifest.json").exists()

    again = submit(sessions, spec)
    assert again.outcome == "retried" and again.job.id == job.id
    job = run_job(sessions, job.id, engine_provider)
    assert job.status == "completed", job.error
    with sessions() as session:
        after = {s.index: (s.status, s.attempts, s.finished_at) for s in repo.shards(session, job.id)}
    assert after[0] == before[0], "the shard finished before the cancel must not run again"
    assert [after[i][:2] for i in (1, 2)] == [("completed", 2), ("completed", 2)]
    assert_each_id_once(open_store(str(tmp_path / "out")), columns["custom_id"])
