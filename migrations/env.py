"""Alembic environment: the URL (or an open connection) comes from `storage.migrate`, the metadata from
`storage.models`. Batch mode is on so ALTERs also work on SQLite."""

from __future__ import annotations

from alembic import context

from storage.db import make_engine
from storage.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.attributes["url"], target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_with(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_with(connection)
        return
    engine = make_engine(config.attributes["url"])
    try:
        with engine.connect() as connection:
            run_with(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
