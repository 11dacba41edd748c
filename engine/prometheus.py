"""Prometheus metrics of one `LLMEngine`, named like vLLM's (`vllm:x` is `tokenmill:x`), with a `model_name`
label, so vLLM dashboards and alerts translate by changing the prefix.

Cost: nothing runs per token. After each `step()` the counters move by the deltas of the engine's own
cumulative stats (`EngineStats`, `SpecStats`), the step-time and inter-token histograms take one weighted
observation, and request histograms take one observation per finished request. Gauges are refreshed at most
every `gauge_interval_s` (and whenever the engine drains).

Serving: one registry per process, exposed by `start_metrics_server(registry, port)` on its own port. Workers
run one prefork pool process each (`--concurrency 1`), so a port per worker process is simple and keeps the
custom collectors (which prometheus_client's multiprocess mode cannot aggregate) and the process metrics.

    metrics = EngineMetrics(engine).attach()          # observes every engine.step() from now on
    start_metrics_server(metrics.registry, 9400)      # http://host:9400/metrics
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

PREFIX = "tokenmill:"
KV_CONNECTOR_COUNTERS = ("kv_connector_blocks_loaded", "kv_connector_blocks_saved", "kv_connector_blocks_rejected",
                         "kv_connector_store_errors")

# vLLM's buckets for the request latencies; ours for the step time.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class WeightedHistogram:
    """A one-series histogram that records a value `count` times in O(buckets): every sequence of a step
    waited the same interval for its token, so a step is one call, not one per sequence."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0:
            return
        with self._lock:
            self.counts[bisect_left(self.bounds, value)] += count
            self.sum += value * count

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            cumulative.append((bound, running))
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), cumulative, total)
        return [family]


