"""Jobs that must fail in `validating` with a clear message (the model is never loaded), submission rules
(idempotency, output URI safety) and cancelling or taking over jobs without a live runner."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from sqlalchemy import func, select, text

from ingest.intake import idempotency_key, submit
from ingest.job_request import NewJob
from storage import repository as repo
from storage.formats import Limits
from storage.job_settings import JobSettings
from storage.models import Job, Shard, utcnow
from tests.jobs.jobhelpers import new_job, no_engine, prompt_rows, write_parquet
from workers.inprocess import JobBusy, LocalExecutor, cancel_job, run_job
from workers.job_steps import JobSteps


def spec(input_path: Path, output: Path, **kwargs) -> NewJob:
    return new_job(input_uri=str(input_path), output_uri=str(output), model="smollm2-135m", **kwargs)


def run_to_failure(sessions, job_spec: NewJob) -> Job:
    job = run_job(sessions, submit(sessions, job_spec).job.id, no_engine)
    assert job.status == "failed"
    assert job.validating_at is not None and job.failed_at is not None and job.in_progress_at is None
    return job


def corrupt_data_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    footer_length = int.from_bytes(data[-8:-4], "little")
    data[4:len(data) - 8 - footer_length] = b"\x00" * (len(data) - 12 - footer_length)
    path.write_bytes(bytes(data))


def bad_inputs(tmp: Path) -> list[tuple[Path, dict, str]]:
    """(input file, extra JobRequest fields, expected message) for each file-level problem."""
    cases = []
    (tmp / "text.parquet").write_text("custom_id,prompt\n1,hello\n")
    cases.append((tmp / "text.parquet", {}, "is not a Parquet file"))
    whole = write_parquet(tmp / "whole.parquet", prompt_rows(40)).read_bytes()
    (tmp / "cut.parquet").write_bytes(whole[:-100])
    cases.append((tmp / "cut.parquet", {}, "truncated Parquet file"))
    cases.append((write_parquet(tmp / "noid.parquet", {"prompt": ["a"]}), {}, "missing required column 'custom_id'"))
    both = {"custom_id": ["a"], "prompt": ["p"], "messages": [[{"role": "user", "content": "m"}]]}
    cases.append((write_parquet(tmp / "both.parquet", both), {}, "exactly one of the columns 'prompt' or 'messages' "
                                                                 "(found both)"))
    cases.append((write_parquet(tmp / "neither.parquet", {"custom_id": ["a"], "input": ["p"]}), {},
                  "(found neither)"))
    duplicate = prompt_rows(6)
    duplicate["custom_id"][5] = duplicate["custom_id"][1]
    cases.append((write_parquet(tmp / "dup.parquet", duplicate), {},
                  "duplicate custom_id 'row-0001' in rows 1 and 5: column 'custom_id' must be unique"))
    big = write_parquet(tmp / "big.parquet", prompt_rows(300), row_group_size=100)
    corrupt_data_pages(big)  # the footer alone must be enough to refuse it
    cases.append((big, {"limits": Limits(max_rows=100)}, "is 300, over the limit max_rows=100"))
    cases.append((big, {"limits": Limits(max_uncompressed_bytes=4096), "shard_size": 7},
                  "over the limit max_uncompressed_bytes=4,096"))
    return cases


def test_file_level_problems_fail_the_job_in_validating(sessions, tmp_path: Path) -> None:
    for number, (path, extra, message) in enumerate(bad_inputs(tmp_path)):
        output = tmp_path / f"out-{number}"
        job = run_to_failure(sessions, spec(path, output, **extra))
        assert message in job.error, f"{path.name}: {job.error!r} lacks {message!r}"
        assert not output.exists(), "a job failing validation writes nothing"
        with sessions() as session:
            assert repo.shards(session, job.id) == []


def test_unsafe_output_uris_are_refused_before_a_job_exists(sessions, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    with pytest.raises(ValueError, match=r"contains a '\.\.' segment"):
        submit(sessions, spec(path, tmp_path / "out" / ".." / ".." / "etc"))
    monkeypatch.setenv("TOKENMILL_ALLOWED_OUTPUT_PREFIXES", f"{tmp_path}/allowed,s3://results")
    with pytest.raises(ValueError, match="outside the allowed prefixes"):
        submit(sessions, spec(path, tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="outside the allowed prefixes"):
        submit(sessions, spec(path, "s3://results-2/x"))
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
    assert submit(sessions, spec(path, tmp_path / "allowed" / "job")).outcome == "created"


def test_same_input_and_output_is_the_same_job(sessions, tmp_path: Path, monkeypatch) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    first = submit(sessions, spec(path, tmp_path / "out"))
    monkeypatch.chdir(tmp_path)  # a relative spelling of the same paths is the same job
    again = submit(sessions, spec(Path("in.parquet"), Path("out/")))
    other = submit(sessions, spec(path, tmp_path / "out2"))
    assert (first.outcome, again.outcome, other.outcome) == ("created", "resumed", "created")
    assert first.job.id == again.job.id != other.job.id
    assert first.job.idempotency_key == idempotency_key(str(path), str(tmp_path / "out"))


def test_a_failed_job_is_retried_with_the_new_settings(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(30))
    failed = run_to_failure(sessions, spec(path, tmp_path / "out", limits=Limits(max_rows=10)))
    retry = submit(sessions, spec(path, tmp_path / "out", limits=Limits(max_rows=100), shard_size=8))
    assert retry.outcome == "retried" and retry.job.id == failed.id
    assert retry.job.status == "validating" and retry.job.error is None
    with sessions() as session:
        settings = repo.get_job(session, failed.id).settings
    assert (settings.shard_size, settings.limits.max_rows) == (8, 100)


def test_output_holding_another_jobs_files_is_refused(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "part-00000.parquet").write_bytes(b"someone else's")
    job = run_to_failure(sessions, spec(path, tmp_path / "out"))
    assert "already holds 1 file(s) (e.g. part-00000.parquet)" in job.error
    assert (tmp_path / "out" / "part-00000.parquet").read_bytes() == b"someone else's"


def test_cancel_without_a_runner_cancels_at_once(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    job = submit(sessions, spec(path, tmp_path / "out")).job
    cancelled = cancel_job(sessions, job.id[:8])
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    with pytest.raises(ValueError, match="only validating, queued or in_progress jobs can be cancelled"):
        with sessions.begin() as session:
            repo.get_job(session, job.id).status = "completed"
        cancel_job(sessions, job.id)
    with pytest.raises(repo.JobNotFound, match="no job matches 'zzz'"):
        cancel_job(sessions, "zzz")


def test_a_job_held_by_a_live_process_is_not_taken_over(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    job = submit(sessions, spec(path, tmp_path / "out")).job
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with sessions.begin() as session:
            held = repo.get_job(session, job.id)  # a live process with a running lease
            held.worker, held.lease_expires_at = f"{socket.gethostname()}:{holder.pid}", utcnow() + timedelta(minutes=1)
        with pytest.raises(JobBusy, match=f"being run by .*:{holder.pid}"):
            run_job(sessions, job.id, no_engine)
        assert cancel_job(sessions, job.id).status == "cancelling"  # the live runner will finish the cancel
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: a resubmission finishes the cancel and retries the job
    assert submit(sessions, spec(path, tmp_path / "out")).outcome == "retried"
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Shard)) == 0


def test_the_in_process_executor_takes_a_job_over_once_its_holders_lease_lapses(sessions, tmp_path: Path) -> None:
    """#55 path 3: `tokenmill api` restarted within the lease of its previous process (on another host here, so
    only the lease counts) finds its job busy: it tries again once that lease lapsed, instead of dropping it."""
    path = write_parquet(tmp_path / "empty.parquet", {"custom_id": [], "prompt": []},
                         schema=pa.schema([("custom_id", pa.string()), ("prompt", pa.string())]))
    job = submit(sessions, spec(path, tmp_path / "out")).job
    with sessions.begin() as session:
        held = repo.get_job(session, job.id)
        held.worker, held.lease_expires_at = "another-host:7@b.n.x", utcnow() + timedelta(seconds=1)
    executor = LocalExecutor(sessions, {})
    try:
        executor.dispatch(job.id)
        deadline = time.monotonic() + 20
        while (status := JobSteps(sessions, job.id).load().status) != "completed" and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        executor.close()
    assert status == "completed"


def test_the_in_process_executor_expires_its_jobs_past_their_deadline(sessions, tmp_path: Path) -> None:
    """A batch that `tokenmill api` runs in process ends `expired` at its deadline, as a Celery job does by the
    sweep (the sweep never looks at in-process jobs); a Celery job past its deadline is left to the sweep."""
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    local = submit(sessions, spec(path, tmp_path / "local")).job
    celery = submit(sessions, spec(path, tmp_path / "celery", executor="celery")).job
    with sessions.begin() as session:
        for job_id in (local.id, celery.id):
            repo.get_job(session, job_id).expires_at = utcnow() - timedelta(seconds=1)
    executor = LocalExecutor(sessions, {}, expiry_check_s=0.1)
    try:
        deadline = time.monotonic() + 20
        while JobSteps(sessions, local.id).load().status != "expired" and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        executor.close()
    assert JobSteps(sessions, local.id).load().status == "expired"
    assert JobSteps(sessions, celery.id).load().status == celery.status


def test_an_empty_input_completes_without_loading_the_model(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "empty.parquet", {"custom_id": [], "prompt": []},
                         schema=pa.schema([("custom_id", pa.string()), ("prompt", pa.string())]))
    job = run_job(sessions, submit(sessions, spec(path, tmp_path / "out")).job.id, no_engine)
    assert job.status == "completed" and job.requests_total == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["errors.jsonl", "manifest.json"]


def test_settings_are_stored_as_json_and_read_back_typed(sessions, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(3))
    job = submit(sessions, spec(path, tmp_path / "out", sampling={"max_tokens": 3}, engine={"max_num_seqs": 4},
                                shard_size=2)).job
    with sessions() as session:
        stored = session.execute(text("SELECT settings FROM jobs WHERE id = :id"), {"id": job.id}).scalar_one()
        settings = repo.get_job(session, job.id).settings
    raw = json.loads(stored) if isinstance(stored, str) else stored  # plain JSON in the column
    assert (raw["shard_size"], raw["executor"], raw["sampling"]) == (2, "local", {"max_tokens": 3})
    assert isinstance(settings, JobSettings) and settings.executor == "local"
    assert (settings.sampling, settings.engine, settings.shard_size) == ({"max_tokens": 3}, {"max_num_seqs": 4}, 2)
    with pytest.raises(ValueError, match="shard_size"):
        spec(path, tmp_path / "out", shard_size=0)
