"""Database URL resolution, engines and sessions. SQLite (WAL, foreign keys) is the embedded default."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

DATA_DIR_ENV = "TOKENMILL_DATA"
DATABASE_URL_ENV = "TOKENMILL_DATABASE_URL"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def data_dir() -> Path:
    """`$TOKENMILL_DATA`, else `$XDG_DATA_HOME/tokenmill`, else `~/.local/share/tokenmill`."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "tokenmill"


def default_url() -> str:
    return f"sqlite:///{data_dir() / 'tokenmill.db'}"


def resolve_url(url: str | None = None) -> str:
    """The explicit URL, else `$TOKENMILL_DATABASE_URL`, else the SQLite file under the data directory."""
    return url or os.environ.get(DATABASE_URL_ENV) or default_url()


def describe(url: str) -> str:
    """Where the database is, for people: the file path for SQLite, the URL without password otherwise."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return str(Path(parsed.database).resolve()) if parsed.database else "in-memory SQLite"
    return parsed.render_as_string(hide_password=True)


def make_engine(url: str | None = None, **kwargs) -> Engine:
    url = resolve_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
    event.listen(engine, "connect", _sqlite_connect)
    event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (see _sqlite_begin)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection) -> None:
    """Take the write lock up front: a read-then-write transaction in WAL mode could otherwise fail with
    "database is locked" when another process (say `tokenmill cancel`) wrote in between."""
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (the runner hands them to the CLI)."""
    return sessionmaker(engine, expire_on_commit=False)


def sql_query(sessions: sessionmaker[Session]):
    """A callable running SQL text on a fresh session: for collectors that import no SQLAlchemy."""
    def query(sql: str) -> list:
        with sessions() as session:
            return session.execute(text(sql)).all()

    return query
