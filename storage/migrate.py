"""Run Alembic from code: the migrations directory is found next to the installed `migrations` package,
so `tokenmill db upgrade` works without an alembic.ini."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from storage.db import make_engine, resolve_url


def migrations_dir() -> Path:
    import migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(url: str | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["url"] = resolve_url(url)  # attributes, not options: URLs may hold '%'
    return config


def upgrade(url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(url: str | None = None) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


class SchemaOutOfDate(RuntimeError):
    pass


def ensure_schema(url: str | None = None) -> None:
    """Bring the embedded SQLite database to head; for other databases only check and tell what to run."""
    url = resolve_url(url)
    current, head = current_revision(url), head_revision()
    if current == head:
        return
    if url.startswith("sqlite"):
        upgrade(url)
        return
    raise SchemaOutOfDate(f"the database schema is at {current or 'nothing (empty)'}, not {head}: "
                          f"run `tokenmill db upgrade --database-url ...` first")
