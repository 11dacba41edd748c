"""A shard that cannot finish because of its rows (issue #57): once it used its attempts, its rows end as
`server_error` errors, committed like a completed shard's, and the job completes with every custom_id once across
its outputs and error file, as OpenAI's batches do. A shard whose engine cannot load, or whose errors cannot be
written either, still fails the job. No model: a stand-in engine loop runs the rows."""

from __future__ import annotations

import json
import socket
import subprocess
from types import SimpleNamespace

import jsonschema
import pytest

from ingest.intake import submit
from storage import repository as repo
from storage.formats import BATCH_OUTPUT_KEY, Request
from storage.models import Shard
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job
from tests.jobs.openai_shapes import BATCH_OUTPUT_LINE
from tests.jobs.test_claims import record
from workers import inprocess
from workers.inprocess import SHARD_TRIES, run_job
from workers.job_steps import JobSteps
from workers.shard_step import ERROR_WRITE_ATTEMPTS, EngineUnavailable, ShardStep
from workers.shards import ShardOutcome

MAX_ATTEMPTS = 2


class RowsLoop:
    """Stands for an engine service: each row's record, except that a shard holding a row of `raising` raises."""

    def __init__(self, raising: set[str] = frozenset()) -> None:
        self.raising, self.runs = raising, []
        self.engine = SimpleNamespace(config=SimpleNamespace(max_num_seqs=4))

    def close(self) -> None:
        pass

    def run(self, settings, rows, prefix, should_stop=lambda: False, progress=None) -> ShardOutcome:
        self.runs.append(prefix)
        if any(isinstance(row, Request) and row.custom_id in self.raising for row in rows):
            raise RuntimeError("the engine fell over on this shard")
        return ShardOutcome(records=[record(row.custom_id, row.row) for row in rows])


@pytest.fixture
def engine(monkeypatch):
    """A stand-in engine whose engine service is a `RowsLoop` (set its `raising`): a job run starts that one."""
    stand_in = SimpleNamespace(config=SimpleNamespace(max_num_seqs=4), loop=RowsLoop())
    monkeypatch.setattr(inprocess, "EngineLoop", lambda engine: engine.loop)
    return stand_in


