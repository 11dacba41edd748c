"""The engine a worker process loads, and the LoRA adapters it serves, read from the environment (`tokenmill
worker` sets it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ingest.config import env_setting


@dataclass(frozen=True)
class WorkerEngine:
    """The engine a worker process loads once: its model, its settings, and the function that builds it."""

    model: str
    settings: dict[str, Any]
    factory: str  # "module:function", called with the settings; returns an LLMEngine
    lora_modules: dict[str, str] = field(default_factory=dict)  # its own LoRA adapters: name -> directory or URI
    kv_role: str | None = None  # producer (prefills a model's prefill queue) or consumer (`workers.disagg`)

    @classmethod
    def from_env(cls) -> WorkerEngine:
        from engine.config import DEFAULT_MODEL

        raw = env_setting("WORKER_ENGINE", "{}")
        try:
            settings = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"TOKENMILL_WORKER_ENGINE must be a JSON object of engine settings: {error}") from None
        model = env_setting("WORKER_MODEL", settings.get("model", DEFAULT_MODEL))
        factory = env_setting("ENGINE_FACTORY", "workers.engine_loader:load_engine")
        try:
            lora_modules = json.loads(env_setting("WORKER_LORA_MODULES", "{}"))
        except json.JSONDecodeError as error:
            raise ValueError(f"TOKENMILL_WORKER_LORA_MODULES must be a JSON object of adapter name -> directory or "
                             f"URI: {error}") from None
        kv_role = env_setting("WORKER_KV_ROLE")
        if kv_role not in (None, "producer", "consumer"):
            raise ValueError(f"TOKENMILL_WORKER_KV_ROLE must be producer or consumer, got {kv_role!r}")
        return cls(model, {**settings, "model": model}, factory, lora_modules, kv_role)
