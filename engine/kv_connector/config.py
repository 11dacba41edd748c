"""`KVTransferConfig`, with vLLM's names: which connector moves KV blocks between engines, in which role, with what
settings. No torch here, so `engine.config` imports it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.kv_connector.store import secret_bytes

KV_CONNECTORS = ("SharedStorageConnector", "RedisConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """`kv_connector`: one of KV_CONNECTORS. `kv_role`: kv_producer saves the full blocks it computes, kv_consumer
    loads the blocks it finds before computing, kv_both does both. `kv_connector_extra_config`: the connector's own
    settings (docs/kv-connector.md): `shared_storage_path` (SharedStorageConnector; a directory or file:// URI),
    `redis_url`, `redis_key_prefix` and `redis_timeout_s` (RedisConnector), `kv_store` (any object with get(key) ->
    bytes | None and put(key, bytes), instead of the connector's own store), `namespace` (a string of the user's,
    added to the model identity that keys every block), and `kv_secret` (required: the deployment's secret, at
    least 16 bytes, that seals every block and keys its name; never shown by repr)."""

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        store = extra.get("kv_store")
        if store is not None and not (callable(getattr(store, "get", None)) and callable(getattr(store, "put", None))):
            raise ValueError("kv_connector_extra_config['kv_store'] must have get(key) and put(key, data) methods")
        if store is None and self.kv_connector == "SharedStorageConnector" and not extra.get("shared_storage_path"):
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config['shared_storage_path'] "
                             "(a directory or file:// URI) or a 'kv_store' object")
        if store is None and self.kv_connector == "RedisConnector" and not extra.get("redis_url"):
            raise ValueError("RedisConnector needs kv_connector_extra_config['redis_url'], e.g. redis://localhost:6379/0")
        secret_bytes(extra.get("kv_secret"))

    def __repr__(self) -> str:
        extra = {k: "***" if k == "kv_secret" else v for k, v in self.kv_connector_extra_config.items()}
        return (f"KVTransferConfig(kv_connector={self.kv_connector!r}, kv_role={self.kv_role!r}, "
                f"kv_connector_extra_config={extra!r})")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def of(cls, value: KVTransferConfig | dict[str, Any] | None) -> KVTransferConfig | None:
        """A config from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a KVTransferConfig or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        if unknown:
            raise ValueError(f"unknown kv_transfer_config field(s): {', '.join(unknown)}")
        return cls(**value)
