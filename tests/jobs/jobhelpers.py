"""Helpers for the job tests: input files and reading a job's outputs back."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ingest.job_request import JobRequest, NewJob
from storage.formats import ERRORS_KEY, MANIFEST_KEY, Limits, read_part
from storage.job_settings import LOCAL
from storage.objectstore import ObjectStore, S3Options


def new_job(input_uri: str, output_uri: str, model: str = "smollm2-135m", *, executor: str = LOCAL,
            limits: Limits | None = None, s3: S3Options | None = None, **fields) -> NewJob:
    """A job for `ingest.intake.submit`, as `tokenmill run` makes it (fields are JobRequest's)."""
    request = JobRequest(input_uri=str(input_uri), output_uri=str(output_uri), model=model, **fields)
    return request.to_job(executor=executor, limits=limits or Limits(), s3=s3)


def no_engine(settings):
    raise AssertionError("the engine must not be loaded for a job that fails validation")


def write_parquet(path: Path, columns: dict[str, list], row_group_size: int | None = None,
                  schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=row_group_size)
    return path


def prompt_rows(count: int, prefix: str = "row") -> dict[str, list]:
    return {"custom_id": [f"{prefix}-{i:04d}" for i in range(count)],
            "prompt": [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(count)]}


def read_outputs(store: ObjectStore) -> tuple[list[dict], list[dict], dict]:
    """(result rows from all part files, error records, manifest)."""
    parts = [key for key in store.list() if key.startswith("part-")]
    results = [row for key in parts for row in read_part(store, key).to_pylist()]
    errors = [json.loads(line) for line in store.get_bytes(ERRORS_KEY).decode().splitlines()]
    return results, errors, json.loads(store.get_bytes(MANIFEST_KEY))


def assert_each_id_once(store: ObjectStore, expected_ids: list[str]) -> tuple[list[dict], list[dict], dict]:
    """Every input custom_id appears exactly once across the part files and the error file, and the part files
    are exactly those the manifest lists (no part that nothing committed)."""
    results, errors, manifest = read_outputs(store)
    listed = sorted(part["key"] for part in manifest["files"]["parts"])
    assert sorted(k for k in store.list() if k.startswith("part-")) == listed, "a part file outside the manifest"
    seen = Counter([r["custom_id"] for r in results] + [e["custom_id"] for e in errors])
    duplicated = sorted(k for k, n in seen.items() if n > 1)
    missing = sorted(set(expected_ids) - set(seen))
    assert not duplicated and not missing, f"duplicated: {duplicated[:5]}, missing: {missing[:5]}"
    assert set(seen) == set(expected_ids)
    return results, errors, manifest


def shard_rows(database: Path) -> dict[int, tuple]:
    """{index: (status, attempts, started_at, finished_at)}, read-only; {} until the schema exists."""
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as connection:
            rows = connection.execute("SELECT \"index\", status, attempts, started_at, finished_at FROM shards")
            return {index: tuple(rest) for index, *rest in rows}
    except sqlite3.OperationalError:
        return {}


def wait_for_a_completed_shard(process: subprocess.Popen, database: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "tokenmill run ended before any shard was seen completed"
        if any(status == "completed" for status, *_ in shard_rows(database).values()):
            return
        time.sleep(0.05)
    raise AssertionError("no shard completed in time")
