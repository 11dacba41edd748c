"""Claims on the database, without a broker or a model: one live job per output prefix, fencing tokens on
shard and step claims (a worker whose claim was taken writes nothing), attempt limits on the control steps,
and deadlines (`completion_window`) ending jobs `expired` with their finished shards kept."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from ingest.intake import Intake, OutputClaimed, submit
from ingest.job_request import JobRequestError, validate_request
from storage import clock
from storage import repository as repo
from storage.job_settings import CELERY, JobSettings
from storage.models import Job, Shard, ShardStatus, utcnow
from storage.objectstore import S3Options, open_store
from storage.states import transition
from workers.job_steps import JobSteps
from workers.leases import LeaseHeartbeat, StaleClaim, shard_claim
from workers.shard_step import ShardStep
from workers.shards import ShardOutcome
from workers.sweep import sweep


def new_job(input_uri: str, output_uri: str, **fields):
    return validate_request({"input_uri": input_uri, "output_uri": output_uri, **fields}).to_job(executor=CELERY)


def test_a_second_live_job_on_an_output_prefix_is_refused_naming_the_owner(sqlite_sessions, tmp_path) -> None:
    out = tmp_path / "out"
    first = submit(sqlite_sessions, new_job(str(tmp_path / "a.jsonl"), f"{out}/")).job
    assert first.output_claim == f"file://{out}"
    with pytest.raises(OutputClaimed, match=f"taken by live job {first.id}"):
        submit(sqlite_sessions, new_job(str(tmp_path / "b.jsonl"), str(out)))  # the same prefix, spelt without /
    intake = Intake(sqlite_sessions, S3Options(), dispatch=lambda job_id: None)
    request = validate_request({"input_uri": str(tmp_path / "c.jsonl"), "output_uri": str(out)})
    with pytest.raises(JobRequestError, match=first.id):  # the front doors: rejected_messages / the inbox's error
        intake.accept(request, source="kafka", source_ref="t/0/1", default_key="k-c")
    assert submit(sqlite_sessions, new_job(str(tmp_path / "a.jsonl"), str(out))).outcome == "resumed"  # itself

    with sqlite_sessions.begin() as session:
        transition(repo.get_job(session, first.id), "failed", error="x")
    assert JobSteps(sqlite_sessions, first.id).load().output_claim is None  # terminal: the prefix is free
    second = submit(sqlite_sessions, new_job(str(tmp_path / "b.jsonl"), str(out))).job
    with pytest.raises(OutputClaimed, match=second.id):  # retrying the first while the second lives
        submit(sqlite_sessions, new_job(str(tmp_path / "a.jsonl"), str(out)))
    assert JobSteps(sqlite_sessions, first.id).load().status == "failed"


def test_a_submit_racing_another_of_the_same_job_finds_it_instead_of_refusing(sqlite_sessions, tmp_path,
                                                                              monkeypatch) -> None:
    """Two firings of one schedule at once on PostgreSQL: the second read the key before the first committed and
    the output claim after, which found the first's job. It is the same job (same key), not another owner."""
    job = new_job(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), idempotency_key="schedule-n-2026-12-02")
    first = submit(sqlite_sessions, job, reopen=False)
    reads = []
    real_job_by_key = repo.job_by_key

    def before_the_commit_then_after(session, key):
        reads.append(key)
        return None if len(reads) == 1 else real_job_by_key(session, key)

    monkeypatch.setattr(repo, "job_by_key", before_the_commit_then_after)
    second = submit(sqlite_sessions, job, reopen=False)
    assert (second.outcome, second.job.id, len(reads)) == ("duplicate", first.job.id, 2)
    monkeypatch.undo()
    with pytest.raises(OutputClaimed, match=first.job.id):  # a job of another key is still refused
        submit(sqlite_sessions, new_job(str(tmp_path / "other.jsonl"), str(tmp_path / "out")))


def make_job(sessions, output: str, shards: int = 2, status: str = "queued") -> str:
    with sessions.begin() as session:
        job = Job(idempotency_key=f"k-{uuid.uuid4()}", status=status, model="m", input_uri="in",
                  output_uri=output, settings=JobSettings(executor=CELERY, shard_size=1), requests_total=shards,
                  created_at=utcnow())
        session.add(job)
        session.flush()
        repo.add_shards(session, job, [(i, i + 1) for i in range(shards)])
        return job.id


def record(custom_id: str, row: int) -> dict:
    return {"custom_id": custom_id, "text": "t", "finish_reason": "stop", "prompt_tokens": 1,
            "completion_tokens": 1, "cached_tokens": 0, "ttft_ms": 1.0, "latency_ms": 1.0, "row_index": row,
            "endpoint": "/v1/completions", "logprobs": None, "choice_index": 0}


