"""Object storage behind one interface: a local folder (`file://` or a plain path) or S3 via boto3.

Writes are all-or-nothing: locally a temp file in the same folder renamed over the target, on S3 a single
PUT or a multipart upload (S3 shows neither until it completes). Reads are seekable file objects, so
pyarrow can read a Parquet footer and then single row groups without fetching the whole object.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

ALLOWED_INPUT_PREFIXES_ENV = "TOKENMILL_ALLOWED_INPUT_PREFIXES"
ALLOWED_OUTPUT_PREFIXES_ENV = "TOKENMILL_ALLOWED_OUTPUT_PREFIXES"
ANYWHERE = "*"  # an allow-list entry that allows every URI
MAX_KEY_BYTES = 1024  # S3's limit on an object key
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX
TMP_PREFIX = ".tmp-"
MULTIPART_THRESHOLD = 64 << 20
READ_BUFFER = 1 << 20


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_current_umask()  # what open() would give; mkstemp alone makes files 0600


class InputChanged(ValueError):
    """A job's input is no longer the version validated: the job fails with this reason."""


class UnsafeURI(ValueError):
    """A URI that is malformed, climbs with `..`, has empty segments or control characters, is too long, or
    lies outside the allowed prefixes."""


@dataclass(frozen=True)
class S3Options:
    """Where S3 is; anything left None comes from the standard AWS settings (env, config files, roles).
    Secrets are never stored here: credentials come from the environment or a named profile."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> S3Options:
        return cls(**(data or {}))


# ---- URIs ------------------------------------------------------------------------------------------

def has_dot_dot(uri: str) -> bool:
    path = urlparse(uri).path if "://" in uri else uri
    return ".." in unquote(path).replace(os.sep, "/").split("/")


def check_key(key: str, what: str = "key") -> str:
    """An S3 key (or key prefix) as given, or UnsafeURI when it holds `.` or `..` segments, empty segments
    (`a//b`), control characters, or exceeds S3's 1024 bytes. One trailing slash (a folder) is allowed."""
    segments = key.removesuffix("/").split("/") if key else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise UnsafeURI(f"{what} {key!r} has an empty, '.' or '..' segment")
    if _has_control(key):
        raise UnsafeURI(f"{what} {key!r} holds control characters")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise UnsafeURI(f"{what} is {len(key.encode('utf-8', 'surrogatepass'))} bytes long, over S3's "
                        f"{MAX_KEY_BYTES}")
    return key


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000 for c in text)


