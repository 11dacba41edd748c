"""Builds an engine's KV connector from its `kv_transfer_config`, with the namespace of the model's identity: a digest
of its weights (not its name), keyed by the deployment's secret."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import KVTransferConfig, secret_bytes
from engine.kv_connector.base import KVConnector
from engine.kv_connector.redis_connector import RedisConnector
from engine.kv_connector.shared_storage import SharedStorageConnector
from engine.kv_connector.store import write_whole

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.kv_cache_interface import KVScales, ModelShape
    from engine.kv_transfer import KVTransfer

CONNECTORS: dict[str, type[KVConnector]] = {"SharedStorageConnector": SharedStorageConnector,
                                            "RedisConnector": RedisConnector}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHTS_DIGEST_CACHE = ".tokenmill-weights-digest.json"  # beside the weights: the digest and the files it covers
_weights_digests: dict[tuple, str] = {}  # this process's: file list (name, size, mtime) -> digest


def weights_digest(model_dir: Path) -> str:
    """sha256 over the model directory's weight files: each one's name, size and content. Computed once per set of
    files (name, size, mtime) and cached in this process and, where the directory is writable, beside the files."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ValueError(f"the KV connector keys blocks on the model's weights, and {model_dir} holds no weight "
                         f"files ({', '.join(WEIGHT_SUFFIXES)})")
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    signature = (str(model_dir.resolve()), *stats)
    if signature in _weights_digests:
        return _weights_digests[signature]
    cache = model_dir / WEIGHTS_DIGEST_CACHE
    try:
        cached = json.loads(cache.read_text())
        digest = cached["digest"] if [tuple(f) for f in cached["files"]] == stats else None
    except (OSError, ValueError, KeyError, TypeError):
        digest = None
    if digest is None:
        h = hashlib.sha256()
        for path, (name, size, _) in zip(files, stats, strict=True):
            h.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        digest = h.hexdigest()
        _write_quietly(cache, json.dumps({"files": stats, "digest": digest}))
    _weights_digests[signature] = digest
    return digest


def _write_quietly(path: Path, text: str) -> None:
    """Write path whole, or not at all where the directory is read-only."""
    try:
        write_whole(path, text.encode())
    except OSError:
        pass


def model_identity(model_dir: Path, shape: ModelShape, pool: KVTransfer, kv_scales: KVScales | None,
                   extra_namespace: str | None = None) -> dict:
    """What makes blocks interchangeable: the model's weights (a digest of its files, whatever its name) and
    config.json, its dtype, the pool's element type and layout, FP8 scales, and a namespace of the user's."""
    config_file = Path(model_dir) / "config.json"
    scales = [s.detach().cpu().numpy().tobytes() for s in (kv_scales.k, kv_scales.v)] if kv_scales else []
    return {
        "weights": weights_digest(model_dir),
        "model_config": hashlib.sha256(config_file.read_bytes()).hexdigest() if config_file.is_file() else None,
        "dtype": str(shape.dtype),
        "kv_dtype": str(pool.caches[0].dtype),
        "kv_scales": hashlib.sha256(b"".join(scales)).hexdigest() if scales else None,
        "block_size": shape.block_size,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "bytes_per_block": pool.bytes_per_block,
        "tensor_parallel": [0, 1],  # rank, size: kv_transfer_config refuses tensor_parallel_size > 1
        "namespace": extra_namespace,
    }


def namespace_of(identity: dict, secret: bytes) -> str:
    """The identity's digest keyed by the deployment's secret: not computable without it."""
    return hmac.new(secret, json.dumps(identity, sort_keys=True).encode(), hashlib.sha256).hexdigest()[:32]


def create_kv_connector(config: KVTransferConfig | None, model_dir: Path, shape: ModelShape, pool: KVTransfer,
                        kv_scales: KVScales | None, kv: KVCacheManager) -> KVConnector | None:
    """The connector of `config` (None without one) over the runner's KV pool (`pool`: its block copies, and the FP8
    `kv_scales` its blocks are stored with)."""
    if config is None:
        return None
    cls = CONNECTORS[config.kv_connector]
    extra = config.kv_connector_extra_config
    identity = model_identity(model_dir, shape, pool, kv_scales, extra.get("namespace"))
    namespace = namespace_of(identity, secret_bytes(extra.get("kv_secret")))
    return cls(config, cls.make_store(extra), namespace, kv, pool)
