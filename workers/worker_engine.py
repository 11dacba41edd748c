"""The engines that run jobs: `load_engine` builds one from its settings (`EngineConfig` keywords) for `tokenmill
run`, the in-process executor of `tokenmill api` and a Celery worker alike, attaching its Prometheus metrics when
asked; `WorkerEngine` is what a worker process loads (`tokenmill worker` makes it from its options; a bare Celery
worker reads it from the environment); and `WorkerProcess` is what one worker process holds, owned by whoever starts
the process (`workers.celery_app.TasksProcess`): that engine, built by the factory it is given (default: the real
one), loaded once (when the process starts, or at its first shard) behind its engine service for every shard it
runs, and the claims it runs now. The engine's settings belong to the worker (`tokenmill worker --threads ...
--kv-cache-memory ...`), not to the job: a job only picks the model, by the queue it is sent to."""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers.engine_loop import EngineLoop
from workers.leases import HeldHere
from workers.shards import is_embedding_engine

if TYPE_CHECKING:
    from collections.abc import Mapping

    from prometheus_client import CollectorRegistry

    from engine import LLMEngine
    from engine.settings import EngineSettings

log = logging.getLogger("tokenmill.worker")

EngineFactory = Callable[["EngineSettings"], "LLMEngine"]  # engine settings -> engine


def load_engine(settings: EngineSettings | Mapping[str, Any], registry: CollectorRegistry | None = None,
                model_name: str | None = None, factory: EngineFactory | None = None) -> LLMEngine:
    """The engine for `settings`: `factory`'s, by default the real one (an embedding model's `EmbeddingEngine`,
    else an `LLMEngine`). With a `registry`, its steps are observed into it, labelled `model_name` (default: the
    engine's model); an embedding engine has no engine metrics, and an engine already observed is left as is. A KV
    connector's kv_secret is the deployment's, $TOKENMILL_KV_SECRET (workers.kv_sharing.with_kv_secret)."""
    from engine.settings import EngineSettings  # here: the in-process path imports this module without the engine
    from workers.kv_sharing import with_kv_secret

    settings = with_kv_secret(dict(EngineSettings.of(settings)))
    if factory is None:
        from engine import EngineConfig
        from engine.embedding_engine import create_engine

        engine = create_engine(EngineConfig.from_kwargs(**settings))
    else:
        engine = factory(settings)
    if registry is not None and not is_embedding_engine(engine) and not _has_metrics(engine):
        from engine.prometheus import EngineMetrics

        EngineMetrics(engine, model_name, registry).attach()
    return engine


def _has_metrics(engine: LLMEngine) -> bool:
    from engine.prometheus import EngineMetrics

    return any(isinstance(getattr(observer, "__self__", None), EngineMetrics) for observer in engine.step_observers)


@dataclass(frozen=True)
class WorkerEngine:
    """The engine a worker process loads once: its model, its settings, and the function that builds it."""

    model: str
    settings: EngineSettings
    lora_modules: dict[str, str] = field(default_factory=dict)  # its own LoRA adapters: name -> directory or URI
    kv_role: str | None = None  # producer (prefills a model's prefill queue) or consumer (`workers.disagg`)

    @classmethod
    def from_env(cls) -> WorkerEngine:
        from engine.settings import EngineSettings
        from ingest.config import env_setting  # here: the in-process path imports this module without the engine

        settings = EngineSettings.from_json(env_setting("WORKER_ENGINE", "{}"), "TOKENMILL_WORKER_ENGINE")
        model = env_setting("WORKER_MODEL", settings.model)
        try:
            lora_modules = json.loads(env_setting("WORKER_LORA_MODULES", "{}"))
        except json.JSONDecodeError as error:
            raise ValueError(f"TOKENMILL_WORKER_LORA_MODULES must be a JSON object of adapter name -> directory or "
                             f"URI: {error}") from None
        kv_role = env_setting("WORKER_KV_ROLE")
        if kv_role not in (None, "producer", "consumer"):
            raise ValueError(f"TOKENMILL_WORKER_KV_ROLE must be producer or consumer, got {kv_role!r}")
        return cls(model, settings.replace(model=model), lora_modules, kv_role)


def engine_factory(name: str | None) -> EngineFactory | None:
    """The engine factory `module:function` names (`tokenmill worker --engine-factory`); None for None."""
    if not name:
        return None
    module, _, function = name.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"engine factory {name!r} is no MODULE:FUNCTION that can be imported: {error}") from None


class WorkerProcess:
    """What one worker process holds: its engine (`spec`, given by whoever starts the process, else read from the
    environment at first use), loaded once by `factory` (default: the real engine, `load_engine`'s) behind its
    engine service (`workers.engine_loop.EngineLoop`), and the job steps and shards it runs now (`held`)."""

    def __init__(self, spec: WorkerEngine | None = None, factory: EngineFactory | None = None) -> None:
        self._spec = spec
        self.factory = factory
        self.held = HeldHere()
        self._loop: EngineLoop | None = None
        self._loading = threading.Lock()  # a worker's task threads and its preloading thread load it once

    @property
    def spec(self) -> WorkerEngine:
        if self._spec is None:
            self._spec = WorkerEngine.from_env()
        return self._spec

    def engine_loop(self, job_model: str | None = None) -> EngineLoop:
        """The engine service, its engine loaded on first use; for a shard of a job on `job_model`, a job routed to
        the wrong queue is refused (`WrongModel`)."""
        if job_model is not None and job_model != (serves := self.spec.model):
            raise WrongModel(f"this worker serves {serves!r}, not {job_model!r}: the shard was sent to the wrong "
                             f"queue")
        with self._loading:
            if self._loop is None:
                self._loop = EngineLoop(self._load())
            return self._loop

    def engine(self) -> LLMEngine:
        return self.engine_loop().engine

    def close(self) -> None:
        """End the engine service (the shards still in it fail)."""
        with self._loading:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    def _load(self) -> LLMEngine:
        spec = self.spec
        port = os.environ.get("TOKENMILL_METRICS_PORT")  # this pool process's engine, one port per worker
        registry = None
        if port:
            from engine.prometheus import new_registry

            registry = new_registry()
        started = time.perf_counter()
        engine = load_engine(spec.settings, registry, spec.model, self.factory)
        log.info("loaded %s in %.1f s with %s", spec.model, time.perf_counter() - started, spec.settings)
        if is_embedding_engine(engine):  # no KV or scheduler gauges
            log.info("%s is an embedding model: no engine metrics are served", spec.model)
        elif port:
            from engine.prometheus import start_metrics_server

            start_metrics_server(registry, int(port), os.environ.get("TOKENMILL_METRICS_ADDR", "127.0.0.1"))
        return engine


class WrongModel(RuntimeError):
    pass
