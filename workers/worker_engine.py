"""Worker-side engine lifecycle: a worker process loads its model once (when it starts, or at its first shard)
and keeps it for every shard it runs. The engine's settings belong to the worker (`tokenmill worker --threads
... --kv-cache-memory ...`), not to the job: a job only picks the model, by the queue it is sent to. The engine
is built, and its metrics attached, by `workers.engine_loader.load_engine`, through the configured factory."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from workers.config import WorkerEngine
from workers.engine_loader import load_engine
from workers.shards import is_embedding_engine

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.worker")

_loaded: LLMEngine | None = None
_loading = threading.Lock()  # a worker's task threads and its preloading thread load it once


def process_engine() -> LLMEngine:
    """This process's engine, loaded on first use."""
    global _loaded
    with _loading:
        return _loaded or _load()


def _load() -> LLMEngine:
    global _loaded
    spec = WorkerEngine.from_env()
    module, _, function = spec.factory.partition(":")
    factory = getattr(importlib.import_module(module), function)
    port = os.environ.get("TOKENMILL_METRICS_PORT")  # this pool process's engine, one port per worker
    registry = None
    if port:
        from engine.prometheus import new_registry

        registry = new_registry()
    started = time.perf_counter()
    _loaded = load_engine(spec.settings, registry, spec.model, factory)
    log.info("loaded %s in %.1f s with %s", spec.model, time.perf_counter() - started, spec.settings)
    if is_embedding_engine(_loaded):  # no KV or scheduler gauges
        log.info("%s is an embedding model: no engine metrics are served", spec.model)
    elif port:
        from engine.prometheus import start_metrics_server

        start_metrics_server(registry, int(port), os.environ.get("TOKENMILL_METRICS_ADDR", "127.0.0.1"))
    return _loaded


def engine_for(job_model: str) -> LLMEngine:
    """The engine for a shard of a job on `job_model`; a job routed to the wrong queue is refused."""
    serves = WorkerEngine.from_env().model
    if job_model != serves:
        raise WrongModel(f"this worker serves {serves!r}, not {job_model!r}: the shard was sent to the wrong queue")
    return process_engine()


class WrongModel(RuntimeError):
    pass
