"""Which errors are transient (a service down: wait and retry) and which are about the work itself, with errors
raised by the real clients against closed ports."""

from __future__ import annotations

import socket

import pytest
from botocore.exceptions import ClientError
from sqlalchemy import text

from storage import db
from storage.faults import is_transient
from storage.objectstore import S3Options, open_store


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raised(action) -> BaseException:
    with pytest.raises(Exception) as info:
        action()
    return info.value


def test_a_database_or_s3_that_is_down_is_transient(monkeypatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    engine = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/x?connect_timeout=2")
    assert is_transient(raised(lambda: engine.connect().execute(text("SELECT 1"))))
    store = open_store("s3://bucket/p", S3Options(endpoint_url=f"http://127.0.0.1:{closed_port()}"))
    assert is_transient(raised(lambda: store.get_bytes("k")))
    wrapped = raised(lambda: _reraise_as_runtime_error(lambda: store.get_bytes("k")))
    assert isinstance(wrapped, RuntimeError) and is_transient(wrapped)  # a cause below counts


def test_throttling_and_5xx_are_transient_but_a_missing_object_or_bad_value_is_not(tmp_path) -> None:
    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")

    assert is_transient(client_error("SlowDown", 503)) and is_transient(client_error("InternalError", 500))
    assert not is_transient(client_error("NoSuchKey", 404)) and not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(raised(lambda: open_store(str(tmp_path)).get_bytes("missing")))
    assert not is_transient(ValueError("seed must be an integer in [0, 2^63)"))
    assert not is_transient(RecursionError("maximum recursion depth exceeded"))


def _reraise_as_runtime_error(action) -> None:
    try:
        action()
    except Exception as error:
        raise RuntimeError("reading the input failed") from error
