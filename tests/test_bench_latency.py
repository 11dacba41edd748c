"""`tokenmill bench latency`: batch-1 requests timed step by step, with percentiles, on the real model."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.real_model


def test_bench_latency_times_every_token(tmp_path, capsys):
    out = tmp_path / "latency.json"
    code = main(["bench", "latency", "--prompt-tokens", "20", "--output-tokens", "6", "--requests", "3",
                 "--threads", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "latency at batch 1" in printed
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert len(requests) == 3
    for request in requests:
        assert request["num_tokens"] == 6
        assert len(request["token_gaps"]) == 5 and all(gap > 0 for gap in request["token_gaps"])
        assert 0 < request["ttft"] < request["e2e"]
        assert request["e2e"] == pytest.approx(request["ttft"] + sum(request["token_gaps"]))
    summary = report["summary_seconds"]
    assert set(summary) == {"time to first token", "inter-token latency", "time per output token", "end to end"}
    for name, p in summary.items():
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], name
        assert name in printed


def test_bench_latency_refuses_a_single_output_token(capsys):
    assert main(["bench", "latency", "--output-tokens", "1"]) == 2
    assert "--output-tokens must be at least 2" in capsys.readouterr().err
