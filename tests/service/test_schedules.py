"""Nightly runs: schedules in the database, fired by Celery beat; at most one job per schedule and date.
The first tests need no service (SQLite); the last one runs on the stack, with beat firing every 2 s."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, text

from ingest.schedules import ScheduleError, add_schedule, due_date, fire_due, list_schedules, remove_schedule
from storage.models import Job, Schedule, ScheduleRun
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.service.conftest import wait_for_job, wait_until

ADDED = datetime(2026, 12, 1, 10, 30, 15, tzinfo=UTC)


def nightly(cron: str = "0 2 * * *") -> Schedule:
    return Schedule(name="n", cron=cron, input_pattern="in-{date}", output_pattern="out", model="m", settings={},
                    created_at=ADDED)


def test_due_date_is_the_latest_cron_time_not_before_the_schedule_was_added() -> None:
    assert due_date(nightly(), ADDED) is None  # 02:00 that day was before it was added
    assert due_date(nightly(), datetime(2026, 12, 2, 1, 59, tzinfo=UTC)) is None
    assert due_date(nightly(), datetime(2026, 12, 2, 2, 0, tzinfo=UTC)) == date(2026, 12, 2)
    assert due_date(nightly(), datetime(2026, 12, 5, 9, 0, tzinfo=UTC)) == date(2026, 12, 5)  # only the latest
    assert due_date(nightly("* * * * *"), ADDED) == date(2026, 12, 1)  # this minute counts


def test_add_refuses_bad_cron_patterns_settings_and_duplicate_names(sqlite_sessions, tmp_path: Path) -> None:
    sessions = sqlite_sessions
    good = dict(cron="0 2 * * *", input_pattern=str(tmp_path / "{date}.parquet"),
                output_pattern=str(tmp_path / "out-{date:%Y%m%d}"), model="smollm2-135m", settings={})
    add_schedule(sessions, "nightly", **good)
    with pytest.raises(ScheduleError, match="exists"):
        add_schedule(sessions, "nightly", **good)
    with pytest.raises(ScheduleError, match="bad cron expression '0 2 \\* \\*'"):
        add_schedule(sessions, "a", **{**good, "cron": "0 2 * *"})
    with pytest.raises(ScheduleError, match="bad pattern .*'day'"):
        add_schedule(sessions, "b", **{**good, "input_pattern": "s3://b/{day}.parquet"})
    with pytest.raises(ScheduleError, match="sampling: max_tokens must be an integer >= 1"):
        add_schedule(sessions, "c", **{**good, "settings": {"sampling": {"max_tokens": 0}}})
    with pytest.raises(ScheduleError, match="unknown schedule setting"):
        add_schedule(sessions, "d", **{**good, "settings": {"engine": {}}})
    assert [s.name for s, _ in list_schedules(sessions)] == ["nightly"]
    remove_schedule(sessions, "nightly")
    with pytest.raises(ScheduleError, match="no schedule named 'nightly'"):
        remove_schedule(sessions, "nightly")


def test_firing_twice_for_a_date_makes_one_job(sqlite_sessions, local_intake, tmp_path: Path) -> None:
    sessions, (intake, handed_out) = sqlite_sessions, local_intake
    add_schedule(sessions, "nightly", "* * * * *", str(tmp_path / "in-{date}.parquet"),
                 str(tmp_path / "out-{date}"), "smollm2-135m", {"sampling": {"max_tokens": 4}})
    now = datetime.now(UTC) + timedelta(seconds=1)
    first, second = fire_due(sessions, intake, now), fire_due(sessions, intake, now)
    assert len(first.created) == 1 and second.created == [] and second.existing == first.created
    assert handed_out == first.created  # handed to the workers once
    tomorrow = fire_due(sessions, intake, now + timedelta(days=1))
    assert len(tomorrow.created) == 1 and tomorrow.created != first.created
    with sessions() as session:
        jobs = {j.id: j for j in session.scalars(select(Job))}
        runs = list(session.scalars(select(ScheduleRun).order_by(ScheduleRun.run_date)))
    assert [r.job_id for r in runs] == first.created + tomorrow.created
    job = jobs[first.created[0]]
    assert (job.source, job.source_ref) == ("schedule", f"nightly@{now.date().isoformat()}")
    assert job.input_uri.endswith(f"in-{now.date().isoformat()}.parquet")
    assert job.settings.sampling == {"max_tokens": 4} and job.settings.executor == "celery"


def test_a_schedule_reading_or_writing_outside_the_allow_lists_fires_no_job(sqlite_sessions, local_intake,
                                                                            tmp_path: Path) -> None:
    from dataclasses import replace

    from ingest.policy import FrontDoorPolicy

    sessions, (intake, handed_out) = sqlite_sessions, local_intake
    intake = replace(intake, policy=FrontDoorPolicy.from_env("s3://tokenmill"))
    add_schedule(sessions, "local", "* * * * *", str(tmp_path / "in-{date}.parquet"), str(tmp_path / "out-{date}"),
                 "smollm2-135m", {})
    fired = fire_due(sessions, intake, datetime.now(UTC) + timedelta(seconds=1))
    assert fired.created == [] and handed_out == []
    assert "outside the allowed prefixes (s3://tokenmill; set by TOKENMILL_ALLOWED_OUTPUT_PREFIXES)" in fired.errors[0]
    with pytest.raises(ScheduleError, match="is not a model name"):
        add_schedule(sessions, "path", "* * * * *", "s3://tokenmill/{date}.parquet", "s3://tokenmill/o-{date}",
                     str(tmp_path), {})


@pytest.mark.real_model
def test_beat_firing_a_schedule_again_and_again_makes_one_job_for_the_date(stack, sessions, tmp_path) -> None:
    from celery import Celery

    name, today = f"nightly-{uuid.uuid4().hex[:6]}", datetime.now(UTC).date().isoformat()
    rows = prompt_rows(2, "nightly")
    stack.store(f"{stack.bucket}/daily/{today}").put_file("prompts.parquet",
                                                          write_parquet(tmp_path / "in.parquet", rows))
    stack.cli("schedule", "add", name, "--cron", "* * * * *", "--input",
              f"{stack.bucket}/daily/{{date}}/prompts.parquet", "--output", f"{stack.bucket}/{name}/{{date}}",
              "--max-tokens", "3", "--shard-size", "1")
    broker = stack.state["env"]["TOKENMILL_BROKER_URL"]
    app = Celery(broker=broker, backend=broker)
    try:  # beat fires every 2 s on its own; two more firings at once on top, on both workers
        results = [app.send_task("tokenmill.fire_schedules", queue="control") for _ in range(2)]
        fired = [r.get(timeout=120) for r in results]
    finally:
        app.close()
    assert not any(f["errors"] for f in fired)

    def runs():
        with sessions() as session:
            return session.execute(text("SELECT r.job_id FROM schedule_runs r JOIN schedules s ON s.id = "
                                        "r.schedule_id WHERE s.name = :n"), {"n": name}).scalars().all()

    job_id = wait_until(runs, "the schedule to fire")[0]
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed", job["error"]
    assert runs() == [job_id]
    listing = stack.cli("schedule", "list").stdout
    assert name in listing and today in listing
    with sessions() as session:
        jobs = session.execute(text("SELECT id FROM jobs WHERE source = 'schedule' AND source_ref = :ref"),
                               {"ref": f"{name}@{today}"}).scalars().all()
    assert jobs == [job_id]
    assert_each_id_once(stack.store(f"{stack.bucket}/{name}/{today}"), rows["custom_id"])
