"""Object stores (a local folder and SeaweedFS over S3) and the output URI safety check."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import objectstore
from storage.objectstore import (
    LocalStore,
    S3Options,
    S3Store,
    UnsafeURI,
    check_output_uri,
    normalize_uri,
    open_file_store,
    open_store,
)

# ---- URIs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("uri", ["out/../../etc", "/tmp/out/..", "file:///tmp/a/../b", "s3://bucket/a/../b",
                                 "s3://bucket/a/%2E%2E/b"])
def test_dot_dot_segments_are_rejected(uri: str) -> None:
    with pytest.raises(UnsafeURI, match=r"contains a '\.\.' segment"):
        check_output_uri(uri, allowed_prefixes=[])


def test_allowed_prefixes_match_whole_segments(tmp_path: Path) -> None:
    allowed = [str(tmp_path / "out"), "s3://bucket/results"]
    assert check_output_uri(str(tmp_path / "out" / "job1"), allowed) == f"file://{tmp_path}/out/job1"
    assert check_output_uri("s3://bucket/results/job1/", allowed) == "s3://bucket/results/job1"
    for outside in (str(tmp_path / "outside"), "s3://bucket/results-other", "s3://other/results", "/etc"):
        with pytest.raises(UnsafeURI, match="outside the allowed prefixes"):
            check_output_uri(outside, allowed)


def test_allowed_prefixes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_ALLOWED_OUTPUT_PREFIXES", "s3://a/x, s3://b")
    assert check_output_uri("s3://b/anything") == "s3://b/anything"
    with pytest.raises(UnsafeURI, match="TOKENMILL_ALLOWED_OUTPUT_PREFIXES"):
        check_output_uri("s3://a/y")


def test_uri_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize_uri("out/") == f"file://{tmp_path}/out"
    assert normalize_uri(f"file://{tmp_path}/x") == f"file://{tmp_path}/x"
    with pytest.raises(UnsafeURI, match="no bucket"):
        normalize_uri("s3:///key")
    with pytest.raises(UnsafeURI, match="unsupported URI scheme"):
        normalize_uri("http://example.com/x")


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://b/inbox/../secret.parquet", "segment"), ("s3://b/a//b", "segment"), ("s3://b/./a", "segment"),
    ("s3://b/a\x00b", "control characters"), ("s3://b/a\nb", "control characters"),
    ("s3://b/" + "k" * 1025, "over S3's 1024"), ("s3://b/" + "\u00e9" * 513, "over S3's 1024"),
    ("/tmp/a\x00b", "control characters"), ("/" + "p" * 5000, "4096"), ("s3://b c/x", "bucket"),
])
def test_keys_with_climbing_or_empty_segments_control_characters_or_too_long_are_refused(uri, message) -> None:
    with pytest.raises(UnsafeURI, match=message):
        normalize_uri(uri)


def test_front_door_allow_lists_default_to_the_bucket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ingest.policy import FrontDoorPolicy

    for name in ("TOKENMILL_ALLOWED_INPUT_PREFIXES", "TOKENMILL_ALLOWED_OUTPUT_PREFIXES"):
        monkeypatch.delenv(name, raising=False)
    policy = FrontDoorPolicy.from_env("s3://tokenmill")
    assert policy.check_input("s3://tokenmill/inbox/a.parquet") == "s3://tokenmill/inbox/a.parquet"
    for uri in (str(tmp_path / "in.parquet"), "s3://tokenmill-other/x", "s3://other/x"):
        with pytest.raises(UnsafeURI, match="input_uri: .* outside the allowed prefixes"):
            policy.check_input(uri)
    with pytest.raises(UnsafeURI, match="TOKENMILL_ALLOWED_OUTPUT_PREFIXES"):
        policy.check_output(str(tmp_path / "out"))
    monkeypatch.setenv("TOKENMILL_ALLOWED_INPUT_PREFIXES", f"s3://tokenmill, {tmp_path}")
    monkeypatch.setenv("TOKENMILL_ALLOWED_OUTPUT_PREFIXES", "*")
    opened = FrontDoorPolicy.from_env("s3://tokenmill")
    assert opened.check_input(str(tmp_path / "in.parquet")) == f"file://{tmp_path}/in.parquet"
    assert opened.check_output("/anywhere/at/all") == "file:///anywhere/at/all"
    with pytest.raises(UnsafeURI):
        opened.check_input("/etc/passwd")


def test_cache_salts_separate_tenants_and_cannot_be_chosen_to_collide() -> None:
    from ingest.policy import FrontDoorPolicy

    source = FrontDoorPolicy(cache_isolation="source")
    assert source.cache_salt(None, "s3:b/inbox/a", "k1") == source.cache_salt(None, "s3:b/inbox/a", "k2")
    assert source.cache_salt(None, "s3:b/inbox/a", "k1") != source.cache_salt(None, "s3:b/inbox/b", "k1")
    theirs = source.cache_salt("x", "s3:b/inbox/a", "k")
    assert source.cache_salt(theirs, "s3:b/inbox/b", "k") != theirs, "a spec cannot pick another tenant's salt"
    job = FrontDoorPolicy(cache_isolation="job")
    assert job.cache_salt(None, "t", "k1") != job.cache_salt(None, "t", "k2")
    assert FrontDoorPolicy(cache_isolation="spec").cache_salt("mine", "t", "k") == "mine"


# ---- local folder ----------------------------------------------------------------------------------


def test_local_put_replaces_whole_files_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "out")
    store.put_bytes("a/part-00000.parquet", b"first")
    store.put_bytes("a/part-00000.parquet", b"second version")
    assert store.get_bytes("a/part-00000.parquet") == b"second version"
    assert store.list() == ["a/part-00000.parquet"]
    assert [p.name for p in (tmp_path / "out" / "a").iterdir()] == ["part-00000.parquet"]
    assert (tmp_path / "out" / "a" / "part-00000.parquet").stat().st_mode & 0o044  # readable like open() files


def test_local_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("manifest.json", b"old")

    def failing_write(f):
        f.write(b"half of the new con")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store._atomic_write("manifest.json", failing_write)
    assert store.get_bytes("manifest.json") == b"old"
    assert store.list() == ["manifest.json"]


def test_local_fingerprint_changes_when_replaced(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("in.jsonl", b"1")
    first = store.fingerprint("in.jsonl")
    store.put_bytes("in.jsonl", b"22")
    assert store.fingerprint("in.jsonl") != first and store.size("in.jsonl") == 2
    assert store.exists("in.jsonl") and not store.exists("nope")


# ---- S3 (SeaweedFS) --------------------------------------------------------------------------------


def test_s3_put_get_list_exists(seaweedfs: S3Options, s3_prefix: str) -> None:
    store = open_store(f"{s3_prefix}/jobs/one", seaweedfs)
    assert isinstance(store, S3Store) and store.list() == []
    store.put_bytes("part-00000.parquet", b"abc")
    store.put_bytes("sub/errors.jsonl", b"{}\n")
    open_store(f"{s3_prefix}/jobs/one-other", seaweedfs).put_bytes("x", b"not mine")
    assert store.list() == ["part-00000.parquet", "sub/errors.jsonl"]
    assert store.get_bytes("sub/errors.jsonl") == b"{}\n"
    assert store.exists("part-00000.parquet") and not store.exists("missing")
    assert store.fingerprint("part-00000.parquet")["size"] == 3
    with pytest.raises(FileNotFoundError):
        store.open("missing")


def test_s3_multipart_upload_is_whole_when_visible(seaweedfs: S3Options, s3_prefix: str,
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(objectstore, "MULTIPART_THRESHOLD", 5 << 20)  # S3's smallest part size
    data = bytes(range(256)) * (24 << 10)  # 6 MiB: two parts
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    store = open_store(s3_prefix, seaweedfs)
    store.put_file("big.bin", path)
    head = store.client.head_object(Bucket=store.bucket, Key=store.key("big.bin"))
    assert head["ETag"].strip('"').endswith("-2")  # the multipart ETag: it did go up in parts
    assert store.get_bytes("big.bin") == data


def test_s3_reader_seeks_with_range_requests(seaweedfs: S3Options, s3_prefix: str) -> None:
    table = pa.table({"custom_id": [f"id-{i}" for i in range(3000)], "prompt": ["p"] * 3000})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=1000)
    open_store(s3_prefix, seaweedfs).put_bytes("in/data.parquet", sink.getvalue())
    store, key = open_file_store(f"{s3_prefix}/in/data.parquet", seaweedfs)
    with store.open(key) as f:
        parquet = pq.ParquetFile(f)
        assert parquet.metadata.num_rows == 3000
        assert parquet.read_row_group(2).column("custom_id")[0].as_py() == "id-2000"
        f.seek(-4, io.SEEK_END)
        assert f.read() == b"PAR1"
