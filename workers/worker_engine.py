"""Worker-side engine lifecycle: a worker process loads its model once (when it starts, or at its first shard)
and keeps it for every shard it runs. The engine's settings belong to the worker (`tokenmill worker --threads
... --kv-cache-memory ...`), not to the job: a job only picks the model, by the queue it is sent to."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from workers.config import WorkerEngine

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.worker")

_loaded: LLMEngine | None = None
_loading = threading.Lock()  # a worker's task threads and its preloading thread load it once


def load_engine(settings: dict[str, Any]) -> LLMEngine:
    """The default factory: the real engine (an embedding model's `EmbeddingEngine`, else an `LLMEngine`)."""
    from engine import EngineConfig
    from engine.embedding_engine import create_engine

    return create_engine(EngineConfig.from_kwargs(**settings))


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
    started = time.perf_counter()
    _loaded = factory(spec.settings)
    log.info("loaded %s in %.1f s with %s", spec.model, time.perf_counter() - started, spec.settings)
    if getattr(_loaded, "embedding_size", None) is not None:  # an embedding engine: no KV or scheduler gauges
        log.info("%s is an embedding model: no engine metrics are served", spec.model)
    elif port := os.environ.get("TOKENMILL_METRICS_PORT"):  # this pool process's engine, one port per worker
        from engine.prometheus import EngineMetrics, start_metrics_server

        addr = os.environ.get("TOKENMILL_METRICS_ADDR", "127.0.0.1")
        start_metrics_server(EngineMetrics(_loaded, spec.model).attach().registry, int(port), addr)
    return _loaded


def engine_for(job_model: str) -> LLMEngine:
    """The engine for a shard of a job on `job_model`; a job routed to the wrong queue is refused."""
    serves = WorkerEngine.from_env().model
    if job_model != serves:
        raise WrongModel(f"this worker serves {serves!r}, not {job_model!r}: the shard was sent to the wrong queue")
    return process_engine()


class WrongModel(RuntimeError):
    pass
