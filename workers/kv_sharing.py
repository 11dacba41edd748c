"""KV sharing across workers (`tokenmill worker --kv-sharing`): every worker's engine saves the full KV blocks it
computes to the service's KV Redis and loads the blocks another worker saved, so a prefix shared by a job's rows
is computed once by whichever worker meets it first, not once per worker. It is the engine's KV connector
(engine/kv_connector/, docs/kv-connector.md) in role kv_both; this module only turns the option into its
`kv_transfer_config`. Blocks are sealed and named under the deployment's secret, TOKENMILL_KV_SECRET (`tokenmill
stack up` makes one): no secret, no sharing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from engine.config import secret_bytes

if TYPE_CHECKING:
    from ingest.config import ServiceConfig

DEFAULT_TTL_S = 600  # a block's life in Redis: long enough for the other workers of a job to meet its prefix
KEY_PREFIX = "tokenmill:kv:"  # after the service's queue prefix, so stacks sharing one Redis keep their blocks apart
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
KV_DB = 1  # the blocks' database when they share the service's Redis server: never the broker's
SECRET_VARIABLE = "TOKENMILL_KV_SECRET"


def deployment_kv_secret() -> str:
    """$TOKENMILL_KV_SECRET, the secret every worker of the deployment seals and names its KV blocks with; ValueError
    when it is unset or short: blocks are never sealed with a secret anyone knows."""
    from ingest.config import env_setting

    secret = env_setting("KV_SECRET") or ""
    if not secret:
        raise ValueError(f"KV sharing needs the deployment's KV secret in {SECRET_VARIABLE}: the same on every "
                         "worker, at least 16 bytes (secrets.token_urlsafe(32)); `tokenmill stack up` makes one")
    secret_bytes(secret)
    return secret


def with_kv_secret(settings: dict[str, Any]) -> dict[str, Any]:
    """Engine settings whose kv_transfer_config (a dict naming no kv_secret) gets $TOKENMILL_KV_SECRET: added where
    an engine is made (`load_engine`, the CLI's engine options), never stored or sent (`EngineSettings.to_json`).
    ValueError when the settings have a connector and the variable is unset or short."""
    transfer = settings.get("kv_transfer_config")
    if not isinstance(transfer, dict) or not transfer or (transfer.get("kv_connector_extra_config") or {}).get(
            "kv_secret"):
        return settings
    extra = {**(transfer.get("kv_connector_extra_config") or {}), "kv_secret": deployment_kv_secret()}
    return {**settings, "kv_transfer_config": {**transfer, "kv_connector_extra_config": extra}}


def without_kv_secret(settings: dict[str, Any]) -> dict[str, Any]:
    """Engine settings fit to store (a job's settings) or pass on (a worker's environment): no kv_secret
    (`engine.settings.without_secret`, which `EngineSettings.to_json` applies)."""
    from engine.settings import without_secret

    return without_secret(settings)


def default_kv_redis_url(config: ServiceConfig) -> str | None:
    """The service's Redis (its result backend) with database KV_DB: beside the broker's keys, never among them;
    None when the service has no Redis. ValueError when the broker or result backend uses KV_DB itself."""
    url = config.result_backend or ""
    if not url.startswith(("redis://", "rediss://")):
        return None
    parts = urlsplit(url)
    for used in {config.broker_url, url}:
        other = urlsplit(used)
        if other.scheme in ("redis", "rediss") and other.netloc == parts.netloc and _db(other.path) == KV_DB:
            raise ValueError(f"the service's Redis uses database {KV_DB}, the KV blocks' default: name the blocks' "
                             "Redis with TOKENMILL_KV_REDIS_URL (or --kv-sharing-url)")
    return urlunsplit((parts.scheme, parts.netloc, f"/{KV_DB}", parts.query, ""))


def _db(path: str) -> int:
    text = path.strip("/")
    return int(text) if text.isdigit() else 0


def kv_sharing_config(redis_url: str, key_prefix: str = KEY_PREFIX,
                      ttl_s: int | None = DEFAULT_TTL_S) -> dict[str, Any]:
    """The engine's `kv_transfer_config` for KV sharing: RedisConnector, kv_both, blocks kept `ttl_s` seconds (its
    kv_secret is the deployment's, added where the engine is made: `with_kv_secret`)."""
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
    too; the stack's own KV Redis), else database KV_DB of the service's Redis (its result backend); keys under the
    service's queue prefix, sealed under $TOKENMILL_KV_SECRET. `ttl_s` (0: no expiry): else $TOKENMILL_KV_TTL_S,
    else DEFAULT_TTL_S."""
    from ingest.config import env_setting

    url = redis_url or env_setting("KV_REDIS_URL") or default_kv_redis_url(config)
    if not url:
        raise ValueError("--kv-sharing needs Redis, and this service's result backend is not Redis "
                         f"({config.result_backend or 'none'}): name one with --kv-sharing-url redis://host:port/db")
    if ttl_s is None:
        raw = env_setting("KV_TTL_S")
        ttl_s = int(float(raw)) if raw else DEFAULT_TTL_S
    deployment_kv_secret()  # no secret, no sharing: refused before the worker starts
    return kv_sharing_config(url, config.queue_prefix + KEY_PREFIX, ttl_s or None)
