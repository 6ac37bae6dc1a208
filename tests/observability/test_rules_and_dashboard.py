"""promtool over the Prometheus rules and every PromQL expression of the Grafana dashboard."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from gateway.budget_metrics import BudgetMetrics
from gateway.metrics import GatewayMetrics, render
from tests.observability.prometheus_server import require_binary

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
RULES = DASHBOARDS / "prometheus" / "rules.yml"
RULES_TEST = DASHBOARDS / "prometheus" / "rules_test.yml"
DASHBOARD = DASHBOARDS / "tiergate.json"

# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$tier": ".*",
}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    return exprs


def grafana_expanded(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def test_rules_pass_promtool_check():
    result = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout


def test_alert_fires_over_400ms_premium_p99_and_stays_silent_under_it():
    result = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [t["name"] for t in yaml.safe_load(RULES_TEST.read_text())["tests"]]
    assert any("pages" in c for c in cases) and any("silent" in c for c in cases)


def test_promtool_test_fails_when_the_threshold_is_moved(tmp_path):
    # The unit tests pin the 0.4 s threshold: at 0.8 s the slow case no longer pages.
    (tmp_path / "rules.yml").write_text(RULES.read_text().replace("ttft_p99_premium > 0.4", "ttft_p99_premium > 0.8"))
    (tmp_path / "rules_test.yml").write_text(RULES_TEST.read_text())
    result = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "PremiumTTFTP99High" in result.stdout + result.stderr


def test_rules_define_the_page_of_design_md():
    group = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    record = next(r for r in group if r.get("record") == "ttft_p99_premium")
    alert = next(r for r in group if r.get("alert") == "PremiumTTFTP99High")
    assert 'tier="premium"' in record["expr"] and "0.99" in record["expr"]
    assert alert["expr"] == "ttft_p99_premium > 0.4" and alert["for"] == "5m"
    assert "Scale out" in alert["annotations"]["runbook"] and "Shed standard" in alert["annotations"]["runbook"]


def test_every_dashboard_query_passes_promtool(tmp_path):
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}", "expr": grafana_expanded(e)} for i, e in enumerate(dashboard_exprs())],
            }
        ]
    }
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", "dashboard_rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_refuses_a_broken_dashboard_query(tmp_path):
    # Guards the check above: a malformed query must make promtool fail.
    broken = {"groups": [{"name": "d", "rules": [{"record": "dashboard:broken", "expr": "sum by (tier (rate(x[1m]))"}]}]}
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", "broken.yml", cwd=tmp_path).returncode != 0


def test_every_metric_the_dashboard_queries_is_exposed(engine_state):
    metrics = GatewayMetrics()
    metrics.attach_engine(engine_state)
    BudgetMetrics(metrics.registry).observe("acme", "usd", 0.5)  # the app registers them (gateway/budget_gate.py)
    exposed = {line.split("{")[0].split(" ")[0] for line in render(metrics)[0].decode().splitlines() if not line.startswith("#")}
    queried = {name for e in dashboard_exprs() for name in re.findall(r"\btiergate_\w+", e)}
    assert queried - exposed == set()
    covered = {"ttft_seconds", "tpot_seconds", "inter_token_seconds", "queue_depth", "kv_blocks_used", "kv_blocks_reserved", "preemptions_total",
               "rejections_total", "gpu_seconds_total", "adapter_cache_hits_total", "step_seconds"}
    assert {n.removeprefix("tiergate_").removesuffix("_bucket") for n in queried} >= covered


def test_dashboard_imports_with_the_datasource_as_a_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"

