"""Job-level metrics read from a real migrated database (SQLite and PostgreSQL) through a SQLAlchemy query
callable, served over HTTP and scraped."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from storage import db, migrate
from storage.models import Job, JobStatus, Shard
from tests.fixtures_services import pg_databases  # noqa: F401 - fixture
from tests.scrape import Scrape
from workers.job_metrics import JOB_STATUSES, serve_job_metrics


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    url = (f"sqlite:///{tmp_path / 'jobs.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_databases")())
    migrate.upgrade(url)
    factory = db.session_factory(db.make_engine(url))
    yield factory
    factory.kw["bind"].dispose()


def add_job(session, key: str, status: str, rows: tuple[int, int, int] = (0, 0, 0),
            shard_attempts: tuple[int, ...] = ()) -> Job:
    total, completed, failed = rows
    job = Job(idempotency_key=key, status=status, model="smollm2-135m", input_uri="file:///in.parquet",
              output_uri="file:///out/", requests_total=total, requests_completed=completed, requests_failed=failed)
    session.add(job)
    session.flush()
    for index, attempts in enumerate(shard_attempts):
        session.add(Shard(job_id=job.id, index=index, row_start=10 * index, row_end=10 * index + 10,
                          attempts=attempts))
    return job


def scrape(query) -> Scrape:
    server = serve_job_metrics(query, 0, "127.0.0.1")
    try:
        return Scrape.from_url(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()


def test_job_gauges_from_the_database(sessions):
    def query(sql: str):
        with sessions() as session:
            return session.execute(text(sql)).all()

    with sessions.begin() as session:
        running = add_job(session, "a", JobStatus.IN_PROGRESS, (100, 40, 2), shard_attempts=(1, 3, 2, 0))
        queued = add_job(session, "b", JobStatus.QUEUED, (50, 0, 0))
        add_job(session, "c", JobStatus.COMPLETED, (10, 10, 0), shard_attempts=(2,))
        add_job(session, "d", JobStatus.FAILED)
        add_job(session, "e", JobStatus.FAILED)
        running_id, queued_id = running.id, queued.id
    scraped = scrape(query)
    counts = {status: scraped.value("tokenmill:jobs", status=status) for status in JOB_STATUSES}
    assert counts == {**dict.fromkeys(JOB_STATUSES, 0), "in_progress": 1, "queued": 1, "completed": 1, "failed": 2}
    live = {"job_id": running_id, "status": "in_progress"}
    assert scraped.value("tokenmill:job_rows_total", **live) == 100
    assert scraped.value("tokenmill:job_rows_done", **live) == 42
    assert scraped.value("tokenmill:job_rows_failed", **live) == 2
    assert scraped.value("tokenmill:job_shard_retries", **live) == 3  # attempts 1, 3, 2, 0
    assert scraped.value("tokenmill:job_rows_total", job_id=queued_id, status="queued") == 50
    assert len(scraped.labelsets("tokenmill:job_rows_total")) == 2  # finished jobs are not exported per job
    assert scraped.value("tokenmill:shard_retries_total") == 4  # 3 of the live job + 1 of the completed one
    assert scraped.value("tokenmill:job_metrics_up") == 1


def test_a_database_that_does_not_answer_reads_as_down():
    def query(sql: str):
        raise ConnectionError("database is down")

    scraped = scrape(query)
    assert scraped.value("tokenmill:job_metrics_up") == 0
    assert not scraped.labelsets("tokenmill:jobs")
    assert scraped.value("process_resident_memory_bytes") > 0  # the process itself still reports
