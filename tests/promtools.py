"""Checking Prometheus files against the code: the metric names tokenmill exposes, read from the real exporters
(an engine on a tiny random model, and the job collector); the names a PromQL expression references; promtool.
promtool comes from Debian's `prometheus` package: `ops/ensure_tools.sh` installs it (`make test` runs it)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile

import pytest
from prometheus_client.metrics_core import Metric

from engine.prometheus import EngineMetrics, new_registry
from workers.job_metrics import JobMetricsCollector

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
TOKENMILL_NAME = re.compile(r"\btokenmill:[A-Za-z0-9_:]+")


def sample_names(family: Metric) -> set[str]:
    return {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}


@functools.cache
def exported_names() -> frozenset[str]:
    from engine import LLMEngine
    from tokenmill.bench.tiny_model import save_random_model

    with tempfile.TemporaryDirectory() as model_dir:
        save_random_model(model_dir)
        engine = LLMEngine.from_engine_args(model=model_dir, num_threads=1, num_kv_blocks=16,
                                            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    registry = new_registry(process_metrics=False)
    EngineMetrics(engine, registry=registry)
    families = [*registry.collect(), *JobMetricsCollector(lambda sql: []).describe()]
    return frozenset(name for family in families for name in sample_names(family))


def referenced_names(expr: str) -> set[str]:
    return set(TOKENMILL_NAME.findall(expr))


def promtool(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run promtool; a machine without it fails the test (the suite's setup installs it), never skips."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: run ops/ensure_tools.sh (Debian package prometheus)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
