"""Nightly runs. A schedule (name, cron in UTC, input and output patterns with a `{date}` placeholder, model,
job settings) lives in the database; beat's `fire_schedules` task makes the job of each schedule whose latest
cron time has passed. The job's idempotency key is (schedule, date), and `schedule_runs` is unique on it too,
so a schedule makes at most one job per date however often beat fires.

`{date}` is the date of the cron time (YYYY-MM-DD); `{date:%Y/%m/%d}` formats it. A schedule fires for cron
times from the minute it was added on; after downtime only the latest missed time fires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from cronsim import CronSim, CronSimError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from ingest.intake import Intake
from ingest.job_request import JobRequest, JobRequestError, validate_request
from storage.job_settings import CELERY
from storage.models import JobSource, Schedule, ScheduleRun, utcnow

log = logging.getLogger("tokenmill.schedules")

SETTINGS = ("sampling", "shard_size", "priority", "openai_output")


class ScheduleError(ValueError):
    pass


@dataclass
class Fired:
    created: list[str] = field(default_factory=list)  # job ids made now
    existing: list[str] = field(default_factory=list)  # due, but their job for that date was made before
    errors: list[str] = field(default_factory=list)


def request_for(schedule: Schedule, day: date) -> JobRequest:
    """The job spec of a schedule for one date; ScheduleError names a bad pattern or setting."""
    try:
        fields = {"input_uri": schedule.input_pattern.format(date=day),
                  "output_uri": schedule.output_pattern.format(date=day)}
    except (KeyError, IndexError, ValueError) as error:
        raise ScheduleError(f"schedule {schedule.name}: bad pattern ({error!r}); the placeholder is {{date}} "
                            f"or {{date:%Y/%m/%d}}") from None
    try:
        return validate_request({**fields, "model": schedule.model, **schedule.settings})
    except JobRequestError as error:
        raise ScheduleError(f"schedule {schedule.name}: {error}") from None


def due_date(schedule: Schedule, now: datetime) -> date | None:
    """The date of the schedule's latest cron time at or before now, if that is not before it was added."""
    latest = next(CronSim(schedule.cron, now.replace(microsecond=0) + timedelta(seconds=1), reverse=True))
    added = schedule.created_at.replace(second=0, microsecond=0)
    return latest.date() if latest >= added else None


def add_schedule(sessions: sessionmaker[Session], name: str, cron: str, input_pattern: str, output_pattern: str,
                 model: str, settings: dict[str, Any]) -> Schedule:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ScheduleError(f"unknown schedule setting(s) {unknown}; known: {', '.join(SETTINGS)}")
    try:
        CronSim(cron, utcnow())
    except CronSimError as error:
        raise ScheduleError(f"bad cron expression {cron!r}: {error} (five fields: minute hour day month "
                            f"weekday, in UTC)") from None
    schedule = Schedule(name=name, cron=cron, input_pattern=input_pattern, output_pattern=output_pattern,
                        model=model, settings=settings, enabled=True, created_at=utcnow())
    try:  # the patterns and settings make a valid job spec for the workers
        request_for(schedule, utcnow().date()).to_job(executor=CELERY)
    except JobRequestError as error:
        raise ScheduleError(f"schedule {name}: {error}") from None
    try:
        with sessions.begin() as session:
            session.add(schedule)
    except IntegrityError:
        raise ScheduleError(f"a schedule named {name!r} exists; remove it first") from None
    return schedule


def list_schedules(sessions: sessionmaker[Session]) -> list[tuple[Schedule, ScheduleRun | None]]:
    """Schedules by name, each with its latest run."""
    with sessions() as session:
        schedules = list(session.scalars(select(Schedule).order_by(Schedule.name)))
        return [(s, max(s.runs, key=lambda r: r.run_date, default=None)) for s in schedules]


def remove_schedule(sessions: sessionmaker[Session], name: str) -> None:
    with sessions.begin() as session:
        schedule = session.scalars(select(Schedule).where(Schedule.name == name)).one_or_none()
        if schedule is None:
            raise ScheduleError(f"no schedule named {name!r}")
        session.delete(schedule)


def fire_due(sessions: sessionmaker[Session], intake: Intake, now: datetime | None = None) -> Fired:
    """Make the job of every enabled schedule that is due, unless its job for that date exists."""
    now, fired = now or utcnow(), Fired()
    with sessions() as session:
        schedules = list(session.scalars(select(Schedule).where(Schedule.enabled.is_(True))))
    for schedule in schedules:
        day = due_date(schedule, now)
        if day is None:
            continue
        try:
            _fire(sessions, intake, schedule, day, fired)
        except (ScheduleError, JobRequestError) as error:
            log.error("%s", error)
            fired.errors.append(str(error))
    return fired


def _fire(sessions: sessionmaker[Session], intake: Intake, schedule: Schedule, day: date, fired: Fired) -> None:
    with sessions() as session:
        run = session.scalars(select(ScheduleRun).where(ScheduleRun.schedule_id == schedule.id,
                                                        ScheduleRun.run_date == day)).one_or_none()
    if run is not None:  # fired before for this date: nothing to do, not even to look the job up
        fired.existing.append(run.job_id)
        return
    submission = intake.accept(request_for(schedule, day), source=JobSource.SCHEDULE.value,
                               source_ref=f"{schedule.name}@{day.isoformat()}",
                               default_key=f"schedule-{schedule.name}-{day.isoformat()}", tenant=schedule.name)
    (fired.created if submission.outcome == "created" else fired.existing).append(submission.job.id)
    try:
        with sessions.begin() as session:
            session.add(ScheduleRun(schedule_id=schedule.id, run_date=day, job_id=submission.job.id,
                                    fired_at=utcnow()))
    except IntegrityError:  # recorded by the other firing
        pass
    if submission.outcome == "created":
        log.info("schedule %s: job %s for %s", schedule.name, submission.job.id, day)
