"""Fixtures for the job tests: real SQLite and PostgreSQL databases, a real SeaweedFS S3 server (started with
tokenmill/stack/seaweedfs.sh; see tests/fixtures_services.py), and the real bundled model, loaded once for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import db, migrate
from tests.fixtures_services import (  # noqa: F401 - fixtures used by the job tests
    pg_databases,
    pg_url,
    s3_prefix,
    seaweedfs,
    session_bucket,
)

ENGINE_SETTINGS = {"num_threads": 2, "kv_cache_memory": 256 << 20, "max_num_seqs": 32}


def migrated_sessions(url: str):
    migrate.upgrade(url)
    return db.session_factory(db.make_engine(url))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


@pytest.fixture
def sessions(sqlite_url: str):
    """A migrated SQLite database of this test's own."""
    factory = migrated_sessions(sqlite_url)
    yield factory
    factory.kw["bind"].dispose()


# ---- the model -------------------------------------------------------------------------------------

@pytest.fixture(scope="package")  # freed when the job tests end
def llm_engine():
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(**ENGINE_SETTINGS))


@pytest.fixture
def engine_service(llm_engine):
    """An engine service (`workers.engine_loop.EngineLoop`) over the session's engine, closed after the test."""
    from workers.engine_loop import EngineLoop

    service = EngineLoop(llm_engine)
    yield service
    service.close()


@pytest.fixture
def engine_provider(llm_engine):
    """Hands the session's engine to run_job whatever settings the job asks for."""
    return lambda settings: llm_engine
