"""ops/grafana/tokenmill.json: a well-formed Grafana dashboard whose queries are valid PromQL (checked by promtool)
and read only metrics tokenmill exports, covering the engine, latency and job metrics."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.promtools import exported_names, promtool, referenced_names

DASHBOARD = Path(__file__).resolve().parent.parent / "ops" / "grafana" / "tokenmill.json"
# Grafana's variables, replaced by values Prometheus accepts, to check the queries' syntax
VARIABLES = {"$__rate_interval": "5m", "$model_name": ".*", "$instance": ".*"}
MUST_SHOW = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
             "prefix_cache_queries_total", "prefix_cache_hits_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total", "prompt_tokens_total", "generation_tokens_total",
             "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
             "e2e_request_latency_seconds_bucket", "step_duration_seconds_bucket", "num_tokens_running", "jobs",
             "job_rows_done", "job_rows_total", "shard_retries_total"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def test_dashboard_is_well_formed():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert {"type", "title", "gridPos"} <= set(panel)
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(set(refs)) == len(refs), panel["title"]
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name", "instance"} <= variables
    cells = [(p["title"], x, y) for p in panels for x, y in cells_of(p["gridPos"])]
    assert len({(x, y) for _, x, y in cells}) == len(cells), "panels overlap"


def cells_of(position: dict) -> list[tuple[int, int]]:
    return [(x, y) for x in range(position["x"], position["x"] + position["w"])
            for y in range(position["y"], position["y"] + position["h"])]


def test_queries_are_valid_promql(tmp_path):
    exprs = []
    for expr in queries():
        for variable, value in VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        exprs.append(expr)
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_queries_read_exported_metrics_and_cover_them():
    referenced = set().union(*map(referenced_names, queries()))
    assert not referenced - exported_names(), sorted(referenced - exported_names())
    assert {f"tokenmill:{name}" for name in MUST_SHOW} <= referenced
