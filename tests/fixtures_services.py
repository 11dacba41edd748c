"""Fixtures of real services shared by the test packages: fresh PostgreSQL databases and a SeaweedFS S3 server
(tokenmill/stack/seaweedfs.sh). A conftest imports the fixtures it uses from here."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from storage import migrate
from storage.objectstore import S3Options, S3Store
from tokenmill.stack import local_stack as stack

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("TOKENMILL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
S3_ACCESS_KEY, S3_SECRET_KEY = "tokenmill", "tokenmill-secret"


# ---- PostgreSQL ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def pg_databases() -> Iterator:
    """A factory of fresh, uniquely named PostgreSQL databases; all dropped at the end of the session."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as error:
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL} (set TOKENMILL_TEST_PG_URL): {error}")
    created: list[str] = []

    def create() -> str:
        name = f"tokenmill_test_{uuid.uuid4().hex[:12]}"
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return str(admin.url.set(database=name).render_as_string(hide_password=False))

    yield create
    with admin.connect() as connection:
        for name in created:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            connection.execute(text(f'DROP ROLE IF EXISTS "{stack.service_role(name)}"'))  # made by `stack up`
    admin.dispose()


@pytest.fixture(scope="session")
def pg_url(pg_databases) -> str:
    """One migrated PostgreSQL database shared by the session's PostgreSQL tests."""
    url = pg_databases()
    migrate.upgrade(url)
    return url


# ---- SeaweedFS (S3) --------------------------------------------------------------------------------

def free_port_block(size: int = 8) -> int:
    """A base port with `size` consecutive free ports after it, below the kernel's ephemeral range: a port in it may
    be taken as the local end of some connection between this check and the server's bind (it happened)."""
    ephemeral_low = _ephemeral_ports()[0]
    for _ in range(200):
        base = random.randrange(10000, max(10001, ephemeral_low - size))
        if all(_port_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no block of free ports found")


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory) -> Iterator[S3Options]:
    """A SeaweedFS server for the session; AWS credentials for it are put in the environment."""
    workdir = tmp_path_factory.mktemp("seaweedfs")
    script = stack.SCRIPTS / "seaweedfs.sh"
    env = {**os.environ, "WEED": str(stack.wheel_binary("weed")), "S3_ACCESS_KEY": S3_ACCESS_KEY,
           "S3_SECRET_KEY": S3_SECRET_KEY}
    base = free_port_block()
    started = subprocess.run(["bash", str(script), "start", str(workdir), str(base)], env=env, capture_output=True,
                             text=True, timeout=120)
    assert started.returncode == 0, f"SeaweedFS did not start:\n{started.stdout}\n{started.stderr}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID=S3_ACCESS_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET_KEY, AWS_REGION="us-east-1")
    try:
        yield S3Options(endpoint_url=f"http://127.0.0.1:{base}")
    finally:
        subprocess.run(["bash", str(script), "stop", str(workdir)], env=env, timeout=60)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def session_bucket(seaweedfs: S3Options) -> str:
    name = f"tokenmill-test-{uuid.uuid4().hex[:8]}"
    S3Store(name, options=seaweedfs).client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_prefix(session_bucket: str) -> str:
    """An empty S3 prefix (s3://bucket/test-...) of this test's own; each bucket costs SeaweedFS 7 volumes."""
    return f"s3://{session_bucket}/test-{uuid.uuid4().hex[:12]}"
