"""`RedisConnector`: KV blocks in Redis, for engines on different hosts. Extra config: `redis_url`
(redis://host:port/db), `redis_key_prefix` (default "tokenmill:kv:"), `redis_ttl` (seconds a block is kept;
default: until Redis evicts it), `redis_timeout_s` (connect and read limit of its socket; default 2)."""

from __future__ import annotations

from typing import Any

from engine.kv_connector.base import KVConnector
from engine.kv_connector.store import REDIS_TIMEOUT_S, ByteStore, RedisStore


class RedisConnector(KVConnector):
    @staticmethod
    def make_store(extra: dict[str, Any]) -> ByteStore:
        return extra.get("kv_store") or RedisStore(extra["redis_url"], extra.get("redis_key_prefix", "tokenmill:kv:"),
                                                   extra.get("redis_ttl"),
                                                   float(extra.get("redis_timeout_s", REDIS_TIMEOUT_S)))