def test_a_worker_whose_claim_was_taken_writes_nothing(sqlite_sessions, tmp_path) -> None:
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1)
    with sqlite_sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    stale, thief = ShardStep(JobSteps(sqlite_sessions, job_id)), ShardStep(JobSteps(sqlite_sessions, job_id))
    old = stale.claim_shard(shard_id, max_attempts=3)
    assert old.decision == "run" and old.shard.claim_token == 1
    with sqlite_sessions.begin() as session:  # its lease lapsed on another host
        row = session.get(Shard, shard_id)
        row.worker, row.lease_expires_at = "other-host:1", utcnow() - timedelta(seconds=1)
    thief.steps.worker = "thief-host:2"
    new = thief.claim_shard(shard_id, max_attempts=3)
    assert new.decision == "run" and new.shard.claim_token == 2

    heartbeat = LeaseHeartbeat(sqlite_sessions, {shard_claim(shard_id): old.shard.claim_token})
    heartbeat.beat()
    assert heartbeat.lost  # the stale worker's heartbeat tells it to stop
    job = stale.steps.load()
    with pytest.raises(StaleClaim):
        stale._write_part(job, old.shard, ShardOutcome(records=[record("a", 0)]), shard_claim(shard_id))
    with pytest.raises(StaleClaim):
        stale._complete_shard(old.shard, ShardOutcome(records=[record("a", 0)]), "part-00000.parquet")
    stale._end_shard(old.shard, ShardStatus.FAILED, "boom")  # no effect
    with sqlite_sessions() as session:
        row = session.get(Shard, shard_id)
        assert (row.status, row.worker, row.error, row.claim_token) == ("running", "thief-host:2", None, 2)

    outcome = ShardOutcome(records=[record("a", 0)])
    key = thief._write_part(job, new.shard, outcome, shard_claim(shard_id))
    assert key == f"part-00000-{job_id}-c2.parquet"  # the newer claim's own key: no stale writer can replace it
    assert thief._complete_shard(new.shard, outcome, key)  # the last shard: the job is finalizing
    with sqlite_sessions() as session:
        row = session.get(Shard, shard_id)
        assert (row.status, row.output_key) == ("completed", key)
    assert open_store(str(tmp_path / "out")).list() == [key]
    stale._end_shard(old.shard, ShardStatus.FAILED, "late")
    assert stale.steps.load().status == "finalizing"


def test_the_heartbeat_renews_leases_on_its_own_thread(sqlite_sessions, tmp_path) -> None:
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1)
    with sqlite_sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    claim = ShardStep(JobSteps(sqlite_sessions, job_id)).claim_shard(shard_id, max_attempts=3)
    with sqlite_sessions.begin() as session:
        session.get(Shard, shard_id).lease_expires_at = utcnow()
    renewed = threading.Event()
    with LeaseHeartbeat(sqlite_sessions, {shard_claim(shard_id): claim.shard.claim_token}, every_s=0.05) as heartbeat:
        for _ in range(100):
            with sqlite_sessions() as session:
                if session.get(Shard, shard_id).lease_expires_at > utcnow() + timedelta(seconds=60):
                    renewed.set()
                    break
            threading.Event().wait(0.05)
    assert renewed.is_set() and not heartbeat.lost


def test_control_steps_have_an_attempt_limit_and_a_fencing_token(sqlite_sessions, tmp_path) -> None:
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=0, status="validating")
    first = JobSteps(sqlite_sessions, job_id)
    assert first.claim_step("validating", max_attempts=2) and first.step_token == 1
    with sqlite_sessions.begin() as session:  # its worker died (killed by the OOM killer, say): its lease lapsed
        job = repo.get_job(session, job_id)
        job.worker, job.lease_expires_at = "gone-host:1", utcnow() - timedelta(seconds=1)
    second = JobSteps(sqlite_sessions, job_id)
    assert second.claim_step("validating", max_attempts=2) and second.step_token == 2
    assert first._plan(0, "jsonl", {}, started=False).status == "validating"  # the stale step writes nothing
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, job_id)
        job.worker, job.lease_expires_at = "gone-host:2", utcnow() - timedelta(seconds=1)
    assert not JobSteps(sqlite_sessions, job_id).claim_step("validating", max_attempts=2)
    job = first.load()
    assert job.status == "failed" and "validating was started 2 time(s) without finishing" in job.error

    finished = make_job(sqlite_sessions, str(tmp_path / "out2"), shards=0, status="validating")
    steps = JobSteps(sqlite_sessions, finished)
    assert steps.claim_step("validating", max_attempts=1)
    steps.release(finished=True)  # a finished step clears the count for the next step
    assert steps.load().attempts == 0 and steps.load().worker is None


