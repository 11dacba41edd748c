"""KV sharing across workers (`tokenmill worker --kv-sharing`): every worker's engine saves the full KV blocks it
computes to the service's own Redis and loads the blocks another worker saved, so a prefix shared by a job's rows
is computed once by whichever worker meets it first, not once per worker. It is the engine's KV connector
(engine/kv_connector/, docs/kv-connector.md) in role kv_both; this module only turns the option into its
`kv_transfer_config`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ingest.config import ServiceConfig

DEFAULT_TTL_S = 600  # a block's life in Redis: long enough for the other workers of a job to meet its prefix
KEY_PREFIX = "tokenmill:kv:"  # after the service's queue prefix, so stacks sharing one Redis keep their blocks apart
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def kv_sharing_config(redis_url: str, key_prefix: str = KEY_PREFIX,
                      ttl_s: int | None = DEFAULT_TTL_S) -> dict[str, Any]:
    """The engine's `kv_transfer_config` for KV sharing: RedisConnector, kv_both, blocks kept `ttl_s` seconds."""
    if not redis_url.startswith(REDIS_SCHEMES):
        raise ValueError(f"KV sharing needs a Redis URL (redis://host:port/db), got {redis_url!r}")
    if ttl_s is not None and ttl_s < 1:
        raise ValueError(f"--kv-sharing-ttl must be at least 1 second (0: no expiry), got {ttl_s}")
    extra: dict[str, Any] = {"redis_url": redis_url, "redis_key_prefix": key_prefix}
    if ttl_s is not None:
        extra["redis_ttl"] = ttl_s
    return {"kv_connector": "RedisConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def service_kv_sharing_config(config: ServiceConfig, redis_url: str | None = None,
                              ttl_s: int | None = None) -> dict[str, Any]:
    """KV sharing over `redis_url`, else $TOKENMILL_KV_REDIS_URL (the Redis of the disaggregated workers' blocks
    too), else the service's own Redis (its result backend, which is the broker unless TOKENMILL_RESULT_BACKEND
    names another); keys under the service's queue prefix. `ttl_s` (0: no expiry): else $TOKENMILL_KV_TTL_S, else
    DEFAULT_TTL_S."""
    from ingest.config import env_setting

    url = redis_url or env_setting("KV_REDIS_URL") or config.result_backend
    if not url or not url.startswith(REDIS_SCHEMES):
        raise ValueError("--kv-sharing needs Redis, and this service's result backend is not Redis "
                         f"({url or 'none'}): name one with --kv-sharing-url redis://host:port/db")
    if ttl_s is None:
        raw = env_setting("KV_TTL_S")
        ttl_s = int(float(raw)) if raw else DEFAULT_TTL_S
    return kv_sharing_config(url, config.queue_prefix + KEY_PREFIX, ttl_s or None)
