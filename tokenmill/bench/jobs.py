"""`tokenmill bench jobs`: the same chat rows as a job of one shard and as a job of small shards, both through
the local job runner (`tokenmill run`'s path: SQLite and a local folder in a temporary directory) on one
engine. Completion tokens per second of each, their ratio, and whether the outputs are identical."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from storage.formats import CHAT
from tokenmill.bench.workload import mixed_chat_questions


@dataclass
class JobRun:
    label: str
    shard_size: int
    shards: int
    seconds: float
    completion_tokens: int
    outputs: dict[str, str]  # custom_id -> text

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds


def write_rows(path: Path, num_rows: int, min_tokens: int, max_tokens: int, seed: int = 0,
               sampling: str = "greedy") -> Path:
    """OpenAI Batch JSONL rows of the mixed chat workload, each with its forced output length; `sampling` "seeded":
    each row at temperature 1 with its own seed (else greedy, the job's default)."""
    texts, lengths = mixed_chat_questions(num_rows, min_tokens, max_tokens, seed)
    with open(path, "w") as f:
        for index, (text, length) in enumerate(zip(texts, lengths, strict=True)):
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": length}
            if sampling == "seeded":
                body.update(temperature=1.0, seed=index)
            f.write(json.dumps({"custom_id": f"row-{index:04d}", "method": "POST", "url": CHAT, "body": body}) + "\n")
    return path


def run_job_once(engine, rows: Path, workdir: Path, shard_size: int, label: str) -> JobRun:
    """One job over `rows` in `shard_size` shards, greedy, EOS ignored; timed from submit to completed."""
    from ingest.intake import submit
    from ingest.job_request import JobRequest
    from storage import db, migrate
    from storage.formats import read_part
    from storage.job_settings import LOCAL
    from storage.objectstore import open_store
    from workers.inprocess import run_job

    url = f"sqlite:///{workdir / f'{label}.db'}"
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    output = workdir / f"out-{label}"
    request = JobRequest(input_uri=str(rows), output_uri=str(output), shard_size=shard_size,
                         sampling={"temperature": 0.0, "ignore_eos": True})
    engine.kv_manager.pool.reset_prefix_cache()
    started = time.perf_counter()
    job = submit(sessions, request.to_job(executor=LOCAL)).job
    job = run_job(sessions, job.id, lambda settings: engine)
    seconds = time.perf_counter() - started
    if job.status != "completed":
        raise RuntimeError(f"the {label} job ended {job.status}: {job.error}")
    store = open_store(str(output))
    records = [r for key in store.list() if key.startswith("part-") for r in read_part(store, key).to_pylist()]
    sessions.kw["bind"].dispose()
    return JobRun(label, shard_size, -(-len(records) // shard_size), seconds,
                  sum(r["completion_tokens"] for r in records), {r["custom_id"]: r["text"] for r in records})


def compare(engine, num_rows: int, shard_size: int, min_tokens: int, max_tokens: int,
            sampling: str = "greedy") -> tuple[JobRun, JobRun]:
    """(one shard, shards of `shard_size`) over the same rows (`write_rows`' `sampling`), after an untimed warm-up
    job."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-jobs-") as directory:
        workdir = Path(directory)
        warm = write_rows(workdir / "warm.jsonl", 4, 2, 4, seed=1)
        run_job_once(engine, warm, workdir, 2, "warm-up")
        rows = write_rows(workdir / "rows.jsonl", num_rows, min_tokens, max_tokens, sampling=sampling)
        whole = run_job_once(engine, rows, workdir, num_rows, "one-shard")
        sharded = run_job_once(engine, rows, workdir, shard_size, f"shards-of-{shard_size}")
    return whole, sharded
