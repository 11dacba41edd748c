"""#56 items 2 and 7: a tenant's quotas hold under concurrency, on SQLite and on PostgreSQL. Uploads reserve their
bytes before they are written, so concurrent uploads cannot all pass on the same headroom and a failed upload
leaves nothing uncounted; concurrent batches cannot pass the batches-in-progress limit together; a tenant's
batch checks (refused ones included) are bounded; and a DELETE racing `batches.create` cannot pull the input
from under a batch about to run. Each race is forced by slowing the step between check and record."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import openai
import pytest
from sqlalchemy import func, select

from ingest.openai_api import app as api_app
from ingest.openai_api.results import ABANDONED_UPLOAD_S, delete_expired_files
from storage.models import ApiBatch, ApiFile, Job, utcnow
from storage.objectstore import LocalStore, S3Options
from tests.jobs.conftest import migrated_sessions
from tests.jobs.test_openai_api import chat_line, client, jsonl, running_api
from tests.jobs.test_openai_guard import multipart, post_upload

ENDPOINT = "/v1/chat/completions"


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'quotas.db'}" if request.param == "sqlite" else \
        request.getfixturevalue("pg_databases")()
    factory = migrated_sessions(url)
    yield factory
    factory.kw["bind"].dispose()


@pytest.fixture
def parked(sessions, tmp_path):
    """An API whose batches are never run, with a small storage quota."""
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=lambda job_id: None,
                     max_tenant_bytes=1000) as running:
        yield running


def upload(sdk: openai.OpenAI, lines: list[dict], name: str = "input.jsonl"):
    return sdk.files.create(file=(name, jsonl(lines)), purpose="batch")


def uploads_folder(service) -> Path:
    return Path(service.bucket_uri.removeprefix("file://")) / "files"


def slowed(monkeypatch, target, name: str, seconds: float = 0.5) -> None:
    """`target.name` waits `seconds` first: the window between a quota's check and its record, held open."""
    original = getattr(target, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, slow)


def test_concurrent_uploads_cannot_pass_the_quota_together(parked, sessions, monkeypatch) -> None:
    base_url, key, _, service = parked
    line = chat_line("x", content="y" * 500)
    size = len(jsonl([line]))
    assert size <= 1000 < 2 * size  # room for one
    slowed(monkeypatch, LocalStore, "put_stream")
    sdk = client(base_url, key)
    with ThreadPoolExecutor(2) as pool:  # two: a tenant's uploads in flight (the guard answers a third 429)
        outcomes = list(pool.map(lambda _: _try(lambda: upload(sdk, [line])), range(2)))
    assert sum(not isinstance(o, Exception) for o in outcomes) == 1, outcomes
    assert [type(o) for o in outcomes if isinstance(o, Exception)] == [openai.PermissionDeniedError]
    with sessions() as db:
        assert db.scalar(select(func.sum(ApiFile.bytes)).where(ApiFile.deleted_at.is_(None))) == size
    assert len(list(uploads_folder(service).iterdir())) == 1


def _try(call):
    try:
        return call()
    except Exception as error:
        return error


def test_a_failed_upload_leaves_nothing_uncounted_and_odd_names_are_stored(parked, sessions, monkeypatch) -> None:
    base_url, key, _, service = parked
    sdk = client(base_url, key)
    line = jsonl([chat_line("a")])
    status, body = post_upload(base_url, key, multipart(("purpose", None, b"batch"),
                                                        ("file", "bad\x00na\x07me.jsonl", line)))
    assert status == 200, body  # PostgreSQL refuses NUL in text: it was a 500, with the object left uncounted
    stored = sdk.files.retrieve(body["id"])
    assert stored.filename == "badname.jsonl" and stored.bytes == len(line)

    def half_written(self, key, source) -> None:
        self.path(key).parent.mkdir(parents=True, exist_ok=True)
        self.path(key).write_bytes(source.read(10))
        raise OSError("the disk filled up")

    monkeypatch.setattr(LocalStore, "put_stream", half_written)
    with pytest.raises(openai.InternalServerError):
        upload(client(base_url, key), [chat_line("b")])
    assert [f.id for f in sdk.files.list()] == [stored.id]
    assert sorted(p.name for p in uploads_folder(service).iterdir()) == [f"{stored.id}.jsonl"]
    with sessions() as db:
        live = db.scalars(select(ApiFile).where(ApiFile.deleted_at.is_(None))).all()
    assert [row.id for row in live] == [stored.id]  # the failed one's reservation was released


