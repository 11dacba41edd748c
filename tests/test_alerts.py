"""ops/alerts.yml: valid for Prometheus (`promtool check rules`), every alert fires in its unit test and stays
quiet on healthy series (`promtool test rules ops/alerts_test.yml`), and every metric it reads is exported."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.promtools import exported_names, promtool, referenced_names

OPS = Path(__file__).resolve().parent.parent / "ops"
RULES, RULE_TESTS = OPS / "alerts.yml", OPS / "alerts_test.yml"


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alert_names() -> set[str]:
    return {rule["alert"] for rule in rules() if "alert" in rule}


def test_rules_are_valid():
    result = promtool("check", "rules", str(RULES), cwd=OPS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_rule_unit_tests_pass():
    result = promtool("test", "rules", str(RULE_TESTS), cwd=OPS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_in_a_unit_test_and_is_quiet_when_healthy():
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    checks = [(case["name"], check) for case in cases for check in case.get("alert_rule_test", [])]
    fired = {check["alertname"] for _, check in checks if check.get("exp_alerts")}
    quiet_when_healthy = {check["alertname"] for name, check in checks if name == "healthy" and not check["exp_alerts"]}
    assert len(alert_names()) >= 10
    assert fired == alert_names()
    assert quiet_when_healthy == alert_names()


def test_rules_read_only_exported_metrics():
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        unknown = referenced_names(rule["expr"]) - exported_names() - recorded
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads unexported {sorted(unknown)}"
