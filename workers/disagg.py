"""Disaggregated prefill and decode workers (`tokenmill worker --kv-role producer|consumer`, docs/kv-connector.md).

With TOKENMILL_KV_DISAGGREGATION naming a job's model, its planned shards go first to the model's prefill queue
(`<model queue>.prefill`). A producer worker consumes it: it claims the shard as any worker does (a lease renewed
by its heartbeat, a fencing token), runs each row's prompt with max_tokens=1 through its engine, whose KV connector
(kv_producer) saves the prompt's full blocks to Redis, and writes no output. It then hands the shard off: its claim
ends (the shard back to pending) and run_shard goes to the model's queue. A consumer worker (kv_consumer over the
same Redis) runs that shard as any other: the connector loads the saved blocks, the engine computes what is
missing, and the consumer alone writes the shard's part. Exactly-once is the shard's: one writer, the same claims.

A prefill claim counts no attempt: only decoding counts, and a prefill is never retried. Nothing is stranded in the
prefill phase: a producer that dies lets its lease lapse and the sweep queues the shard to the model's queue (the
consumer then computes the prompt itself); a hand-off whose task was lost, or a shard waiting in the prefill queue
past the sweep's grace (no producer running, or producers behind), is sent to the model's queue by the sweep's
reconciler. Sweeps and retries never go through the prefill queue."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.settings import EngineSettings
from ingest.config import ServiceConfig, env_setting
from storage import claims
from storage import repository as repo
from storage.formats import EMBEDDINGS, Request
from storage.models import Job, JobStatus, Shard, ShardStatus
from workers.engine_loop import EngineLoop
from workers.job_steps import discard_if_ended
from workers.kv_sharing import KEY_PREFIX, default_kv_redis_url, deployment_kv_secret, kv_sharing_config
from workers.leases import Claim, StatusWatch, shard_claim
from workers.shard_step import ShardStep, request_prefix, through_outages
from workers.shards import is_embedding_engine

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger("tokenmill.disagg")

ROLES = ("producer", "consumer")
ENGINE_ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}
PREFILL_SUFFIX = ".prefill"
DEFAULT_KV_TTL_S = 3600  # a prefilled shard may wait this long for a consumer (TOKENMILL_KV_TTL_S)
_ON, _OFF = ("1", "true", "on", "all", "*"), ("", "0", "false", "off", "none")


def prefill_queue(config: ServiceConfig, model: str) -> str:
    """The queue of a model's producer workers."""
    return config.model_queue(model) + PREFILL_SUFFIX


def shard_queue(config: ServiceConfig, model: str, kv_role: str | None) -> str:
    """The queue a worker of `kv_role` takes shards from: producers the prefill queue, others the model's."""
    return prefill_queue(config, model) if kv_role == "producer" else config.model_queue(model)


def disaggregated(model: str) -> bool:
    """Do this model's new jobs go through producer workers first? TOKENMILL_KV_DISAGGREGATION: 1 (every model), or
    a comma-separated list of model names; unset or 0: no."""
    raw = (env_setting("KV_DISAGGREGATION") or "").strip()
    if raw.lower() in _ON or raw.lower() in _OFF:
        return raw.lower() in _ON
    return model in {name.strip() for name in raw.split(",")}


def role_engine_settings(settings: EngineSettings | dict[str, Any], kv_role: str | None,
                         config: ServiceConfig) -> EngineSettings:
    """The engine settings of a worker of `kv_role`: its own KV connector (--kv-transfer-config, --kv-sharing) in
    the role's kv_role, else a RedisConnector over TOKENMILL_KV_REDIS_URL or database KV_DB of the service's Redis
    (its result backend), keys under the queue prefix as KV sharing's (`workers.kv_sharing`), blocks kept
    TOKENMILL_KV_TTL_S seconds (0: until Redis evicts them; default DEFAULT_KV_TTL_S). Either way the blocks are
    sealed under TOKENMILL_KV_SECRET: without it, ValueError."""
    settings = EngineSettings.of(settings)
    if kv_role is None:
        return settings
    if kv_role not in ROLES:
        raise ValueError(f"--kv-role must be one of {ROLES}, got {kv_role!r}")
    transfer = dict(settings.get("kv_transfer_config") or {})
    if not transfer.get("kv_connector"):
        url = env_setting("KV_REDIS_URL") or default_kv_redis_url(config)
        if not url:
            raise ValueError(f"--kv-role needs a Redis for the KV blocks, and the service's result backend is not "
                             f"Redis ({config.result_backend or 'none'}): set TOKENMILL_KV_REDIS_URL=redis://host:port/db")
        ttl = int(float(env_setting("KV_TTL_S") or DEFAULT_KV_TTL_S))
        transfer = kv_sharing_config(url, config.queue_prefix + KEY_PREFIX, ttl or None)
    deployment_kv_secret()  # checked now: the engine, made later, adds it (workers.kv_sharing.with_kv_secret)
    return settings.replace(kv_transfer_config={**transfer, "kv_role": ENGINE_ROLES[kv_role]})


