"""Where KV blocks are kept: any object with `get(key) -> bytes | None` and `put(key, data)` (`ByteStore`). A local
directory and Redis are here; an object store plugs in the same way from outside the engine. Every value is
sealed with an HMAC-SHA256 tag over its key and bytes under the deployment's secret (`kv_secret`), so a block that
was cut short, altered, filed under another key or written by anyone without the secret is never trusted."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

MAGIC = b"TMKV\x02"  # format tag and version (1: an unkeyed sha256, no longer trusted)
DIGEST_SIZE = 32  # HMAC-SHA256
REDIS_TIMEOUT_S = 2.0  # connect and read: a Redis that hangs costs this, then the block is computed
KEY_PATTERN = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


class ByteStore(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


def seal(key: str, payload: bytes, secret: bytes) -> bytes:
    """The stored form of a block: format tag, HMAC-SHA256(secret; key, payload), payload."""
    return MAGIC + _tag(key, payload, secret) + payload


def unseal(key: str, data: bytes | None, size: int, secret: bytes) -> bytes | None:
    """The payload of a stored block, or None when it is missing, of the wrong size or its tag does not verify."""
    head = len(MAGIC) + DIGEST_SIZE
    if data is None or len(data) != head + size or not data.startswith(MAGIC):
        return None
    payload = memoryview(data)[head:]
    return bytes(payload) if hmac.compare_digest(_tag(key, payload, secret), data[len(MAGIC):head]) else None


def _tag(key: str, payload: bytes | memoryview, secret: bytes) -> bytes:
    name = key.encode()
    h = hmac.new(secret, len(name).to_bytes(4, "big") + name, hashlib.sha256)
    h.update(payload)
    return h.digest()


def contains(store: ByteStore, key: str) -> bool:
    """Does the store hold the key? Through its own `contains` where it has one (no read of the value)."""
    check = getattr(store, "contains", None)
    return check(key) if callable(check) else store.get(key) is not None


class DirectoryStore:
    """One file per key under a directory (a local path or a file:// URI), shared by every engine that mounts it.
    Files are written to a temporary name and renamed, so a reader never sees half a block."""

    def __init__(self, location: str | os.PathLike) -> None:
        text = str(location)
        if "://" in text:
            url = urlparse(text)
            if url.scheme != "file":
                raise ValueError(f"shared_storage_path must be a local path or a file:// URI, got {text!r} "
                                 "(an object store plugs in as kv_connector_extra_config['kv_store'])")
            text = unquote(url.path)
        self.root = Path(text)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not KEY_PATTERN.fullmatch(key) or ".." in key.split("/"):
            raise ValueError(f"bad store key {key!r}")
        return self.root / key

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, data)


class RedisStore:
    """Keys under `prefix` in a Redis database (redis-py, imported here only), for engines on different hosts.
    `ttl`: seconds a block is kept (None: until Redis evicts it, under its own maxmemory policy). `timeout_s`: the
    socket's connect and read limit, so a Redis that hangs raises (a store error) instead of stalling the step."""

    def __init__(self, url: str, prefix: str = "tokenmill:kv:", ttl: int | None = None,
                 timeout_s: float = REDIS_TIMEOUT_S) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self.ttl = ttl

    def get(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def put(self, key: str, data: bytes) -> None:
        self.client.set(self.prefix + key, data, ex=self.ttl)


def write_whole(path: Path, data: bytes) -> None:
    """Write path whole or not at all: a temporary file beside it, renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