def write_input(path, ids: list[str]):
    path.write_text("".join(json.dumps({"custom_id": i, "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "smollm2-135m", "prompt": f"say {i}", "max_tokens": 2}})
                            + "\n" for i in ids))
    return path


def planned_job(sessions, tmp_path, ids: list[str]) -> tuple[str, list[int]]:
    """A validated job of these rows, two per shard, with an OpenAI batch output; (its id, its shard ids)."""
    job = submit(sessions, new_job(str(write_input(tmp_path / "in.jsonl", ids)), str(tmp_path / "out"),
                                   shard_size=2, openai_output=True)).job
    steps = JobSteps(sessions, job.id)
    assert steps.validate().status == "queued"
    steps.close()
    with sessions() as session:
        return job.id, [s.id for s in repo.shards(session, job.id)]


def no_engine():
    raise AssertionError("a shard out of attempts must not load the engine")


def dead_worker() -> str:
    process = subprocess.Popen(["true"])
    process.wait()
    return f"{socket.gethostname()}:{process.pid}"


def died_running(sessions, shard_id: int, attempts: int) -> None:
    """The shard's workers died running it, `attempts` times."""
    with sessions.begin() as session:
        shard = session.get(Shard, shard_id)
        shard.status, shard.attempts, shard.worker, shard.error = "running", attempts, dead_worker(), None


def run_shard(sessions, job_id: str, shard_id: int, load) -> str:
    """What a worker's run_shard does with the shard (`load` gives its engine); returns its claim's decision."""
    steps = JobSteps(sessions, job_id)
    step = ShardStep(steps)
    claim = step.claim_shard(shard_id, MAX_ATTEMPTS)
    if claim.decision in ("run", "exhausted"):
        try:
            step.execute_shard(claim.job, claim.shard, load, claim.exhausted)
        finally:
            steps.close()
    return claim.decision


def finalize(sessions, job_id: str):
    steps = JobSteps(sessions, job_id)
    assert steps.claim_step("finalizing", max_attempts=3)
    return steps.finalize()


def batch_output(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open_store(str(tmp_path / "out")).get_bytes(BATCH_OUTPUT_KEY).splitlines()]


def test_a_shard_that_killed_its_workers_each_time_ends_with_its_rows_as_errors(sqlite_sessions, tmp_path,
                                                                                 engine) -> None:
    ids = ["a", "b", "c", "d"]
    job_id, (first, second) = planned_job(sqlite_sessions, tmp_path, ids)
    assert run_shard(sqlite_sessions, job_id, first, lambda: engine.loop) == "run"
    died_running(sqlite_sessions, second, MAX_ATTEMPTS)
    assert run_shard(sqlite_sessions, job_id, second, no_engine) == "exhausted"  # its rows are not run again
    assert engine.loop.runs == [f"{job_id}-0-c1-"]
    assert JobSteps(sqlite_sessions, job_id).load().status == "finalizing"  # its last shard committed
    assert run_shard(sqlite_sessions, job_id, second, no_engine) == "stopped"

    job = finalize(sqlite_sessions, job_id)
    assert job.status == "completed" and job.error is None
    assert (job.requests_total, job.requests_completed, job.requests_failed) == (4, 2, 2)
    results, errors, manifest = assert_each_id_once(open_store(str(tmp_path / "out")), ids)
    assert [r["custom_id"] for r in results] == ["a", "b"] and manifest["counts"]["failed"] == 2
    assert [(e["custom_id"], e["code"]) for e in errors] == [("c", "server_error"), ("d", "server_error")]
    assert "its shard was tried 2 time(s), the limit" in errors[0]["message"]
    assert "died" not in errors[0]["message"] and "worker (" not in errors[0]["message"]  # no host named

    lines = batch_output(tmp_path)
    assert [line["custom_id"] for line in lines] == ids
    for line in lines:
        jsonschema.validate(line, BATCH_OUTPUT_LINE)
    failed = lines[2]
    assert failed["error"] is None and failed["response"]["status_code"] == 500
    assert failed["response"]["request_id"] == failed["id"]
    assert {k: v for k, v in failed["response"]["body"]["error"].items() if k != "message"} == {
        "type": "server_error", "param": None, "code": "server_error"}
    with sqlite_sessions() as session:
        shard = repo.get_shard_by_id(session, second)
        assert (shard.status, shard.rows_failed, shard.attempts) == ("completed", 2, MAX_ATTEMPTS + 1)


def test_in_process_a_shard_that_raises_every_time_is_tried_again_then_its_rows_end_as_errors(
        sqlite_sessions, tmp_path, engine) -> None:
    ids = ["a", "b", "c", "d", "e"]
    job_id, _ = planned_job(sqlite_sessions, tmp_path, ids)
    engine.loop.raising = {"c"}
    job = run_job(sqlite_sessions, job_id, lambda settings: engine)
    assert job.status == "completed", job.error
    assert (job.requests_completed, job.requests_failed) == (3, 2)
    assert sum(prefix.startswith(f"{job_id}-1-") for prefix in engine.loop.runs) == SHARD_TRIES
    _, errors, _ = assert_each_id_once(open_store(str(tmp_path / "out")), ids)
    assert [(e["custom_id"], e["code"]) for e in errors] == [("c", "server_error"), ("d", "server_error")]
    assert "(last: it raised RuntimeError)" in errors[0]["message"]
    lines = {line["custom_id"]: line for line in batch_output(tmp_path)}
    assert [custom_id for custom_id, line in lines.items() if line["response"]["status_code"] == 500] == ["c", "d"]


def test_a_shard_whose_engine_cannot_load_still_fails_the_job(sqlite_sessions, tmp_path) -> None:
    job_id, (first, _) = planned_job(sqlite_sessions, tmp_path, ["a", "b", "c"])

    def broken_engine():
        raise OSError("no such model directory")

    for _ in range(MAX_ATTEMPTS):
        with pytest.raises(EngineUnavailable, match="OSError: no such model directory"):
            run_shard(sqlite_sessions, job_id, first, broken_engine)
    assert run_shard(sqlite_sessions, job_id, first, broken_engine) == "gave_up"
    job = JobSteps(sqlite_sessions, job_id).load()
    assert job.status == "failed"
    assert "failed 2 attempt(s), the limit; last: EngineUnavailable: OSError: no such model" in job.error


def test_a_shard_whose_errors_cannot_be_written_either_fails_the_job(sqlite_sessions, tmp_path) -> None:
    """Each claim past the limit that died writing the errors counts too: ERROR_WRITE_ATTEMPTS of them."""
    job_id, (first, second) = planned_job(sqlite_sessions, tmp_path, ["a", "b", "c"])
    died_running(sqlite_sessions, first, MAX_ATTEMPTS + ERROR_WRITE_ATTEMPTS - 1)
    assert run_shard(sqlite_sessions, job_id, first, no_engine) == "exhausted"  # the last try it gets
    died_running(sqlite_sessions, second, MAX_ATTEMPTS + ERROR_WRITE_ATTEMPTS)
    assert run_shard(sqlite_sessions, job_id, second, no_engine) == "gave_up"
    job = JobSteps(sqlite_sessions, job_id).load()
    assert job.status == "failed" and "shard 1 (rows 2-2) failed 5 attempt(s), the limit" in job.error