def normalize_uri(uri: str) -> str:
    """`s3://bucket/prefix` or `file:///absolute/path`, without a trailing slash. S3 keys are refused when
    they hold `..`, empty segments or control characters (see `check_key`); local paths are made absolute
    (`..` resolved) and refused when they hold control characters or exceed PATH_MAX."""
    if not isinstance(uri, str) or not uri.strip():
        raise UnsafeURI("empty URI")
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket:
            raise UnsafeURI(f"{uri!r} has no bucket (expected s3://BUCKET/PREFIX)")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,255}", bucket):
            raise UnsafeURI(f"{uri!r}: {bucket!r} is not a valid bucket name")
        check_key(key, f"the key of {uri!r}")
        return f"s3://{bucket}/{key.removesuffix('/')}" if key.removesuffix("/") else f"s3://{bucket}"
    if "://" in uri and not uri.startswith("file://"):
        raise UnsafeURI(f"unsupported URI scheme in {uri!r} (use a path, file:// or s3://)")
    path = unquote(urlparse(uri).path) if uri.startswith("file://") else uri
    if _has_control(path):
        raise UnsafeURI(f"path {path!r} holds control characters")
    normalized = os.path.abspath(os.path.expanduser(path))
    if len(normalized.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise UnsafeURI(f"path is over {MAX_PATH_BYTES} bytes long")
    return "file://" + normalized


def is_under(uri: str, prefix: str) -> bool:
    """Segment-wise prefix test: s3://b/out is under s3://b but not under s3://b/o."""
    uri, prefix = normalize_uri(uri), normalize_uri(prefix)
    return uri == prefix or uri.startswith(prefix.rstrip("/") + "/")


def allowed_prefixes(env: str) -> list[str] | None:
    """The comma-separated URI prefixes of `$env`; None when it is unset or empty (no list: anywhere)."""
    raw = os.environ.get(env, "")
    prefixes = [p.strip() for p in raw.split(",") if p.strip()]
    return prefixes or None


def allowed_output_prefixes() -> list[str]:
    """From `$TOKENMILL_ALLOWED_OUTPUT_PREFIXES` (comma-separated); empty means anywhere."""
    return allowed_prefixes(ALLOWED_OUTPUT_PREFIXES_ENV) or []


def check_allowed(uri: str, prefixes: Iterable[str] | None, what: str, env: str) -> str:
    """The normalized URI, or UnsafeURI when it is not under one of prefixes (None or `*` in it: anywhere)."""
    normalized = normalize_uri(uri)
    if prefixes is None:
        return normalized
    prefixes = list(prefixes)
    if ANYWHERE in prefixes or any(is_under(normalized, p) for p in prefixes):
        return normalized
    listed = ", ".join(prefixes) or "none"
    raise UnsafeURI(f"{what} {uri!r} is outside the allowed prefixes ({listed}; set by {env})")


def check_output_uri(uri: str, allowed_prefixes: Iterable[str] | None = None) -> str:
    """The normalized output URI, or UnsafeURI when it has `..` segments or is outside the allowed prefixes."""
    if not isinstance(uri, str):
        raise UnsafeURI(f"output URI must be a string, got {type(uri).__name__}")
    if has_dot_dot(uri):
        raise UnsafeURI(f"output URI {uri!r} contains a '..' segment; give the folder without '..'")
    prefixes = list(allowed_output_prefixes() if allowed_prefixes is None else allowed_prefixes)
    return check_allowed(uri, prefixes or None, "output URI", ALLOWED_OUTPUT_PREFIXES_ENV)


def split_uri(uri: str) -> tuple[str, str]:
    """(parent URI, last segment): where a single input file lives and its name."""
    normalized = normalize_uri(uri)
    parent, _, name = normalized.rpartition("/")
    if not name or parent in ("s3:/", "file:/"):
        raise UnsafeURI(f"{uri!r} does not name a file")
    return parent if parent != "file://" else "file:///", name


# ---- stores ----------------------------------------------------------------------------------------

class ObjectStore(ABC):
    """Keys are '/'-separated and relative to the store's root URI."""

    uri: str

    def uri_of(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> None: ...

    @abstractmethod
    def put_stream(self, key: str, source: IO[bytes]) -> None:
        """Store what `source` yields from its position on, read in pieces (never whole in memory)."""

    @abstractmethod
    def open(self, key: str) -> IO[bytes]:
        """A seekable binary reader that fetches what is read, not the whole object."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under prefix, sorted; unfinished temp files are not listed."""

    @abstractmethod
    def fingerprint(self, key: str) -> dict[str, Any]:
        """Size and version (mtime or ETag): changes when the object is replaced."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object if it is there."""

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as f:
            return f.read()

    def pin(self, key: str, sha256: str | None = None) -> dict[str, Any]:
        """What the object is now, to read exactly this version later (`open_pinned`, `check_pin`). `sha256`: its
        hash, when a reader computed it on its way through (a store that pins by hash then reads nothing)."""
        return self.fingerprint(key)

    def check_pin(self, key: str, pin: dict[str, Any]) -> None:
        """InputChanged when the object is no longer the pinned version (checked cheaply: no hash)."""
        try:
            now = self.fingerprint(key)
        except FileNotFoundError:
            raise InputChanged(f"input {self.uri_of(key)} was removed since the job was validated") from None
        if any(now.get(name) != value for name, value in pin.items() if name != "sha256"):
            raise InputChanged(f"input {self.uri_of(key)} changed since the job was validated "
                               f"(pinned {_describe(pin)}, now {_describe(now)}); the job cannot mix two inputs")

    def open_pinned(self, key: str, pin: dict[str, Any]) -> IO[bytes]:
        """The pinned version of the object, or InputChanged."""
        self.check_pin(key, pin)
        return self.open(key)

    def size(self, key: str) -> int:
        return int(self.fingerprint(key)["size"])


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = "file://" + str(self.root.resolve())

    def path(self, key: str) -> Path:
        return self.root / key

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | Path) -> None:
        def copy(f: IO[bytes]) -> None:
            with open(path, "rb") as source:
                while chunk := source.read(READ_BUFFER):
                    f.write(chunk)

        self._atomic_write(key, copy)

    def put_stream(self, key: str, source: IO[bytes]) -> None:
        self._atomic_write(key, lambda f: shutil.copyfileobj(source, f, READ_BUFFER))

    def _atomic_write(self, key: str, write) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=target.parent)
        try:
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)

    def open(self, key: str) -> IO[bytes]:
        return open(self.path(key), "rb")

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        return sorted(k for k in keys if k.startswith(prefix) and not posixpath.basename(k).startswith(TMP_PREFIX))

    def fingerprint(self, key: str) -> dict[str, Any]:
        stat = self.path(key).stat()
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    def pin(self, key: str, sha256: str | None = None) -> dict[str, Any]:
        """Size and mtime (checked before and after every shard's read), and a hash (checked on a resume): the one
        given, else read here."""
        if sha256 is None:
            digest = hashlib.sha256()
            with self.open(key) as f:
                while chunk := f.read(READ_BUFFER):
                    digest.update(chunk)
            sha256 = digest.hexdigest()
        return {**self.fingerprint(key), "sha256": sha256}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None, client=None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.options = options or S3Options()
        self.client = client or s3_client(self.options)
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")

    def key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.key(key), Config=_transfer_config())

    def put_file(self, key: str, path: str | Path) -> None:
        self.client.upload_file(str(path), self.bucket, self.key(key), Config=_transfer_config())

    def put_stream(self, key: str, source: IO[bytes]) -> None:
        self.client.upload_fileobj(source, self.bucket, self.key(key), Config=_transfer_config())

    def open(self, key: str, if_match: str | None = None) -> IO[bytes]:
        reader = S3RangeReader(self.client, self.bucket, self.key(key), if_match)
        return io.BufferedReader(reader, buffer_size=READ_BUFFER)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(key))

    def open_pinned(self, key: str, pin: dict[str, Any]) -> IO[bytes]:
        """Every range request carries If-Match (the pinned ETag) and the VersionId where the bucket has one:
        a replaced object answers 412, which is InputChanged."""
        self.check_pin(key, pin)
        return self.open(key, if_match=pin.get("etag"))

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        root = f"{self.prefix}/" if self.prefix else ""
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + prefix):
            keys.extend(obj["Key"][len(root):] for obj in page.get("Contents", []))
        return sorted(keys)

    def fingerprint(self, key: str) -> dict[str, Any]:
        head = self._head(key)
        if head is None:
            raise FileNotFoundError(f"no object {self.uri_of(key)}")
        found = {"size": head["ContentLength"], "etag": head.get("ETag", "").strip('"')}
        if head.get("VersionId") and head["VersionId"] != "null":
            found["version_id"] = head["VersionId"]
        return found

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(key))
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise


def _describe(fingerprint: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(fingerprint.items()) if k != "sha256")


class S3RangeReader(io.RawIOBase):
    """Seekable reads of one S3 object by HTTP range requests."""

    def __init__(self, client, bucket: str, key: str, if_match: str | None = None) -> None:
        from botocore.exceptions import ClientError

        super().__init__()
        self.client, self.bucket, self.key, self.if_match = client, bucket, key, if_match
        self.position = 0
        try:
            self.length = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"no object s3://{bucket}/{key}") from None
            raise

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:
        end = min(self.position + len(buffer), self.length)
        if end <= self.position:
            return 0
        from botocore.exceptions import ClientError

        pinned = {"IfMatch": f'"{self.if_match}"'} if self.if_match else {}
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.position}-{end - 1}",
                                          **pinned)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise InputChanged(f"input s3://{self.bucket}/{self.key} changed since the job was validated "
                                   f"(its ETag is no longer {self.if_match}); the job cannot mix two inputs") from None
            raise
        data = body["Body"].read()
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)


def s3_client(options: S3Options):
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(profile_name=options.profile, region_name=options.region)
    custom_endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL")
    # standard retries back off on 5xx, throttling and timeouts; longer outages are the callers' to wait out
    config = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    # S3-compatible servers want path-style URLs and only the checksums S3 requires
                    **({"s3": {"addressing_style": "path"}, "request_checksum_calculation": "when_required",
                        "response_checksum_validation": "when_required"} if custom_endpoint else {}))
    return session.client("s3", endpoint_url=options.endpoint_url, config=config)


# While set (by the fault explorer, `workers.sim`), every store is this one's: normalized URI -> store
simulated_stores: Callable[[str], ObjectStore] | None = None


def open_store(uri: str, s3: S3Options | None = None) -> ObjectStore:
    """The store rooted at uri (a folder or an S3 prefix)."""
    normalized = normalize_uri(uri)
    if simulated_stores is not None:
        return simulated_stores(normalized)
    if normalized.startswith("s3://"):
        parsed = urlparse(normalized)
        return S3Store(parsed.netloc, parsed.path, s3)
    return LocalStore(normalized[len("file://"):])


def open_file_store(uri: str, s3: S3Options | None = None) -> tuple[ObjectStore, str]:
    """(store of the file's folder, the file's key) for a single-object URI such as a job's input."""
    parent, name = split_uri(uri)
    return open_store(parent, s3), name
