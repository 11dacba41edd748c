"""Exactly-once output under fenced writers (issue 40): a part uploaded by a claim that was lost meanwhile is
removed, a fenced step holder cannot fail the job, a late cleanup spares a retried job's parts, and a fenced
finalizer writes no manifest. Each test pauses one writer at the worst moment and lets another take over."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

from ingest.intake import submit
from storage import claims
from storage import repository as repo
from storage.formats import MANIFEST_KEY
from storage.models import Shard, utcnow
from storage.objectstore import LocalStore, open_store
from tests.jobs.jobhelpers import prompt_rows, write_parquet
from tests.jobs.test_claims import make_job, new_job, record
from tests.jobs.test_leases import finalizing_job
from workers import shard_step as shard_step_module
from workers.job_steps import JobSteps, discard_if_ended
from workers.shard_step import ShardStep
from workers.shards import ShardOutcome
from workers.sweep import sweep


def part_keys(store) -> list[str]:
    return sorted(key for key in store.list() if key.startswith("part-"))


def manifest_parts(store) -> list[str]:
    return sorted(part["key"] for part in json.loads(store.get_bytes(MANIFEST_KEY))["files"]["parts"])


def lapse_shard_lease(sessions, shard_id: int) -> None:
    with sessions.begin() as session:
        row = session.get(Shard, shard_id)
        row.worker, row.lease_expires_at = "paused-host:1", utcnow() - timedelta(seconds=1)


def lapse_step_lease(sessions, job_id: str) -> None:
    with sessions.begin() as session:
        job = repo.get_job(session, job_id)
        job.worker, job.lease_expires_at = "paused-host:1", utcnow() - timedelta(seconds=1)


def run_shard_to_commit(sessions, job_id: str, shard_id: int, custom_id: str = "a") -> str:
    """Another worker claims the shard, writes its part and commits it; returns the part's key."""
    step = ShardStep(JobSteps(sessions, job_id))
    step.steps.worker = "other-host:2"
    claim = step.claim_shard(shard_id, max_attempts=5)
    assert claim.decision == "run", claim.decision
    outcome = ShardOutcome(records=[record(custom_id, claim.shard.row_start)])
    key = step._write_part(claim.job, claim.shard, outcome, shard_step_module.shard_claim(shard_id))
    step._complete_shard(claim.shard, outcome, key)
    return key


def finalize(sessions, job_id: str):
    steps = JobSteps(sessions, job_id)
    assert steps.claim_step("finalizing", max_attempts=3)
    return steps.finalize()


def paused_uploader(sessions, job_id: str, monkeypatch, while_paused):
    """A shard worker whose part upload is paused past its lease: `while_paused` runs before the bytes land,
    then the worker's heartbeat notices the claim is gone (as its thread would, during the upload)."""
    with sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    worker = ShardStep(JobSteps(sessions, job_id))
    claim = worker.claim_shard(shard_id, max_attempts=5)
    outcome = ShardOutcome(records=[record("a", 0)])
    monkeypatch.setattr(worker, "_run_rows", lambda job, shard, engine, claim: outcome)
    real_write_part, paused = shard_step_module.write_part, []

    def slow_write_part(*args, **kwargs):
        if paused:  # the other workers' writes
            return real_write_part(*args, **kwargs)
        paused.append(True)
        while_paused(shard_id)
        key = real_write_part(*args, **kwargs)
        worker.steps.heartbeat.beat()  # finds the claim taken over
        return key

    monkeypatch.setattr(shard_step_module, "write_part", slow_write_part)
    return worker, claim


def taken_over_and_completed(sessions, job_id: str):
    """While the upload is paused: the lease lapses, another worker runs the shard and the job completes."""

    def take_over(shard_id: int) -> None:
        lapse_shard_lease(sessions, shard_id)
        run_shard_to_commit(sessions, job_id, shard_id)
        assert finalize(sessions, job_id).status == "completed"

    return take_over


def test_a_part_uploaded_after_its_claim_was_lost_is_removed(sqlite_sessions, tmp_path, monkeypatch) -> None:
    """Item 1: the worker's lease lapsed mid-upload; another worker ran the shard and the job completed before
    the paused upload landed. The late part is removed: the prefix holds exactly the manifest's parts."""
    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1, status="in_progress")
    store = open_store(str(tmp_path / "out"))

    worker, claim = paused_uploader(sqlite_sessions, job_id, monkeypatch,
                                    taken_over_and_completed(sqlite_sessions, job_id))
    outcome = worker.execute_shard(claim.job, claim.shard, lambda: None)
    assert outcome.lost
    assert worker.steps.load().status == "completed"
    assert part_keys(store) == manifest_parts(store), "a part outside the manifest"


