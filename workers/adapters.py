"""LoRA adapters as a job's rows name them (docs/lora.md): a row whose `model` is an adapter's name runs with it.

The adapters a shard may use are the job's own (its `lora_modules`) and its worker's (`tokenmill worker
--lora-modules`); a name both give is the job's. Each is a PEFT directory: a local one is used in place, an s3://
prefix is fetched once into the adapter cache (`$TOKENMILL_DATA/lora-cache`), under a key of its URI and its
objects' sizes and ETags, so a changed adapter is fetched again and an unchanged one never (every worker process on
the machine shares the cache; a shard only lists the prefix). The cache holds at most `TOKENMILL_LORA_CACHE_BYTES`:
past it, the least recently used entries go, never one that a `LoRARequest` of a live shard names (each such
request holds a shared `flock` on its entry until it is freed). Adapters are resolved on the shard's thread, before
its rows go to the engine thread: one that cannot be fetched fails the rows that name it, a store that is down
fails the shard as any outage does (it is tried again). Each adapter gets an id derived from its name and directory
(`LoRARequest.lora_int_id`, the same in every process); the engine keys its prefix cache on the adapter's weights,
not on the id."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.faults import is_transient
from storage.objectstore import READ_BUFFER, S3Options, S3Store, open_store

if TYPE_CHECKING:
    from engine import LoRARequest
    from storage.models import Job

log = logging.getLogger("tokenmill.adapters")

CACHE_DIR = "lora-cache"  # under the data directory
SOURCE_FILE = "tokenmill-source.json"  # written last into a cache entry: where it came from, and when
TMP_PREFIX = ".tmp-"
LOCK_DIR = ".locks"  # under the cache: one lock file per entry, held while it is downloaded (`download_lock`)
MAX_ADAPTER_BYTES = int(os.environ.get("TOKENMILL_MAX_ADAPTER_BYTES") or 4 << 30)  # one adapter's files at most
DEFAULT_CACHE_BYTES = 32 << 30  # the whole cache, least recently used entries evicted past it
STALE_STAGING_S = 24 * 3600  # a download's temporary folder older than this was left by a crash


class AdapterUnavailable(ValueError):
    """An adapter that cannot be fetched: no objects under its prefix, too large, not a directory."""


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter lives: a file:// directory or an s3:// prefix, and the S3 settings that read it."""

    uri: str
    s3: S3Options = field(default_factory=S3Options)


def job_adapters(job: Job, worker: Mapping[str, AdapterSource] | None = None) -> dict[str, AdapterSource]:
    """The adapters a job's rows may name: the worker's, then the job's own (which win a name both give)."""
    own = {name: AdapterSource(uri, job.settings.s3) for name, uri in job.settings.lora_modules.items()}
    return {**(worker or {}), **own}


def worker_adapters(modules: Mapping[str, str], s3: S3Options) -> dict[str, AdapterSource]:
    """`tokenmill worker --lora-modules` as sources (local directories made absolute)."""
    from storage.objectstore import normalize_uri

    return {name: AdapterSource(normalize_uri(uri), s3) for name, uri in modules.items()}


# ---- resolving a shard's adapters --------------------------------------------------------------------

def lora_request(name: str, directory: str | Path) -> LoRARequest:
    """The engine's request for this adapter. Its id is derived from the name and directory (`adapter_id`), so it
    is the same in every process and needs no table of ids given out."""
    from engine import LoRARequest

    return LoRARequest(name, adapter_id(name, directory), str(directory))


