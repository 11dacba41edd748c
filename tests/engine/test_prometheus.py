"""The engine's Prometheus exporter on the real model: requests through an `LLMEngine` with a tiny KV pool
(so it preempts) and n-gram speculation, scraped over HTTP; every counter moved by exactly the outputs'
totals, every request histogram counted each finished request once, and the gauges matched the engine."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.prometheus import EngineMetrics, start_metrics_server
from tests.engine.identity import PASSAGE
from tests.scrape import Scrape

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
LABELS = {"model_name": MODEL}
MAX_TOKENS = 24
NUM_KV_BLOCKS = 20  # 19 usable blocks of 16 tokens: two or three of these requests at a time, and they preempt
# whatever the adaptive speculation (timed, so machine-dependent) drafts (here 3 without speculation, 2 with)


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine.from_engine_args(model=MODEL, num_threads=2, num_kv_blocks=NUM_KV_BLOCKS,
                                        max_num_batched_tokens=64,
                                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    metrics = EngineMetrics(engine, gauge_interval_s=0).attach()
    server = start_metrics_server(metrics.registry, 0, "127.0.0.1")
    yield engine, f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()


@pytest.fixture(scope="module")
def run(served, tokenizer):
    """Copying prompts (they share the chat template's prefix, and n-gram drafts get accepted) plus one request
    larger than the whole pool; one scrape mid-run, one at the end."""
    from tokenmill.bench.workload import chat_ids

    engine, url = served
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"copy-{i}", chat_ids(tokenizer, f"Repeat this text exactly:\n{PASSAGE[:160 + 30 * i]}"),
                           params)
    engine.add_request("too-big", "Hello", SamplingParams(max_tokens=NUM_KV_BLOCKS * 16))
    outputs, mid_run = [], None
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
        scheduler = engine.scheduler
        if mid_run is None and scheduler.running and scheduler.waiting:
            state = dict(running=len(scheduler.running), waiting=len(scheduler.waiting),
                         kv=engine.kv_manager.pool.usage, tokens=sum(s.num_tokens for s in scheduler.running))
            mid_run = (state, Scrape.from_url(url))
    return outputs, mid_run, Scrape.from_url(url)


def test_counters_moved_by_the_outputs_totals(served, run):
    engine, _ = served
    outputs, _, end = run
    ok = [o for o in outputs if not o.error]
    assert len(ok) == 8 and [o.request_id for o in outputs if o.error] == ["too-big"]
    assert end.value("tokenmill:prompt_tokens_total", **LABELS) == sum(len(o.prompt_token_ids) for o in ok)
    generated = sum(len(o.outputs[0].token_ids) for o in ok)
    assert generated == 8 * MAX_TOKENS
    assert end.value("tokenmill:generation_tokens_total", **LABELS) == generated
    preemptions = end.value("tokenmill:num_preemptions_total", **LABELS)
    assert preemptions == engine.scheduler.num_preemptions > 0
    kv_stats = engine.kv_manager.stats
    assert end.value("tokenmill:prefix_cache_queries_total", **LABELS) == kv_stats.queries > 0
    assert end.value("tokenmill:prefix_cache_hits_total", **LABELS) == kv_stats.hits > 0
    spec = engine.spec.stats
    drafted = end.value("tokenmill:spec_decode_num_draft_tokens_total", **LABELS)
    accepted = end.value("tokenmill:spec_decode_num_accepted_tokens_total", **LABELS)
    assert (drafted, accepted) == (spec.draft_tokens, spec.accepted_tokens) and accepted > 0
    by_position = [end.value("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", **LABELS, position=str(i))
                   for i in range(3)]
    assert sum(by_position) == accepted and by_position == spec.accepted_by_position
    assert end.value("tokenmill:request_success_total", **LABELS, finished_reason="length") == 8
    assert end.value("tokenmill:request_success_total", **LABELS, finished_reason="error") == 1


def test_histograms_counted_each_finished_request_and_step(served, run):
    engine, _ = served
    _, _, end = run
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert end.value(f"tokenmill:{name}_count", **LABELS) == 8, name  # the failed request has no timings
        assert end.value(f"tokenmill:{name}_bucket", **LABELS, le="+Inf") == 8, name
    assert end.value("tokenmill:request_generation_tokens_sum", **LABELS) == 8 * MAX_TOKENS
    assert end.value("tokenmill:step_duration_seconds_count", **LABELS) == engine.stats.num_steps
    assert end.value("tokenmill:step_duration_seconds_sum", **LABELS) == pytest.approx(engine.stats.step_time_total)
    # one inter-token observation per sequence per step that gave it tokens: generated minus accepted drafts
    sequence_steps = end.value("tokenmill:generation_tokens_total", **LABELS) - engine.spec.stats.accepted_tokens
    assert end.value("tokenmill:inter_token_latency_seconds_count", **LABELS) == sequence_steps
    itl_sum = end.value("tokenmill:inter_token_latency_seconds_sum", **LABELS)
    assert 0 < itl_sum / sequence_steps < 10
    buckets = sorted((float(dict(labels)["le"]), end.value("tokenmill:inter_token_latency_seconds_bucket", **labels))
                     for labels in end.labelsets("tokenmill:inter_token_latency_seconds_bucket"))
    assert [count for _, count in buckets] == sorted(count for _, count in buckets)  # cumulative


def test_gauges_follow_the_engine(run):
    _, mid_run, end = run
    assert mid_run is not None, "the tiny pool should have left requests waiting"
    state, scrape = mid_run
    assert scrape.value("tokenmill:num_requests_running", **LABELS) == state["running"] > 0
    assert scrape.value("tokenmill:num_requests_waiting", **LABELS) == state["waiting"] > 0
    assert scrape.value("tokenmill:kv_cache_usage_perc", **LABELS) == pytest.approx(state["kv"])
    assert 0 < state["kv"] <= 1
    assert scrape.value("tokenmill:num_tokens_running", **LABELS) == state["tokens"]
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_tokens_running"):
        assert end.value(f"tokenmill:{name}", **LABELS) == 0, name
    info = end.labelsets("tokenmill:cache_config_info")
    assert info == [{**LABELS, "block_size": "16", "num_kv_blocks": str(NUM_KV_BLOCKS),
                     "enable_prefix_caching": "True"}]
    assert end.value("process_resident_memory_bytes") > 0


def test_an_engine_takes_one_exporter(served):
    engine, _ = served
    with pytest.raises(RuntimeError, match="already"):
        EngineMetrics(engine).attach()
