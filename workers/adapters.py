"""LoRA adapters as a job's rows name them (docs/lora.md): a row whose `model` is an adapter's name runs with it.

The adapters a shard may use are the job's own (its `lora_modules`) and its worker's (`tokenmill worker
--lora-modules`); a name both give is the job's. Each is a PEFT directory: a local one is used in place, an s3://
prefix is fetched once into the adapter cache (`$TOKENMILL_DATA/lora-cache`), under a key of its URI and its
objects' sizes and ETags, so a changed adapter is fetched again and an unchanged one never (every worker process on
the machine shares the cache; a shard only lists the prefix). Adapters are resolved on the shard's thread, before
its rows go to the engine thread: one that cannot be fetched fails the rows that name it, a store that is down
fails the shard as any outage does (it is tried again). Each adapter gets an id that is stable in this process
(`LoRARequest.lora_int_id`); the engine keys its prefix cache on the adapter's weights, not on the id."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
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
MAX_ADAPTER_BYTES = int(os.environ.get("TOKENMILL_MAX_ADAPTER_BYTES") or 4 << 30)  # one adapter's files at most


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

_ids: dict[tuple[str, str], int] = {}
_next_id = itertools.count(1)
_ids_lock = threading.Lock()


def lora_request(name: str, directory: str | Path) -> LoRARequest:
    """The engine's request for this adapter, its id the same for the same name and directory in this process."""
    from engine import LoRARequest

    key = (name, str(directory))
    with _ids_lock:
        if key not in _ids:
            _ids[key] = next(_next_id)
        return LoRARequest(name, _ids[key], str(directory))


def resolve_adapters(names: Iterable[str], sources: Mapping[str, AdapterSource],
                     cache: Path | None = None) -> dict[str, LoRARequest | str]:
    """For each adapter name: its `LoRARequest` (fetched into the cache if it lives in S3), or why it cannot be
    served (its rows fail with that). A store that is down raises (not the adapter's fault: the shard is retried)."""
    resolved: dict[str, LoRARequest | str] = {}
    for name in sorted(set(names)):
        source = sources[name]
        try:
            resolved[name] = lora_request(name, local_dir(source, cache))
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


_fetch_locks: dict[str, threading.Lock] = {}
_fetch_locks_lock = threading.Lock()


def fetch(source: AdapterSource, cache: Path) -> Path:
    """The cache entry of the adapter's objects as they are now (listed, not downloaded, when cached already)."""
    store = open_store(source.uri, source.s3)
    assert isinstance(store, S3Store)
    objects = list_adapter(store)
    entry = cache / entry_name(source.uri, objects)
    if (entry / SOURCE_FILE).is_file():
        return entry
    with _fetch_locks_lock:
        lock = _fetch_locks.setdefault(str(entry), threading.Lock())
    with lock:  # one download per process; another process that wins the rename below is as good
        if (entry / SOURCE_FILE).is_file():
            return entry
        _download(store, objects, entry)
    return entry


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
