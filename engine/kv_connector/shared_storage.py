"""`SharedStorageConnector`: KV blocks as files under a directory every engine mounts (`shared_storage_path`, a local
path or file:// URI), or in any `kv_store` object given in the extra config (an object store's client, say)."""

from __future__ import annotations

from typing import Any

from engine.kv_connector.base import KVConnector
from engine.kv_connector.store import ByteStore, DirectoryStore


class SharedStorageConnector(KVConnector):
    @staticmethod
    def make_store(extra: dict[str, Any]) -> ByteStore:
        return extra.get("kv_store") or DirectoryStore(extra["shared_storage_path"])