def test_a_job_past_its_deadline_expires_keeping_its_completed_shards(sqlite_sessions, tmp_path) -> None:
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=3, status="in_progress")
    with sqlite_sessions.begin() as session:
        job = repo.get_job(session, job_id)
        job.expires_at, job.output_claim = utcnow() + timedelta(hours=1), "file:///claimed"
        done, running, pending = job.shards
        done.status, running.status, running.worker = "completed", "running", "other-host:1"
        running.lease_expires_at, running.claim_token = utcnow() + timedelta(minutes=2), 1
    assert sweep(sqlite_sessions).expired == []
    assert sweep(sqlite_sessions, now=utcnow() + timedelta(hours=2)).expired == [job_id]
    with sqlite_sessions() as session:
        job = repo.get_job(session, job_id)
        assert (job.status, job.output_claim) == ("expired", None) and job.expired_at is not None
        assert [s.status for s in job.shards] == ["completed", "cancelled", "cancelled"]
        assert job.shards[1].claim_token == 2  # the worker still on it is fenced


def test_completion_window_sets_the_deadline(sqlite_sessions, tmp_path) -> None:
    job = submit(sqlite_sessions, new_job(str(tmp_path / "a.jsonl"), str(tmp_path / "o"))).job
    assert timedelta(hours=23, minutes=59) < job.expires_at - job.created_at < timedelta(hours=24, seconds=1)
    job = submit(sqlite_sessions, new_job(str(tmp_path / "b.jsonl"), str(tmp_path / "p"), completion_window="90s")).job
    assert abs(job.expires_at - job.created_at - timedelta(seconds=90)) < timedelta(seconds=1)  # two clocks' reads
    for bad in ("0h", "24", "31d", "1w", 24):
        with pytest.raises(JobRequestError, match="completion_window"):
            validate_request({"input_uri": "a.jsonl", "output_uri": "o", "completion_window": bad})


class FrontDoorBehind(clock.SystemClock):
    """The front door's host an hour behind the database's clock."""

    def utcnow(self) -> datetime:
        return datetime.now(UTC) - timedelta(hours=1)

    def database_now(self) -> datetime:
        return datetime.now(UTC)


def test_the_deadline_is_stamped_on_the_databases_clock(sqlite_sessions, tmp_path) -> None:
    """#55 path 7: the sweep compares deadlines with the database's clock, so they are stamped on it: a front door
    whose clock is an hour behind neither expires a job at once nor a retried one early."""
    previous = clock.install(FrontDoorBehind())
    try:
        new = new_job(str(tmp_path / "a.jsonl"), str(tmp_path / "o"), completion_window="90s")
        job = submit(sqlite_sessions, new).job
        assert abs(job.expires_at - (datetime.now(UTC) + timedelta(seconds=90))) < timedelta(seconds=5)
        assert sweep(sqlite_sessions).expired == []
        with sqlite_sessions.begin() as session:
            transition(repo.get_job(session, job.id), "failed", error="boom")
        assert submit(sqlite_sessions, new).outcome == "retried"
        with sqlite_sessions() as session:
            retried = repo.get_job(session, job.id).expires_at
        assert abs(retried - (datetime.now(UTC) + timedelta(seconds=90))) < timedelta(seconds=5)
    finally:
        clock.install(previous)


def test_an_input_replaced_mid_job_fails_it_with_that_reason(sqlite_sessions, engine_service, tmp_path) -> None:
    """The input is pinned at validation (size, mtime, hash): a shard reading a replaced file fails the job
    with the reason, and the shard completed before keeps its part."""
    from tests.jobs.jobhelpers import prompt_rows, write_parquet

    path = write_parquet(tmp_path / "in.parquet", prompt_rows(4))
    sessions = sqlite_sessions
    job = submit(sessions, new_job(str(path), str(tmp_path / "out"), shard_size=2,
                                   sampling={"max_tokens": 2, "temperature": 0})).job
    steps = JobSteps(sessions, job.id)
    assert steps.validate().status == "queued"
    assert set(steps.load().settings.input_fingerprint) == {"size", "mtime_ns", "sha256"}
    with sessions() as session:
        first, second = (s.id for s in repo.shards(session, job.id))
    claim = ShardStep(steps).claim_shard(first, max_attempts=3)
    assert ShardStep(steps).execute_shard(claim.job, claim.shard, lambda: engine_service).records
    steps.close()
    write_parquet(path, prompt_rows(4, prefix="other"))  # replaced by another file
    steps = JobSteps(sessions, job.id)
    claim = ShardStep(steps).claim_shard(second, max_attempts=3)
    ShardStep(steps).execute_shard(claim.job, claim.shard, lambda: engine_service)
    steps.close()
    job = steps.load()
    assert job.status == "failed" and "changed since the job was validated" in job.error, job.error
    with sessions() as session:
        assert [s.status for s in repo.shards(session, job.id)] == ["completed", "failed"]
    assert not engine_service.engine.has_unfinished_requests()
