"""Crash test: `tokenmill run` is SIGKILLed mid-job with several shards in flight (their rows in the engine at
once); the same command again resumes the same job, does not recompute finished shards, and the outputs hold
every custom_id exactly once."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from storage.objectstore import LocalStore
from tests.jobs.jobhelpers import (
    assert_each_id_once,
    prompt_rows,
    shard_rows,
    wait_for_a_completed_shard,
    write_parquet,
)

pytestmark = pytest.mark.real_model
ROWS, SHARD_SIZE = 40, 4


def test_sigkill_with_shards_in_flight_then_the_same_command_resumes(tmp_path: Path) -> None:
    # every shard is in the engine at once; later shards decode longer, so they finish one after another
    columns = {**prompt_rows(ROWS), "max_tokens": [2 + 8 * (row // SHARD_SIZE) for row in range(ROWS)]}
    source = write_parquet(tmp_path / "prompts.parquet", columns)
    output, database = tmp_path / "out", tmp_path / "jobs.db"
    command = [sys.executable, "-m", "tokenmill", "run", str(source), "--output", str(output),
               "--database-url", f"sqlite:///{database}", "--shard-size", str(SHARD_SIZE), "--max-tokens", "4",
               "--threads", "2", "--kv-cache-memory", "0.25", "--temperature", "0"]  # greedy: lengths as planned
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_a_completed_shard(first, database)
        finally:
            os.kill(first.pid, signal.SIGKILL)
            first.wait()

    before = shard_rows(database)
    completed = {i: row for i, row in before.items() if row[0] == "completed"}
    interrupted = [i for i, row in before.items() if row[0] == "running"]
    assert 0 < len(completed) < len(before) == ROWS // SHARD_SIZE, "the kill must land mid-job"
    assert len(interrupted) >= 2, f"several shards must be in flight at the kill: {before}"
    assert not (output / "manifest.json").exists()
    part_mtimes = {i: part_of(output, i).stat().st_mtime_ns for i in completed}

    second = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "(resumed)" in second.stdout and f"completed: {ROWS} rows, {ROWS} completed, 0 failed" in second.stdout
    assert f"{len(completed)} of {len(before)} shards already completed" in second.stderr

    after = shard_rows(database)
    assert all(row[0] == "completed" for row in after.values())
    for index, row in completed.items():
        assert after[index] == row, f"shard {index} was recomputed"
        assert part_of(output, index).stat().st_mtime_ns == part_mtimes[index]
    for index in interrupted:
        assert after[index][1] == 2, f"interrupted shard {index} should have been redone once"
    assert_each_id_once(LocalStore(output), columns["custom_id"])


def part_of(output, index: int):
    """The one part file of shard `index` under output (its key carries the job id and the claim)."""
    (part,) = output.glob(f"part-{index:05d}-*.parquet")
    return part



def test_sigkill_after_a_part_upload_then_in_finalize_and_the_third_run_finishes(tmp_path: Path) -> None:
    """Killed (TOKENMILL_CRASH_AT) after a part is uploaded but before its shard commits; run again and killed
    after the manifest is written but before the job commits `completed`; the third run completes the job, and
    the outputs hold every custom_id once, the manifest listing exactly the part files there are."""
    columns = prompt_rows(8)
    source = write_parquet(tmp_path / "prompts.parquet", columns)
    output, database = tmp_path / "out", tmp_path / "jobs.db"
    command = [sys.executable, "-m", "tokenmill", "run", str(source), "--output", str(output),
               "--database-url", f"sqlite:///{database}", "--shard-size", "4", "--max-tokens", "4",
               "--kv-cache-memory", "0.25", "--temperature", "0"]

    def killed_at(point: str) -> list[str]:
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "TOKENMILL_CRASH_AT": point})
        assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
        with sqlite3.connect(database) as connection:
            assert connection.execute("SELECT status FROM jobs").fetchall() != [("completed",)]
        return [status for status, *_ in shard_rows(database).values()]

    statuses = killed_at("after_part_upload")
    assert list(output.glob("part-*.parquet")) and "completed" not in statuses, "no shard may have committed"
    assert not (output / "manifest.json").exists()
    assert killed_at("during_finalize") == ["completed", "completed"] and (output / "manifest.json").exists()

    last = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "completed: 8 rows, 8 completed, 0 failed" in last.stdout
    assert_each_id_once(LocalStore(output), columns["custom_id"])
