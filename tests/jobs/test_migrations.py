"""Alembic owns the schema: upgrade from empty, downgrade back, no drift from the models, and a `job_status`
view that computes the same on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from storage import db, migrate
from storage.models import Base, Job, Shard, utcnow

TABLES = {"jobs", "shards", "row_errors"}
VIEW_COLUMNS = ["job_id", "status", "source", "model", "input_uri", "output_uri", "requests_total",
                "requests_completed", "requests_failed", "progress", "shards_total", "shards_completed",
                "prompt_tokens", "completion_tokens", "cached_tokens", "created_at", "started_at", "finished_at",
                "duration_s", "tokens_per_s", "error"]


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("pg_databases")()


def test_upgrade_from_empty_and_downgrade_back(empty_url: str) -> None:
    engine = db.make_engine(empty_url)
    try:
        assert migrate.current_revision(empty_url) is None
        migrate.upgrade(empty_url)
        assert migrate.current_revision(empty_url) == migrate.head_revision()
        inspector = inspect(engine)
        assert TABLES <= set(inspector.get_table_names())
        assert "job_status" in inspector.get_view_names()
        with engine.connect() as connection:
            assert list(connection.execute(text("SELECT * FROM job_status")).keys()) == VIEW_COLUMNS
            diff = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}),
                                    Base.metadata)
        assert diff == [], f"the models and the migrations disagree: {diff}"
        migrate.downgrade(empty_url, "base")
        inspector = inspect(engine)
        assert migrate.current_revision(empty_url) is None
        assert not TABLES & set(inspector.get_table_names()) and inspector.get_view_names() == []
        migrate.upgrade(empty_url)  # and up again
        assert migrate.current_revision(empty_url) == migrate.head_revision()
    finally:
        engine.dispose()


def test_job_status_view_counts_and_rates(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    engine = db.make_engine(empty_url)
    sessions = db.session_factory(engine)
    started = utcnow() - timedelta(seconds=100)
    with sessions.begin() as session:
        job = Job(id="j1", idempotency_key="k1", status="completed", model="m", input_uri="in", output_uri="out",
                  settings={}, requests_total=10, requests_completed=7, requests_failed=3, prompt_tokens=50,
                  completion_tokens=400, cached_tokens=20, created_at=started, in_progress_at=started,
                  completed_at=started + timedelta(seconds=80))
        live = Job(id="j2", idempotency_key="k2", status="validating", model="m", input_uri="in", output_uri="o2",
                   settings={}, created_at=utcnow())
        session.add_all([job, live])
        session.flush()
        session.add_all([Shard(job_id="j1", index=i, row_start=5 * i, row_end=5 * i + 5,
                               status="completed" if i == 0 else "pending") for i in range(2)])
    with engine.connect() as connection:
        rows = {r.job_id: r for r in connection.execute(text("SELECT * FROM job_status"))}
    done, waiting = rows["j1"], rows["j2"]
    assert (done.requests_total, done.requests_completed, done.requests_failed) == (10, 7, 3)
    assert done.progress == pytest.approx(1.0)
    assert (done.shards_total, done.shards_completed) == (2, 1)
    assert done.duration_s == pytest.approx(80, abs=0.01)
    assert done.tokens_per_s == pytest.approx(5.0, rel=1e-3)
    assert done.finished_at is not None and done.started_at is not None
    assert (waiting.progress, waiting.shards_total, waiting.duration_s, waiting.finished_at) == (0, 0, None, None)
    engine.dispose()


def test_ensure_schema_upgrades_sqlite_but_only_checks_postgres(tmp_path, pg_databases) -> None:
    url = f"sqlite:///{tmp_path / 'fresh' / 'tokenmill.db'}"
    migrate.ensure_schema(url)
    assert migrate.current_revision(url) == migrate.head_revision()
    with pytest.raises(migrate.SchemaOutOfDate, match="run `tokenmill db upgrade"):
        migrate.ensure_schema(pg_databases())


def test_default_database_location(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("TOKENMILL_DATABASE_URL", raising=False)
    monkeypatch.setenv("TOKENMILL_DATA", str(tmp_path))
    assert db.resolve_url() == f"sqlite:///{tmp_path / 'tokenmill.db'}"
    monkeypatch.setenv("TOKENMILL_DATABASE_URL", "postgresql+psycopg://u:secret@h/d")
    assert db.resolve_url() == "postgresql+psycopg://u:secret@h/d"
    assert "secret" not in db.describe(db.resolve_url())
    assert db.resolve_url("sqlite:///x.db") == "sqlite:///x.db"
