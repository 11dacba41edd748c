"""KV connector: engines share computed KV blocks through a byte store (a shared directory, Redis, any get/put store),
so one engine (a producer) computes a prompt's prefill and another (a consumer) loads it (docs/kv-connector.md).
Its settings, `KVTransferConfig`, live with the engine's (engine/config.py); `factory.create_kv_connector` builds
the connector an engine runs with."""

from engine.config import KV_CONNECTORS, KV_ROLES, KVTransferConfig

__all__ = ["KV_CONNECTORS", "KV_ROLES", "KVTransferConfig"]