def test_a_lost_claims_part_whose_delete_failed_is_removed_by_the_sweep(sqlite_sessions, tmp_path,
                                                                        monkeypatch) -> None:
    """Item 1, the store down when the lost claim cleans up: its part is recorded, and the next sweep removes
    it once the store is back."""
    from workers.finalize import remove_stray_parts

    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1, status="in_progress")
    store = open_store(str(tmp_path / "out"))

    worker, claim = paused_uploader(sqlite_sessions, job_id, monkeypatch,
                                    taken_over_and_completed(sqlite_sessions, job_id))
    monkeypatch.setattr(shard_step_module, "OUTAGE_WAIT_S", 0.0)

    def store_down(self, key):
        raise ConnectionError("the object store is down")

    with monkeypatch.context() as outage:
        outage.setattr(LocalStore, "delete", store_down)
        assert worker.execute_shard(claim.job, claim.shard, lambda: None).lost
    assert part_keys(store) != manifest_parts(store)  # the store was down: the stray part is still there
    remove_stray_parts(sqlite_sessions)
    assert part_keys(store) == manifest_parts(store), "a part outside the manifest"
    remove_stray_parts(sqlite_sessions)  # deleted again (its note is kept through the quarantine): still gone
    assert part_keys(store) == manifest_parts(store)


def test_a_part_that_lands_after_the_sweep_removed_it_is_removed_again(sqlite_sessions, tmp_path,
                                                                       monkeypatch) -> None:
    """#55 path 9: the worker paused inside its upload; meanwhile its claim was taken over, the job completed
    and the sweep removed the noted part (not there yet). Its client library retries the upload once it resumes:
    the part lands, and the worker dies before its own cleanup. The next sweep removes it again; the note is
    forgotten only once the quarantine is over."""
    from storage.formats import part_key, write_part
    from workers import finalize as finalize_module
    from workers.finalize import remove_stray_parts

    job_id = make_job(sqlite_sessions, str(tmp_path / "out"), shards=1, status="in_progress")
    store = open_store(str(tmp_path / "out"))
    with sqlite_sessions() as session:
        shard_id = repo.shards(session, job_id)[0].id
    paused = ShardStep(JobSteps(sqlite_sessions, job_id)).claim_shard(shard_id, max_attempts=5)
    key = part_key(0, job_id, paused.shard.claim_token)
    with sqlite_sessions.begin() as session:  # noted before its upload, as `_write_part` does
        repo.note_upload(session, job_id, key)
    taken_over_and_completed(sqlite_sessions, job_id)(shard_id)
    remove_stray_parts(sqlite_sessions)  # the part is not there yet
    write_part(store, 0, [record("a", 0)], job_id, paused.shard.claim_token)  # the retried upload lands; it dies
    remove_stray_parts(sqlite_sessions)
    assert part_keys(store) == manifest_parts(store), "a part outside the manifest"
    monkeypatch.setattr(finalize_module, "STRAY_QUARANTINE", timedelta(0))
    remove_stray_parts(sqlite_sessions)
    with sqlite_sessions() as session:
        assert repo.upload_notes(session) == []


def test_a_fenced_validator_cannot_fail_a_healthy_job(sqlite_sessions, tmp_path, monkeypatch) -> None:
    """Item 2: holder A pauses inside validate() past its lease; B validates, plans and a shard writes its part.
    A resumes and finds the output prefix not empty: it is fenced, so the job is not failed."""
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(2))
    job = submit(sqlite_sessions, new_job(str(path), str(tmp_path / "out"), shard_size=1)).job
    paused = JobSteps(sqlite_sessions, job.id)
    assert paused.claim_step("validating", max_attempts=3)
    check_output_empty = paused._check_output_empty

    def taken_over_meanwhile(job):
        lapse_step_lease(sqlite_sessions, job.id)
        other = JobSteps(sqlite_sessions, job.id)
        assert other.claim_step("validating", max_attempts=3)
        assert other.validate().status == "queued"
        with sqlite_sessions() as session:
            first = repo.shards(session, job.id)[0].id
        run_shard_to_commit(sqlite_sessions, job.id, first)
        check_output_empty(job)

    monkeypatch.setattr(paused, "_check_output_empty", taken_over_meanwhile)
    paused.validate()
    job = paused.load()
    assert job.status == "in_progress", (job.status, job.error)
    paused.fail("a fenced holder's failure")
    assert paused.load().status == "in_progress"