def prefill_rows(rows: list) -> list[Request]:
    """A shard's text rows as prompts to prefill: their own tokens (messages or prompt) and model (its adapter
    keys the blocks), without their sampling parameters, which the job's prefill replaces."""
    return [dataclasses.replace(row, params={}, openai=False) for row in rows
            if isinstance(row, Request) and row.endpoint != EMBEDDINGS]


class PrefillStep:
    """The prefill of one shard this process claimed (`ShardStep.claim_shard`), and its hand-off."""

    def __init__(self, shard_step: ShardStep) -> None:
        self.shard_step, self.steps = shard_step, shard_step.steps

    def run(self, job: Job, shard: Shard, engine: Callable[[], EngineLoop]) -> bool:
        """Prefill the shard's prompts under its lease, then end the claim, the shard back to pending. True
        when the shard is to go to the model's queue now; False when the claim was lost (whoever took it over, or
        the sweep, sends it) or the job stopped. A prefill that fails costs its loads only: the shard is handed
        off all the same and the consumer computes the prompts."""
        claim = shard_claim(shard.id)
        heartbeat = self.steps.heartbeat
        started = time.perf_counter()
        self.steps.held.hold(claim)
        heartbeat.add(claim, shard.claim_token)
        try:
            with heartbeat:
                prompts = self._prefill(job, shard, engine, claim)
        finally:
            heartbeat.discard(claim)
            self.steps.held.let_go(claim)
        handed = through_outages(lambda: self._hand_off(shard))
        log.info("job %s: shard %d: prefilled %d prompt(s) in %.1f s; %s", job.id, shard.index, prompts,
                 time.perf_counter() - started, "handed to the decode workers" if handed else "not handed off "
                 "(its claim was taken over, or the job stopped)")
        return handed

    def _prefill(self, job: Job, shard: Shard, engine: Callable[[], EngineLoop], claim: Claim) -> int:
        watch = StatusWatch(self.steps.sessions, job.id, self.steps.heartbeat, claim)
        try:
            if watch.should_stop():
                return 0
            loop = engine()
            if is_embedding_engine(loop.engine):  # no KV to hand over
                return 0
            rows = prefill_rows(self.steps.read_rows(job, shard))
            settings = dataclasses.replace(self.shard_step.row_settings(job, rows), defaults={"max_tokens": 1},
                                           speculative=None)
            loop.run(settings, rows, "prefill-" + request_prefix(job, shard), watch.should_stop, self.steps.progress)
            return len(rows)
        except Exception as error:
            log.warning("job %s: shard %d: prefill failed (%s: %s); the decode workers compute its prompts", job.id,
                        shard.index, type(error).__name__, error)
            return 0

    def _hand_off(self, shard: Shard) -> bool:
        """End the prefill claim if it is still ours: the shard back to pending."""
        with self.steps.sessions.begin() as session:
            job = self.steps.job_row(session)
            row = repo.get_shard_by_id(session, shard.id, for_update=True)
            if row.claim_token != shard.claim_token or row.status != ShardStatus.RUNNING:
                return False
            row.status, row.lease_expires_at = ShardStatus.PENDING.value, None
            claims.settle(job)  # a cancel waiting for this claim ends now
        discard_if_ended(self.steps.sessions, job)
        return job.status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS)


def kv_transfer_summary(engine: LLMEngine) -> str | None:
    """The engine's KV connector counts (process totals), for the log; None without a connector."""
    connector = getattr(engine, "kv_connector", None)
    if connector is None:
        return None
    return ", ".join(f"{name} {value}" for name, value in dataclasses.asdict(connector.stats).items())
