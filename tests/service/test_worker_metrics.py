"""A job through a real Celery worker moves the worker's Prometheus counters by the job's own totals, and a
worker with a tiny KV pool reports preemptions. `tokenmill stack up --port-base B` serves worker i's metrics
on B + 20 + i - 1 and the job gauges after them (stack.json: state["ports"]["metrics"]). The test starts its
own one-worker stack, so the preemption check does not depend on the session stack's KV size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.fixtures_services import free_port_block, pg_databases  # noqa: F401 - fixture
from tests.scrape import Scrape, metrics_when_up
from tests.service.conftest import RunningStack, submit_file, tokenmill, wait_for_job, wait_until

pytestmark = pytest.mark.real_model

LABELS = {"model_name": "smollm2-135m"}
COUNTERS = ("tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total", "tokenmill:num_preemptions_total")
ROWS = 24
TINY_KV_GIB = "0.02"  # ~450 tokens of KV in float32: a handful of the job's requests at a time


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory, pg_databases) -> Iterator[RunningStack]:  # noqa: F811
    state_dir = tmp_path_factory.mktemp("metrics-stack")
    base = free_port_block(24)
    tokenmill("stack", "up", "--workers", "1", "--state-dir", str(state_dir), "--port-base", str(base),
              "--database-url", pg_databases(), "--threads", "1",
              "--kv-cache-memory", TINY_KV_GIB, timeout=240)
    running = RunningStack(state_dir, json.loads((state_dir / "stack.json").read_text()))
    try:
        yield running
    finally:
        tokenmill("stack", "down", "--state-dir", str(state_dir), check=False, timeout=180)


def worker_scrape(stack: RunningStack) -> Scrape:
    port = stack.state["ports"]["metrics"]  # worker 0
    text = wait_until(lambda: metrics_when_up(f"http://127.0.0.1:{port}/metrics"), "the worker's metrics endpoint")
    return Scrape(text)


def test_a_job_moves_the_worker_counters_by_its_totals(tiny_stack, tmp_path):
    from storage import db
    from tests.jobs.jobhelpers import write_parquet

    before = worker_scrape(tiny_stack)
    counting = {"custom_id": [f"row-{i:04d}" for i in range(ROWS)],  # long answers, so the tiny pool runs out
                "prompt": [f"List the numbers from {i} to {i + 100}, separated by commas: {i}," for i in range(ROWS)]}
    source = write_parquet(tmp_path / "rows.parquet", counting)
    job_id = submit_file(tiny_stack, source, "--max-tokens", "32", "--shard-size", str(ROWS))
    sessions = db.session_factory(db.make_engine(tiny_stack.database_url))
    job = wait_for_job(sessions, job_id, timeout=600)
    assert job["status"] == "completed", job
    after = worker_scrape(tiny_stack)
    moved = {name: after.value(name, **LABELS) - before.value(name, **LABELS) for name in COUNTERS}
    assert moved["tokenmill:prompt_tokens_total"] == job["prompt_tokens"]
    assert moved["tokenmill:generation_tokens_total"] == job["completion_tokens"]
    assert moved["tokenmill:num_preemptions_total"] > 0, "the tiny KV pool should have forced preemptions"
    finished = sum(after.value("tokenmill:request_success_total", **LABELS, finished_reason=reason)
                   - before.value("tokenmill:request_success_total", **LABELS, finished_reason=reason)
                   for reason in ("stop", "length"))
    assert finished == job["requests_completed"] == ROWS
    assert after.value("tokenmill:time_to_first_token_seconds_count", **LABELS) - \
        before.value("tokenmill:time_to_first_token_seconds_count", **LABELS) == ROWS
    assert after.value("tokenmill:num_requests_running", **LABELS) == 0
    sessions.kw["bind"].dispose()
