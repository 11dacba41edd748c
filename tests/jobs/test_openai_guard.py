"""The API's outer guard and its errors, on a real uvicorn server: body caps before the key check (also for a
chunked body of no declared size), OpenAI's error shape on every error, no internal text, /openapi.json behind
a key, and key checks that take no write lock on SQLite. No batch runs here: the model is never loaded."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest

from ingest.openai_api.objects import public_message
from tests.jobs.test_openai_api import MAX_UPLOAD, running_api

CHUNK = 64 << 10


@pytest.fixture
def api(sessions, tmp_path):
    with running_api(sessions, str(tmp_path / "bucket"), None) as running:
        yield running


def port_of(base_url: str) -> int:
    return urlparse(base_url).port


def read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        received = sock.recv(65536)
        assert received, "the server closed the connection without an answer"
        data += received
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body[:length])


def chunked_head(path: str, key: str | None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n{auth}"
            "Content-Type: multipart/form-data; boundary=xyz\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def first_part() -> bytes:
    return (b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--xyz\r\n'
            b'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n')


def test_a_chunked_body_without_a_key_is_answered_before_it_is_sent(api) -> None:
    base_url, *_ = api
    with socket.create_connection(("127.0.0.1", port_of(base_url)), timeout=10) as sock:
        sock.sendall(chunked_head("/v1/files", None) + chunk(first_part() + b"x" * CHUNK))
        status, body = read_response(sock)  # a gigabyte was coming; 64 KiB of it were sent
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_declared_length_over_the_cap_is_413_before_the_key(api) -> None:
    base_url, *_ = api
    with socket.create_connection(("127.0.0.1", port_of(base_url)), timeout=10) as sock:
        sock.sendall(b"POST /v1/batches HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000000\r\n\r\n{")
        status, body = read_response(sock)
    assert status == 413 and "--max-request-bytes" in body["error"]["message"]


def test_a_chunked_body_with_a_key_is_cut_at_the_cap(api) -> None:
    base_url, key, _, _ = api
    sent = 0
    with socket.create_connection(("127.0.0.1", port_of(base_url)), timeout=10) as sock:
        sock.sendall(chunked_head("/v1/files", key) + chunk(first_part()))
        try:
            while sent < 64 << 20:
                sock.sendall(chunk(b"x" * CHUNK))
                sent += CHUNK
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = read_response(sock)
    assert status == 413 and "--max-upload-bytes" in body["error"]["message"]
    assert sent < 16 << 20, f"{sent:,} bytes were taken for a cap of {MAX_UPLOAD:,}"


def call(url: str, key: str | None = None, method: str = "GET", data: bytes | None = None,
         content_type: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method=method)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    if content_type:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_every_error_has_openais_shape_and_no_internal_text(api, tmp_path) -> None:
    base_url, key, _, _ = api
    root = base_url.removesuffix("/v1")
    answers = [call(f"{base_url}/nothing", key), call(f"{base_url}/batches", key, "DELETE"),
               call(f"{base_url}/files", key, "POST", b"--zz\r\ngarbage", "multipart/form-data; boundary=zz"),
               call(f"{base_url}/files", key, "POST", b"{}", "application/json"),
               call(f"{base_url}/batches", key, "POST", b"not json", "application/json"),
               call(f"{base_url}/files/file-none", key), call(f"{root}/openapi.json")]
    assert [status for status, _ in answers] == [404, 405, 400, 400, 400, 404, 401]
    for _, body in answers:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert str(tmp_path) not in json.dumps(body) and "Traceback" not in json.dumps(body)
    status, spec = call(f"{root}/openapi.json", key)
    assert status == 200 and "/v1/files" in spec["paths"]


def test_job_errors_reach_clients_without_exception_text_or_paths() -> None:
    assert public_message("OSError: [Errno 28] No space left on device: '/srv/x'") == \
        "The server had an error while running this batch."
    message = public_message("input file:///srv/bucket/files/file-1.jsonl does not exist; see /var/lib/tm/x.log")
    assert "/srv" not in message and "/var/lib" not in message and "does not exist" in message
    assert public_message("duplicate custom_id 'a' on lines 1 and 2") == "duplicate custom_id 'a' on lines 1 and 2"


def test_errors_tell_nothing_of_the_services_inside() -> None:
    """#56 item 6: worker names, exception text after a shard's limit, database addresses and setting names stay
    inside, for the API's tenants and for the events topic's readers (who keep their own URIs)."""
    from storage.models import Job
    from workers.events import job_event

    failed = ("shard 3 (rows 6-7) failed 2 attempt(s), the limit; last: OperationalError: (psycopg.OperationalError) "
              "connection to server at \"10.0.4.17\", port 5432 failed; TOKENMILL_DATABASE_URL=postgresql://tm:pw@db/x")
    message = public_message(failed)
    assert message == ("shard 3 (rows 6-7) failed 2 attempt(s), the limit; last: the server had an error while "
                       "running it")
    died = public_message("shard 0 (rows 0-1) failed 2 attempt(s), the limit; last: its worker (gpu-7@node-12) died "
                          "while running it")
    assert died.endswith("last: its worker died while running it") and "node-12" not in died
    leaky = "output s3://team/out is outside $TOKENMILL_ALLOWED_OUTPUT_PREFIXES (redis at 127.0.0.1:6379)"
    for shown, uris in ((public_message(leaky), False), (public_message(leaky, uris=True), True)):
        assert "TOKENMILL_" not in shown and "127.0.0.1" not in shown and ("s3://team/out" in shown) is uris
    kafka = Job(id="j", source="kafka", error=failed, status="failed", requests_total=0, requests_completed=0,
                requests_failed=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0)
    assert job_event(kafka, "in_progress", "failed")["error"] == message


def test_key_checks_take_no_write_lock(api, sqlite_url) -> None:
    base_url, key, _, _ = api
    writer = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a job's write in progress: it holds the lock
    try:
        started = time.monotonic()
        assert call(f"{base_url}/batches", "tm-wrong")[0] == 401
        assert call(f"{base_url}/nothing", key)[0] == 404  # a live key, checked and routed
        assert time.monotonic() - started < 5
    finally:
        writer.execute("ROLLBACK")
        writer.close()


# ---- #56 item 5: one tenant cannot exhaust the API's memory or disk ------------------------------------

def multipart(*parts: tuple[str, str | None, bytes]) -> bytes:
    """A multipart/form-data body (boundary xyz) of (name, filename or None, content) parts."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--xyz\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return body + b"--xyz--\r\n"