def test_a_late_cleanup_spares_a_retried_jobs_parts(sqlite_sessions, tmp_path) -> None:
    """Item 3: a job failed; its cleanup (holding the failed snapshot) is paused while the job is retried and a
    shard uploads its part. The late cleanup must not delete that part: the completed manifest's parts exist."""
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(2))
    request = new_job(str(path), str(tmp_path / "out"), shard_size=1)
    job = submit(sqlite_sessions, request).job
    assert JobSteps(sqlite_sessions, job.id).validate().status == "queued"
    with sqlite_sessions() as session:
        first, second = (s.id for s in repo.shards(session, job.id))
    run_shard_to_commit(sqlite_sessions, job.id, first, "row-0000")
    with sqlite_sessions.begin() as session:  # the job fails; its cleanup is paused before it starts
        ended = repo.get_job(session, job.id, for_update=True)
        claims.fail(ended, "a worker gave up")
    assert submit(sqlite_sessions, request).outcome == "retried"
    assert JobSteps(sqlite_sessions, job.id).validate().status == "queued"
    retried = ShardStep(JobSteps(sqlite_sessions, job.id))
    claim = retried.claim_shard(second, max_attempts=5)
    outcome = ShardOutcome(records=[record("row-0001", 1)])
    key = retried._write_part(claim.job, claim.shard, outcome, shard_step_module.shard_claim(second))
    discard_if_ended(sqlite_sessions, ended)  # the paused cleanup of the failed attempt resumes
    assert retried._complete_shard(claim.shard, outcome, key)
    assert finalize(sqlite_sessions, job.id).status == "completed"
    store = open_store(str(tmp_path / "out"))
    missing = sorted(set(manifest_parts(store)) - set(part_keys(store)))
    assert not missing, f"the manifest lists missing parts: {missing}"
    assert store.exists(MANIFEST_KEY)


def test_a_late_cleanup_spares_a_later_jobs_files_on_its_prefix(sqlite_sessions, tmp_path) -> None:
    """#55 path 6: a job is cancelled before it wrote anything; its cleanup is paused while a later job on the
    same output prefix runs and completes. The late cleanup must not delete the later job's manifest, error
    file or batch output (they have the same names)."""
    from storage.formats import BATCH_OUTPUT_KEY, ERRORS_KEY

    out = str(tmp_path / "out")
    first = submit(sqlite_sessions, new_job(str(write_parquet(tmp_path / "a.parquet", prompt_rows(1))), out,
                                            shard_size=1, openai_output=True)).job
    assert JobSteps(sqlite_sessions, first.id).validate().status == "queued"
    with sqlite_sessions.begin() as session:  # cancelled; its cleanup is paused before it starts
        ended = repo.get_job(session, first.id, for_update=True)
        claims.mark_cancelled(ended)
    later = submit(sqlite_sessions, new_job(str(write_parquet(tmp_path / "b.parquet", prompt_rows(1))), out,
                                            shard_size=1, openai_output=True)).job
    assert JobSteps(sqlite_sessions, later.id).validate().status == "queued"
    with sqlite_sessions() as session:
        (shard,) = (s.id for s in repo.shards(session, later.id))
    run_shard_to_commit(sqlite_sessions, later.id, shard, "row-0000")
    assert finalize(sqlite_sessions, later.id).status == "completed"
    discard_if_ended(sqlite_sessions, ended)  # the paused cleanup of the cancelled job resumes
    store = open_store(out)
    assert [key for key in (MANIFEST_KEY, ERRORS_KEY, BATCH_OUTPUT_KEY) if not store.exists(key)] == []
    assert json.loads(store.get_bytes(MANIFEST_KEY))["job_id"] == later.id


def test_a_finalizer_fenced_before_its_manifest_write_writes_none(sqlite_sessions, tmp_path, monkeypatch) -> None:
    """Item 10: the sweep fences a finalizer whose lease lapsed, between its last check and its manifest write.
    A manifest exists exactly when the job is completed."""
    job_id, output = finalizing_job(sqlite_sessions, tmp_path)
    finalizer = JobSteps(sqlite_sessions, job_id)
    assert finalizer.claim_step("finalizing", max_attempts=3)
    lapse_step_lease(sqlite_sessions, job_id)
    import workers.job_steps as job_steps_module

    real_write_manifest, swept = job_steps_module.write_manifest, []
    racer = threading.Thread(target=lambda: swept.append(sweep(sqlite_sessions).finalize))

    def fenced_then_write(store, document):
        racer.start()
        racer.join(timeout=2)  # the sweep fences it, unless the job row is locked for the write
        real_write_manifest(store, document)

    monkeypatch.setattr(job_steps_module, "write_manifest", fenced_then_write)
    job = finalizer.finalize()
    racer.join()
    status = finalizer.load().status
    manifest_written = open_store(output).exists(MANIFEST_KEY)
    assert manifest_written == (status == "completed"), (status, manifest_written, swept, job.status)
