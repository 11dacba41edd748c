"""Builds an engine's KV connector from its `kv_transfer_config`, with the namespace of the model's identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.kv_connector.base import KVConnector
from engine.kv_connector.config import KVTransferConfig
from engine.kv_connector.redis_connector import RedisConnector
from engine.kv_connector.shared_storage import SharedStorageConnector

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.model_runner import ModelRunner

CONNECTORS: dict[str, type[KVConnector]] = {"SharedStorageConnector": SharedStorageConnector,
                                            "RedisConnector": RedisConnector}


def model_identity(model: str, model_dir: Path, runner: ModelRunner, extra_namespace: str | None = None) -> dict:
    """What makes blocks interchangeable: the model (its name, or its directory's name, and its config.json), its
    dtype, the pool's element type and layout, FP8 scales, and a namespace of the user's."""
    config_file = Path(model_dir) / "config.json"
    attention = runner.attention
    scales = [s.detach().cpu().numpy().tobytes() for s in (attention.k_scales, attention.v_scales) if s is not None]
    return {
        "model": Path(model).name,
        "model_config": hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else None,
        "dtype": str(runner.dtype),
        "kv_dtype": str(attention.k_caches[0].dtype),
        "kv_scales": hashlib.sha256(b"".join(scales)).hexdigest() if scales else None,
        "block_size": runner.block_size,
        "num_layers": runner.num_layers,
        "num_kv_heads": runner.num_kv_heads,
        "head_dim": runner.head_dim,
        "bytes_per_block": runner.transfer.bytes_per_block,
        "tensor_parallel": [0, 1],  # rank, size: kv_transfer_config refuses tensor_parallel_size > 1
        "namespace": extra_namespace,
    }


def namespace_of(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def create_kv_connector(config: KVTransferConfig | None, model: str, model_dir: Path, runner: ModelRunner,
                        kv: KVCacheManager) -> KVConnector | None:
    if config is None:
        return None
    cls = CONNECTORS[config.kv_connector]
    extra = config.kv_connector_extra_config
    namespace = namespace_of(model_identity(model, model_dir, runner, extra.get("namespace")))
    return cls(config, cls.make_store(extra), namespace, kv, runner.transfer)
