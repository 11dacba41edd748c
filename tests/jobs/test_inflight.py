"""In-flight shards: `tokenmill run`'s runner feeds every unfinished shard through one engine stream, so a
shard's rows are admitted while the previous shard's tail decodes. Outputs must match the same rows run as
one shard, and each part is written as soon as its own last row finishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.intake import submit
from storage import repository as repo
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job, prompt_rows, write_parquet
from workers.inprocess import run_job
from workers.shard_step import engine_priority

pytestmark = pytest.mark.real_model


def texts(output: Path, ids: list[str]) -> dict[str, tuple[str, int]]:
    results, _, _ = assert_each_id_once(open_store(str(output)), ids)
    return {r["custom_id"]: (r["text"], r["completion_tokens"]) for r in results}


def test_shards_in_flight_match_one_shard_and_finish_out_of_order(sessions, engine_provider, tmp_path: Path) -> None:
    # shard 0 holds one long row; shards 1 and 2 are short, so they finish while shard 0's tail decodes
    columns = {**prompt_rows(9), "max_tokens": [24, 2, 2, 3, 2, 3, 2, 4, 2]}
    path = write_parquet(tmp_path / "in.parquet", columns)
    outputs = {}
    for shard_size in (9, 3):
        spec = new_job(str(path), str(tmp_path / f"out-{shard_size}"), shard_size=shard_size,
                       sampling={"temperature": 0.0, "ignore_eos": True})
        job = run_job(sessions, submit(sessions, spec).job.id, engine_provider)
        assert job.status == "completed", job.error
        outputs[shard_size] = texts(tmp_path / f"out-{shard_size}", columns["custom_id"])
    assert outputs[3] == outputs[9]

    with sessions() as session:
        shards = {s.index: s for s in repo.shards(session, job.id)}
    assert all(s.status == "completed" and s.attempts == 1 for s in shards.values())
    assert shards[1].started_at < shards[0].finished_at, "shard 1 must be admitted before shard 0 finished"
    assert shards[1].finished_at < shards[0].finished_at and shards[2].finished_at < shards[0].finished_at, \
        "a shard's part is written when its own last row finishes, not after the shards before it"


def test_a_higher_job_priority_is_a_lower_engine_priority(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(2))
    for priority in (0, 5, -3):
        spec = new_job(str(path), str(tmp_path / f"out{priority}"), priority=priority)
        assert engine_priority(submit(sessions, spec).job) == -priority
