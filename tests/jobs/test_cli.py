"""The command line: the README's first command (`tokenmill run` on the bundled sample) on a fresh machine,
`jobs`, `status --json`, `cancel` and `db`."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from storage import migrate
from storage.objectstore import LocalStore
from tests.jobs.jobhelpers import (
    assert_each_id_once,
    prompt_rows,
    shard_rows,
    wait_for_a_completed_shard,
    write_parquet,
)
from tokenmill.cli import main

# The README command with settings that keep it quick on 2 cores: 4 tokens per prompt, a small KV pool; greedy,
# so answers run to the lengths the tests time their cancels by.
FAST = ["--max-tokens", "4", "--threads", "2", "--kv-cache-memory", "0.25", "--temperature", "0"]


def tokenmill(*args: str, cwd: Path, data: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_DATABASE_URL"}
    env["TOKENMILL_DATA"] = str(data)
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.real_model
def test_readme_first_command_runs_the_sample_job(tmp_path: Path) -> None:
    data = tmp_path / "home" / ".local" / "share" / "tokenmill"  # nothing exists there yet
    run = tokenmill("run", *FAST, cwd=tmp_path, data=data)
    assert run.returncode == 0, run.stderr[-3000:]
    output, database = tmp_path / "tokenmill-output" / "sample", data / "tokenmill.db"
    assert "completed: 40 rows, 40 completed, 0 failed" in run.stdout
    assert f"outputs:  {output}" in run.stdout
    assert f"database: {database}" in run.stdout
    sample_ids = pq.read_table(Path(__file__).parents[2] / "tokenmill" / "data" / "sample.parquet",
                               columns=["custom_id"]).column(0).to_pylist()
    assert len(sample_ids) == 40
    results, errors, manifest = assert_each_id_once(LocalStore(output), sample_ids)
    assert errors == [] and manifest["counts"]["completed"] == 40
    job_id = manifest["job_id"]

    listing = tokenmill("jobs", cwd=tmp_path, data=data)
    assert listing.returncode == 0 and job_id[:8] in listing.stdout and "completed" in listing.stdout
    status = tokenmill("status", job_id[:8], "--json", cwd=tmp_path, data=data)
    document = json.loads(status.stdout)
    assert document["job"]["id"] == job_id and document["job"]["status"] == "completed"
    assert document["job"]["requests_completed"] == 40
    assert [s["status"] for s in document["shards"]] == ["completed"]

    again = tokenmill("run", *FAST, cwd=tmp_path, data=data)  # the same command: the same, finished job
    assert again.returncode == 0 and f"job {job_id} (finished)" in again.stdout
    assert "loading" not in again.stderr  # nothing to do, so no model either


@pytest.mark.real_model
def test_cancel_command_stops_a_running_job(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = write_parquet(tmp_path / "in.parquet", prompt_rows(24))
    database = tmp_path / "jobs.db"
    url = f"sqlite:///{database}"
    command = [sys.executable, "-m", "tokenmill", "run", str(source), "--output", str(tmp_path / "out"),
               "--database-url", url, "--shard-size", "2", "--max-num-seqs", "2", *FAST,
               "--max-tokens", "32"]  # ~2 shards in flight; rows long enough that the cancel lands mid-job
    with open(tmp_path / "run.log", "w") as log:
        running = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_a_completed_shard(running, database)
            with sqlite3.connect(database) as connection:
                job_id = connection.execute("SELECT id FROM jobs").fetchone()[0]
            assert main(["cancel", job_id[:8], "--database-url", url]) == 0
            assert "cancelling; the running process stops at its next step" in capsys.readouterr().out
            assert running.wait(timeout=60) == 1, "tokenmill run should stop by itself, soon"
        finally:
            running.kill()
            running.wait()
    assert f"job {job_id} cancelled" in (tmp_path / "run.log").read_text()
    shards = shard_rows(database)
    kept = [i for i, (status, *_) in shards.items() if status == "completed"]
    assert kept and len(kept) < len(shards)
    assert all(status in ("completed", "cancelled") for status, *_ in shards.values())
    assert all(list((tmp_path / "out").glob(f"part-{i:05d}-{job_id}-c*.parquet")) for i in kept)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_db_commands(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "current", "--database-url", url]) == 0
    assert "at revision base (empty)" in capsys.readouterr().out
    assert main(["db", "upgrade", "--database-url", url]) == 0
    assert f"at revision {migrate.head_revision()}" in capsys.readouterr().out
    assert main(["db", "current", "--database-url", url]) == 0
    assert "(up to date)" in capsys.readouterr().out
    assert main(["jobs", "--database-url", url]) == 0
    assert "no jobs yet" in capsys.readouterr().out
    assert main(["status", "nope", "--database-url", url]) == 2
    assert "no job matches 'nope'" in capsys.readouterr().err
    assert main(["db", "downgrade", "base", "--database-url", url]) == 0
    assert "at revision base (empty)" in capsys.readouterr().out


def test_run_refuses_an_output_with_dot_dot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    code = main(["run", "--output", str(tmp_path / "a" / ".." / ".." / "x"), "--database-url", url])
    assert code == 2 and "contains a '..' segment" in capsys.readouterr().err