def test_an_abandoned_upload_is_removed_by_the_cleanup(parked, sessions) -> None:
    base_url, key, _, service = parked
    folder = uploads_folder(service)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "file-abandoned.jsonl").write_bytes(b"{}\n")  # its writer died mid-write
    with sessions.begin() as db:
        db.add(ApiFile(id="file-abandoned", tenant="acme", purpose="batch", kind="upload", filename="x.jsonl",
                       bytes=900, uri=f"{service.bucket_uri}/files/file-abandoned.jsonl", ready_at=None,
                       created_at=utcnow() - timedelta(seconds=ABANDONED_UPLOAD_S + 60)))
    sdk = client(base_url, key)
    assert list(sdk.files.list()) == []  # not served while it is written
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve("file-abandoned")
    with pytest.raises(openai.PermissionDeniedError):  # but its bytes count
        upload(sdk, [chat_line("c", content="z" * 200)])
    assert delete_expired_files(sessions, S3Options()) == 1
    assert not (folder / "file-abandoned.jsonl").exists()
    upload(sdk, [chat_line("c", content="z" * 200)])


def test_concurrent_batches_cannot_pass_the_in_progress_limit_together(sessions, tmp_path, monkeypatch) -> None:
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=lambda job_id: None,
                     max_batches_in_progress=1) as (base_url, key, _, _):
        sdk = client(base_url, key)
        sources = [upload(sdk, [chat_line(f"r{i}")]).id for i in range(2)]
        slowed(monkeypatch, api_app, "check_lines")
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(lambda source: _try(lambda: sdk.batches.create(
                input_file_id=source, endpoint=ENDPOINT, completion_window="24h")), sources))
    assert sorted(o.status for o in outcomes) == ["failed", "validating"], outcomes  # OpenAI's: made, failed
    assert [o.errors.data[0].code for o in outcomes if o.status == "failed"] == ["batch_limit_exceeded"]
    with sessions() as db:
        assert sorted(db.scalars(select(Job.status))) == ["failed", "validating"]


def test_a_tenants_batch_checks_are_bounded_refused_ones_included(parked, monkeypatch) -> None:
    base_url, key, other_key, service = parked
    sdk = client(base_url, key)
    source = upload(sdk, [chat_line("r", "gpt-5")]).id  # each of its batches is refused at creation
    other_source = upload(client(base_url, other_key), [chat_line("r")]).id
    slowed(monkeypatch, api_app, "check_lines", 1.0)
    create = lambda who, file_id: _try(lambda: client(base_url, who).batches.create(
        input_file_id=file_id, endpoint=ENDPOINT, completion_window="24h"))
    with ThreadPoolExecutor(4) as pool:
        mine = [pool.submit(create, key, source) for _ in range(3)]
        time.sleep(0.3)
        theirs = pool.submit(create, other_key, other_source)
        outcomes = [future.result() for future in mine]
        assert not isinstance(theirs.result(), Exception)  # another tenant is not held up
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(refused) == 1 and isinstance(refused[0], openai.RateLimitError) and \
        refused[0].code == "rate_limit_exceeded", outcomes
    assert all(o.status == "failed" for o in outcomes if not isinstance(o, Exception))
    assert service.checks.limit == 2


def test_a_delete_racing_batch_creation_cannot_remove_its_input(parked, sessions, monkeypatch) -> None:
    """#56 item 7: the input deleted while the batch is being checked: the batch is refused and no job runs."""
    base_url, key, _, service = parked
    sdk = client(base_url, key)
    source = upload(sdk, [chat_line("r")]).id
    checking = threading.Event()
    original = api_app.check_lines

    def check_then_wait(*args, **kwargs):
        result = original(*args, **kwargs)
        checking.set()
        time.sleep(1.0)
        return result

    monkeypatch.setattr(api_app, "check_lines", check_then_wait)
    with ThreadPoolExecutor(1) as pool:
        creating = pool.submit(_try, lambda: sdk.batches.create(input_file_id=source, endpoint=ENDPOINT,
                                                                completion_window="24h"))
        assert checking.wait(10)
        deleted = _try(lambda: client(base_url, key).files.delete(source))
        created = creating.result()
    assert not isinstance(deleted, Exception) and deleted.deleted
    assert isinstance(created, openai.NotFoundError), created
    with sessions() as db:
        assert db.scalar(select(func.count()).select_from(ApiBatch)) == 0
        assert db.scalar(select(func.count()).select_from(Job)) == 0


def test_a_409_tells_the_sdk_not_to_retry(parked) -> None:
    """#57 item 6: OpenAI's SDK retries a 409 unless `x-should-retry: false` says otherwise."""
    base_url, key, _, _ = parked
    sent = []
    sdk = openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=30,
                        http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}))
    source = upload(sdk, [chat_line("r")])
    sdk.batches.create(input_file_id=source.id, endpoint=ENDPOINT, completion_window="24h")
    sent.clear()
    with pytest.raises(openai.ConflictError) as refused:
        sdk.files.delete(source.id)  # the input of a batch not yet ended
    assert refused.value.response.headers["x-should-retry"] == "false" and len(sent) == 1