def adapter_id(name: str, directory: str | Path) -> int:
    """A positive id of 62 bits from a hash of the adapter's name and directory. Ids of different adapters could
    only collide by chance (about 1 in 2^62 a pair), and even then the engine tells them apart: it keys a loaded
    adapter by id, name, directory and files (`engine.lora.manager`)."""
    digest = hashlib.sha256(f"{name}\0{directory}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 2) or 1


def resolve_adapters(names: Iterable[str], sources: Mapping[str, AdapterSource],
                     cache: Path | None = None) -> dict[str, LoRARequest | str]:
    """For each adapter name: its `LoRARequest` (fetched into the cache if it lives in S3), or why it cannot be
    served (its rows fail with that). A store that is down raises (not the adapter's fault: the shard is retried)."""
    resolved: dict[str, LoRARequest | str] = {}
    for name in sorted(set(names)):
        source = sources[name]
        try:
            if source.uri.startswith("file://"):
                resolved[name] = lora_request(name, local_dir(source))
                continue
            entry, pin = fetch_pinned(source, cache or cache_root())
            request = resolved[name] = lora_request(name, entry)
            weakref.finalize(request, pin.release)  # the entry stays while the shard holds its request
        except Exception as error:
            if is_transient(error):
                raise
            resolved[name] = f"adapter {name!r} ({source.uri}) cannot be served: {error}"
            log.warning("%s", resolved[name])
    return resolved


def local_dir(source: AdapterSource, cache: Path | None = None) -> Path:
    """The adapter's directory on this machine: a local one as it is, an S3 one from the cache (fetched when its
    objects are not cached yet)."""
    if source.uri.startswith("file://"):
        directory = Path(source.uri[len("file://"):])
        if not directory.is_dir():
            raise AdapterUnavailable(f"no directory {directory}")
        return directory
    return fetch(source, cache or cache_root())


# ---- the S3 cache ------------------------------------------------------------------------------------

def cache_root() -> Path:
    from storage.db import data_dir

    return data_dir() / CACHE_DIR


def fetch(source: AdapterSource, cache: Path) -> Path:
    """The cache entry of the adapter's objects as they are now (listed, not downloaded, when cached already)."""
    entry, pin = fetch_pinned(source, cache)
    pin.release()
    return entry


def fetch_pinned(source: AdapterSource, cache: Path, max_bytes: int | None = None) -> tuple[Path, EntryPin]:
    """`fetch`, and a pin that keeps the entry from eviction until released. After a download, the least recently
    used entries past `max_bytes` (default: `cache_limit_bytes()`) are evicted."""
    store = open_store(source.uri, source.s3)
    assert isinstance(store, S3Store)
    objects = list_adapter(store)
    entry = cache / entry_name(source.uri, objects)
    for _ in range(3):  # an entry evicted between finding and pinning it is fetched again
        if (pin := EntryPin.take(entry)) is not None:
            return entry, pin
        with download_lock(entry):  # one download of an entry at a time, among threads and processes alike
            if not (entry / SOURCE_FILE).is_file():
                _download(store, objects, entry)
                pin = EntryPin.take(entry)
                if pin is not None:
                    evict(cache, cache_limit_bytes() if max_bytes is None else max_bytes)
                    return entry, pin
    raise AdapterUnavailable(f"{store.uri}/: its cache entry {entry} was evicted as soon as it was fetched, three "
                             "times (TOKENMILL_LORA_CACHE_BYTES too small for the adapters in use?)")


@contextlib.contextmanager
def download_lock(entry: Path) -> Iterator[None]:
    """An exclusive `flock` on the entry's lock file (`LOCK_DIR`, beside the entries), held while it is fetched:
    each holder opens the file anew, so it excludes the other threads of this process as well as other processes,
    with no table of locks kept in memory, and a crashed holder's lock goes with it. The lock files are empty and
    stay (one per entry name ever fetched); eviction passes them by."""
    locks = entry.parent / LOCK_DIR
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / entry.name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---- eviction ----------------------------------------------------------------------------------------

def cache_limit_bytes() -> int:
    """The adapter cache's size limit: `TOKENMILL_LORA_CACHE_BYTES`, else DEFAULT_CACHE_BYTES."""
    value = os.environ.get("TOKENMILL_LORA_CACHE_BYTES")
    try:
        return int(value) if value else DEFAULT_CACHE_BYTES
    except ValueError:  # the worker's setting, not the rows' fault: they still run
        log.warning("TOKENMILL_LORA_CACHE_BYTES=%r is not a number of bytes; the adapter cache holds %d GiB",
                    value, DEFAULT_CACHE_BYTES >> 30)
        return DEFAULT_CACHE_BYTES


class EntryPin:
    """A shared `flock` on a cache entry's source file, stamping it used now: no process evicts the entry while a
    pin on it is held (a crashed process's pins go with it)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def take(cls, entry: Path) -> EntryPin | None:
        """A pin on the whole entry; None when there is none (never fetched, or evicted meanwhile)."""
        path = entry / SOURCE_FILE
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out an eviction under way
            evicted = os.stat(path).st_ino != os.fstat(fd).st_ino  # (and maybe fetched again) meanwhile
        except OSError:
            evicted = True
        if evicted:
            os.close(fd)
            return None
        try:
            os.utime(path)  # the least recently used entries are evicted first
        except OSError:
            log.warning("cannot stamp adapter cache entry %s as used", entry)
        return cls(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    __del__ = release


def evict(cache: Path, max_bytes: int) -> list[Path]:
    """Remove the least recently used entries until the cache holds at most `max_bytes`, skipping pinned ones (and
    downloads a crash left behind); the entries removed."""
    if not cache.is_dir():
        return []
    entries = []
    for child in cache.iterdir():
        try:
            if child.name.startswith(TMP_PREFIX):
                if time.time() - child.stat().st_mtime > STALE_STAGING_S:
                    shutil.rmtree(child, ignore_errors=True)
                continue
            source = child / SOURCE_FILE
            used_at = source.stat().st_mtime
            size = sum(entry[1] for entry in json.loads(source.read_text()).get("objects", []))
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            continue  # being evicted, or not an entry
        entries.append((used_at, size, child))
    total = sum(size for _, size, _ in entries)
    evicted = []
    for _, size, entry in sorted(entries, key=lambda item: item[0]):
        if total <= max_bytes:
            break
        if _evict_entry(entry, cache):
            total -= size
            evicted.append(entry)
            log.info("evicted adapter %s (%.1f MiB) from the cache, least recently used (limit %.1f GiB, "
                     "TOKENMILL_LORA_CACHE_BYTES)", entry.name, size / 2**20, max_bytes / 2**30)
    if total > max_bytes:
        log.warning("the adapter cache holds %.1f GiB, over its limit of %.1f GiB: the rest is in use",
                    total / 2**30, max_bytes / 2**30)
    return evicted


def _evict_entry(entry: Path, cache: Path) -> bool:
    try:
        fd = os.open(entry / SOURCE_FILE, os.O_RDONLY)
    except OSError:
        return False
    doomed = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a pin is held, in any process
        doomed = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}evict-", dir=cache))
        os.rename(entry, doomed / entry.name)  # gone at once for any reader; removed below
    except OSError:  # pinned, or another process evicts it
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)
        return False
    finally:
        os.close(fd)
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def list_adapter(store: S3Store) -> list[tuple[str, int, str]]:
    """(name, size, ETag) of the objects directly under the adapter's prefix, sorted; AdapterUnavailable when there
    are none or they are too large."""
    root = f"{store.prefix}/" if store.prefix else ""
    objects = []
    for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=root,
                                                                        Delimiter="/"):
        objects.extend((item["Key"][len(root):], int(item["Size"]), item.get("ETag", "").strip('"'))
                       for item in page.get("Contents", []))
    objects = [entry for entry in objects if entry[0] not in ("", ".", "..", SOURCE_FILE)
               and not entry[0].startswith(TMP_PREFIX)]
    if not objects:
        raise AdapterUnavailable(f"no objects under {store.uri}/ (expected a PEFT adapter directory: "
                                 f"adapter_config.json, adapter_model.safetensors)")
    total = sum(size for _, size, _ in objects)
    if total > MAX_ADAPTER_BYTES:
        raise AdapterUnavailable(f"{store.uri}/ holds {total:,} bytes, over the limit of {MAX_ADAPTER_BYTES:,} "
                                 f"(TOKENMILL_MAX_ADAPTER_BYTES)")
    return sorted(objects)


def entry_name(uri: str, objects: list[tuple[str, int, str]]) -> str:
    """The cache key: the adapter's URI and what lies under it (names, sizes, ETags)."""
    digest = hashlib.sha256(json.dumps([uri, objects]).encode()).hexdigest()
    return f"{uri.rstrip('/').rsplit('/', 1)[-1][:40]}-{digest[:24]}"


def _download(store: S3Store, objects: list[tuple[str, int, str]], entry: Path) -> None:
    started = time.perf_counter()
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=entry.parent))
    try:
        for name, _, etag in objects:  # this version of each object, or an error (412) should it change meanwhile
            body = store.client.get_object(Bucket=store.bucket, Key=store.key(name),
                                           **({"IfMatch": f'"{etag}"'} if etag else {}))["Body"]
            with body, open(staging / name, "wb") as f:
                shutil.copyfileobj(body, f, READ_BUFFER)
        (staging / SOURCE_FILE).write_text(json.dumps({"uri": store.uri, "objects": objects,
                                                       "fetched_at": time.time()}))
        try:
            os.rename(staging, entry)
        except OSError:  # another process put the same entry there first
            if not (entry / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("fetched adapter %s (%d files, %.1f MiB) into %s in %.1f s", store.uri, len(objects),
             sum(size for _, size, _ in objects) / 2**20, entry, time.perf_counter() - started)


def cached_adapters(cache: Path | None = None) -> list[dict[str, Any]]:
    """The adapters in the cache: uri, path, bytes, fetched_at (seconds since the epoch), newest first."""
    root = cache or cache_root()
    found = []
    for source in root.glob(f"*/{SOURCE_FILE}") if root.is_dir() else ():
        try:
            document = json.loads(source.read_text())
        except (OSError, ValueError):
            continue
        found.append({"uri": document.get("uri", "?"), "path": str(source.parent),
                      "bytes": sum(size for _, size, _ in document.get("objects", [])),
                      "fetched_at": document.get("fetched_at", 0)})
    return sorted(found, key=lambda item: -item["fetched_at"])


def publish_adapter(directory: str | Path, name: str, folder_uri: str, s3: S3Options) -> str:
    """Upload a local adapter directory's files (not its subfolders) to FOLDER/NAME-<hash of the files>, once (an
    upload of the same files finds them there); its s3:// URI."""
    directory = Path(directory)
    files = sorted(path for path in directory.iterdir() if path.is_file()) if directory.is_dir() else []
    if not files:
        raise AdapterUnavailable(f"adapter {name!r}: {directory} is not a directory of adapter files")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    store = open_store(f"{folder_uri.rstrip('/')}/{name}-{digest.hexdigest()[:16]}", s3)
    for path in files:
        if not store.exists(path.name) or store.size(path.name) != path.stat().st_size:
            store.put_file(path.name, path)
    return store.uri