def post_upload(base_url: str, key: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base_url}/files", data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "multipart/form-data; boundary=xyz"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_an_upload_carries_exactly_one_file_part(api) -> None:
    base_url, key, _, _ = api
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}\n'
    status, body = post_upload(base_url, key, multipart(("purpose", None, b"batch"), ("file", "a.jsonl", line),
                                                        ("file", "b.jsonl", line)))
    assert status == 400 and body["error"]["message"] == "Could not parse the request body.", body
    assert json.loads(urllib.request.urlopen(urllib.request.Request(  # nothing was stored
        f"{base_url}/files", headers={"Authorization": f"Bearer {key}"}), timeout=10).read())["data"] == []
    status, body = post_upload(base_url, key, multipart(("purpose", None, b"batch"), ("file", "a.jsonl", line)))
    assert status == 200 and body["bytes"] == len(line)


def slow_upload(base_url: str, key: str) -> socket.socket:
    """An upload whose body has begun and then stalls."""
    sock = socket.create_connection(("127.0.0.1", port_of(base_url)), timeout=30)
    sock.sendall(chunked_head("/v1/files", key) + chunk(first_part() + b"x" * 1024))
    return sock


def test_a_tenants_uploads_in_flight_are_bounded(api) -> None:
    from ingest.openai_api.guard import UPLOADS_PER_TENANT

    base_url, key, other_key, _ = api
    stalled = [slow_upload(base_url, key) for _ in range(UPLOADS_PER_TENANT)]
    try:
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port_of(base_url)), timeout=10) as sock:
            sock.sendall(chunked_head("/v1/files", key) + chunk(first_part()))
            status, body = read_response(sock)  # answered before its body is read
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
        status, _ = post_upload(base_url, other_key, multipart(("purpose", None, b"batch"),
                                                                ("file", "a.jsonl", line)))
        assert status == 200  # another tenant's uploads go on
    finally:
        for sock in stalled:
            sock.close()


def test_a_stalled_body_is_cut_with_408(api, monkeypatch) -> None:
    from ingest.openai_api import guard

    monkeypatch.setattr(guard, "BODY_IDLE_S", 1.0)
    base_url, key, _, _ = api
    started = time.monotonic()
    with slow_upload(base_url, key) as sock:
        status, body = read_response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert time.monotonic() - started < 10