class EngineMetrics:
    """The engine's state as Prometheus metrics. Call `observe_step(outputs)` after every `engine.step()`,
    or `attach()` once to have the engine's own `step` do it."""

    def __init__(self, engine: LLMEngine, model_name: str | None = None, registry: CollectorRegistry | None = None,
                 gauge_interval_s: float = 1.0) -> None:
        self.engine = engine
        self.registry = registry if registry is not None else new_registry()
        self.gauge_interval_s = gauge_interval_s
        self.labels = {"model_name": model_name or str(engine.config.model)}
        self._define_gauges()
        self._define_counters()
        self._define_histograms()
        self._last = self._cumulative()  # counters start from the engine's state now
        self._steps_seen = engine.stats.num_steps
        self._previous_step_end: float | None = None
        self._gauges_at = 0.0
        self.refresh_gauges()

    # -- definitions ---------------------------------------------------------------------------------------

    def _metric(self, kind, name: str, documentation: str, **kwargs):
        return kind(PREFIX + name, documentation, list(self.labels), registry=self.registry,
                    **kwargs).labels(**self.labels)

    def _define_gauges(self) -> None:
        self.running = self._metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = self._metric(Gauge, "num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = self._metric(Gauge, "num_requests_swapped", "Requests preempted with their KV in host memory.")
        self.kv_usage = self._metric(Gauge, "kv_cache_usage_perc",
                                     "Share of KV-cache blocks held by running requests (1 = 100%).")
        self.running_tokens = self._metric(Gauge, "num_tokens_running",
                                           "Tokens (prompt + generated so far) of the running sequences; "
                                           "divided by num_requests_running it is the mean sequence length.")
        config, kv = self.engine.config, self.engine.kv_manager
        info = Gauge(PREFIX + "cache_config_info", "KV cache configuration (value 1).",
                     [*self.labels, "block_size", "num_kv_blocks", "enable_prefix_caching"], registry=self.registry)
        info.labels(**self.labels, block_size=str(config.block_size), num_kv_blocks=str(kv.pool.num_blocks),
                    enable_prefix_caching=str(kv.enable_caching)).set(1)

    def _define_counters(self) -> None:
        counters = {
            "prompt_tokens": "Prompt tokens of requests that produced their first token.",
            "generation_tokens": "Generated tokens.",
            "num_preemptions": "Preemptions (a running request's KV dropped to be recomputed, or swapped to host).",
            "kv_blocks_swapped_out": "KV blocks copied to host memory by swap preemption.",
            "kv_blocks_swapped_in": "KV blocks copied back from host memory by swap preemption.",
            "kv_connector_blocks_loaded": "KV blocks loaded into the pool through the KV connector.",
            "kv_connector_blocks_saved": "KV blocks saved to the KV connector's store.",
            "kv_connector_blocks_rejected": "Stored KV blocks that failed their checksum or size (computed instead).",
            "kv_connector_store_errors": "KV connector store calls that raised (the block computed, or not saved).",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "spec_decode_num_draft_tokens": "Speculative draft tokens verified.",
            "spec_decode_num_accepted_tokens": "Speculative draft tokens accepted.",
        }
        self.counters = {key: self._metric(Counter, key, text) for key, text in counters.items()}  # by stats key
        self.per_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens by draft position.", [*self.labels, "position"],
                                    registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       [*self.labels, "finished_reason"], registry=self.registry)

    def _define_histograms(self) -> None:
        lengths = length_buckets(self.engine.max_model_len)
        self.ttft = self._metric(Histogram, "time_to_first_token_seconds", "Time to first token (from arrival).",
                                 buckets=TTFT_BUCKETS)
        self.e2e = self._metric(Histogram, "e2e_request_latency_seconds", "Arrival to finish of a request.",
                                buckets=E2E_BUCKETS)
        self.request_tpot = self._metric(Histogram, "request_time_per_output_token_seconds",
                                         "Per request: (finish - first token) / (output tokens - 1).",
                                         buckets=TPOT_BUCKETS)
        self.prompt_lengths = self._metric(Histogram, "request_prompt_tokens", "Prompt tokens per finished request.",
                                           buckets=lengths)
        self.generation_lengths = self._metric(Histogram, "request_generation_tokens",
                                               "Generated tokens per finished request.", buckets=lengths)
        self.step_time = self._metric(Histogram, "step_duration_seconds", "Wall time of one engine step.",
                                      buckets=STEP_BUCKETS)
        self.inter_token = WeightedHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Per sequence and step that gave it tokens: time since the previous step ended (or this step's "
            "duration after an idle engine). vLLM's time_per_output_token_seconds.", self.labels, TPOT_BUCKETS)
        self.registry.register(self.inter_token)

    # -- updates -------------------------------------------------------------------------------------------

    def attach(self) -> EngineMetrics:
        """Observe every step of this engine (also those `stream` and `LLM.generate` run)."""
        if any(isinstance(getattr(o, "__self__", None), EngineMetrics) for o in self.engine.step_observers):
            raise RuntimeError("this engine already has an attached EngineMetrics")
        self.engine.step_observers.append(self.observe_step)
        return self

    def observe_step(self, outputs: Iterable[RequestOutput]) -> None:
        now = time.monotonic()
        deltas = self._count_deltas()
        new_steps = self.engine.stats.num_steps - self._steps_seen
        if new_steps:
            self._steps_seen += new_steps
            self._observe_step_times(new_steps, now, deltas)
        for output in outputs:
            self.observe_request(output)
        busy = self.engine.has_unfinished_requests()
        self._previous_step_end = now if busy else None
        if not busy or now - self._gauges_at >= self.gauge_interval_s:
            self.refresh_gauges(now)

    def _cumulative(self) -> dict[str, int]:
        stats = self.engine.get_stats()
        return {
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "num_preemptions": stats.num_preemptions,
            "kv_blocks_swapped_out": stats.kv_blocks_swapped_out,
            "kv_blocks_swapped_in": stats.kv_blocks_swapped_in,
            **{name: getattr(stats, name) for name in KV_CONNECTOR_COUNTERS},
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "spec_decode_num_draft_tokens": stats.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.spec_accepted_tokens,
            **{f"position{i}": n for i, n in enumerate(stats.spec_accepted_by_position)},
        }

    def _count_deltas(self) -> dict[str, int]:
        current = self._cumulative()
        deltas = {key: max(value - self._last.get(key, 0), 0) for key, value in current.items()}
        self._last = current
        for key, delta in deltas.items():
            if not delta:
                continue
            if key.startswith("position"):  # a child per draft position, made when the position first appears
                self.per_position.labels(**self.labels, position=key.removeprefix("position")).inc(delta)
            else:
                self.counters[key].inc(delta)
        return deltas

    def _observe_step_times(self, new_steps: int, now: float, deltas: dict[str, int]) -> None:
        recent = list(islice(reversed(self.engine.stats.step_times), new_steps))
        for seconds in recent:
            self.step_time.observe(seconds)
        # Each sequence that got tokens this step counts once; accepted drafts are its extra tokens.
        sequences = deltas["generation_tokens"] - deltas["spec_decode_num_accepted_tokens"]
        waited = now - self._previous_step_end if self._previous_step_end is not None else recent[0]
        self.inter_token.observe(waited, sequences)

    def observe_request(self, output: RequestOutput) -> None:
        reason = "error" if output.error else (output.outputs[0].finish_reason or "abort")
        self.request_success.labels(**self.labels, finished_reason=reason).inc()
        metrics = output.metrics
        if output.error or metrics is None or metrics.first_token_time is None or metrics.finish_time is None:
            return
        num_generated = len(output.outputs[0].token_ids)
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        self.e2e.observe(metrics.finish_time - metrics.arrival_time)
        if num_generated > 1:
            self.request_tpot.observe((metrics.finish_time - metrics.first_token_time) / (num_generated - 1))
        self.prompt_lengths.observe(len(output.prompt_token_ids))
        self.generation_lengths.observe(num_generated)

    def refresh_gauges(self, now: float | None = None) -> None:
        stats, running = self.engine.get_stats(), self.engine.scheduler.running
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache_usage)
        self.running_tokens.set(sum(seq.num_tokens for seq in running))
        self._gauges_at = time.monotonic() if now is None else now


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A registry for one process's metrics, with the process's CPU, memory and GC metrics."""
    registry = CollectorRegistry()
    if process_metrics:
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def start_metrics_server(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """Serve `registry` at http://addr:port/metrics from a daemon thread; port 0 picks a free port
    (`server.server_port`). `server.shutdown()` stops it."""
    server, _thread = start_http_server(port, addr, registry)
    return server
