"""The validating step reads a JSONL input once: its index, its duplicate check, its hash (a local input's pin)
and the models its rows name come from one pass; `tokenmill run`, which reads the file before the job is made to
pick its model, hands that read to the job, whose validating step then reads nothing again. No model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ingest.intake import submit
from storage.formats import Limits
from storage.formats.jsonl import models_named
from storage.objectstore import LocalStore
from tests.jobs.jobhelpers import new_job
from workers.job_steps import JobSteps, read_input


def write_input(path: Path, count: int) -> Path:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "smollm2-135m" if i % 2 else "other", "prompt": f"say {i}", "max_tokens": 2}}
             for i in range(count)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    return path


@pytest.fixture
def bytes_read(monkeypatch) -> dict[str, int]:
    """Bytes read through LocalStore.open, by file name."""
    counts: dict[str, int] = {}
    original = LocalStore.open

    class Counting:
        def __init__(self, file, name: str) -> None:
            self.file, self.name = file, name

        def read(self, *args):
            data = self.file.read(*args)
            counts[self.name] = counts.get(self.name, 0) + len(data)
            return data

        def readline(self, *args):
            data = self.file.readline(*args)
            counts[self.name] = counts.get(self.name, 0) + len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(LocalStore, "open", lambda store, key, *a, **k: Counting(original(store, key, *a, **k), key))
    return counts


def test_one_validating_pass_gives_the_index_the_hash_and_the_models(tmp_path, bytes_read) -> None:
    source = write_input(tmp_path / "in.jsonl", 50)
    validated = read_input(str(source), None, Limits())
    assert validated.error is None and validated.reader.num_rows == 50
    assert bytes_read == {"in.jsonl": source.stat().st_size}  # once through
    assert validated.fingerprint["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert validated.fingerprint == LocalStore(tmp_path).pin("in.jsonl")
    with source.open("rb") as file:
        assert validated.reader.models == models_named(file)
    validated.close()


@pytest.mark.parametrize("handed_over", [False, True])
def test_the_validating_step_reads_the_input_once(sessions, tmp_path, bytes_read, handed_over) -> None:
    source = write_input(tmp_path / "in.jsonl", 40)
    job = submit(sessions, new_job(str(source), str(tmp_path / "out"), shard_size=10)).job
    validated = read_input(job.input_uri, job.settings.s3, job.settings.limits) if handed_over else None
    steps = JobSteps(sessions, job.id, validated=validated)
    job = steps.validate()
    assert job.status == "queued" and job.requests_total == 40
    assert job.settings.input_fingerprint["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert bytes_read == {"in.jsonl": source.stat().st_size}
    with sessions() as session:
        shard = min(session.get(type(job), job.id).shards, key=lambda s: s.index)
    rows = steps.read_rows(job, shard)  # a shard reads its rows through the validated reader: no index again
    assert [row.custom_id for row in rows] == [f"r{i}" for i in range(10)]
    steps.close()


def test_an_invalid_input_read_before_the_job_fails_it_with_why(sessions, tmp_path) -> None:
    source = tmp_path / "dup.jsonl"
    line = json.dumps({"custom_id": "same", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    source.write_text(f"{line}\n{line}\n")
    job = submit(sessions, new_job(str(source), str(tmp_path / "out"))).job
    validated = read_input(job.input_uri, job.settings.s3, job.settings.limits)
    assert validated.error is not None
    job = JobSteps(sessions, job.id, validated=validated).validate()
    assert job.status == "failed" and "duplicate custom_id 'same'" in job.error
