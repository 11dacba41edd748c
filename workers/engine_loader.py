"""The one engine loader: the engines that run jobs (`tokenmill run`'s, the in-process executor's of `tokenmill
api`, a Celery worker's) are built here from their settings (`EngineConfig` keywords), and their Prometheus
engine metrics, when asked for, are attached here, once per engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workers.shards import is_embedding_engine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine import LLMEngine

EngineFactory = Callable[[dict[str, Any]], "LLMEngine"]  # engine settings -> engine


def load_engine(settings: dict[str, Any], registry: CollectorRegistry | None = None, model_name: str | None = None,
                factory: EngineFactory | None = None) -> LLMEngine:
    """The engine for `settings`: `factory`'s, by default the real one (an embedding model's `EmbeddingEngine`,
    else an `LLMEngine`). With a `registry`, its steps are observed into it, labelled `model_name` (default: the
    engine's model); an embedding engine has no engine metrics, and an engine already observed is left as is. A KV
    connector's kv_secret is the deployment's, $TOKENMILL_KV_SECRET (workers.kv_sharing.with_kv_secret)."""
    from workers.kv_sharing import with_kv_secret

    settings = with_kv_secret(settings)
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
