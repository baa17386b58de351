"""The chart's monitoring: PodMonitor, PrometheusRule and Grafana dashboard.

Every PromQL expression the rendered rules and the dashboard use is parsed with a real
PromQL parser, and each of its selectors must match a series on the ``/metrics`` of a
real running sidecar (SQLite backend, whose database the test locks for a while so that
renews and acquires really fail) — labels that Prometheus adds at scrape time
(namespace, pod, ...) aside. promtool (built from the Go module proxy like the rest of
the test bed) checks the rendered rules and runs unit tests of each alert on synthetic
series.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit.chart_support import CHART, documents, find, template
from testkit.support import SidecarProcess, get_json, wait_until
from testkit.testbed import gobuild

MONITORING = ["monitoring.podMonitor.enabled=true", "monitoring.prometheusRule.enabled=true",
              "monitoring.dashboard.enabled=true", "example.enabled=true"]
# Added by Prometheus from the scrape target, not exposed by the sidecar itself.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service"}
ALERTS = {"LeaseSidecarNotExactlyOneLeader", "LeaseSidecarRenewFailures",
          "LeaseSidecarBackendDown", "LeaseSidecarLeaderFlapping"}

pytestmark = pytest.mark.tools  # helm renders the chart; promtool checks its rules


# ----------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return documents(template("mon", "monitoring", MONITORING).stdout)


def rule_exprs(rule: dict[str, Any]) -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert match, var
            exprs.append(match.group(1))
    return exprs


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would see them once substituted."""
    expr = expr.replace("$__rate_interval", "2m").replace("$__interval", "1m")
    return re.sub(r"\$\w+", ".*", expr)


def test_monitoring_is_off_by_default():
    kinds = {d["kind"] for d in documents(template("mon", "monitoring", []).stdout)}
    assert not kinds & {"PodMonitor", "PrometheusRule"}
    assert "ConfigMap" not in kinds


def test_podmonitor_scrapes_the_sidecar_port(rendered: list[dict[str, Any]]):
    monitor = find(rendered, "PodMonitor")
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    deployment = find(rendered, "Deployment", "-example")
    sidecar, = deployment["spec"]["template"]["spec"]["initContainers"]
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
    # The default selector is the label every sidecar keeps on its own pod.
    assert monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "lease-role", "operator": "Exists"}]
    assert monitor["metadata"]["namespace"] == "monitoring"


def test_dashboard_configmap_carries_the_file(rendered: list[dict[str, Any]]):
    configmap = find(rendered, "ConfigMap", "-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "lease-sidecar.json").read_text())
    assert json.loads(configmap["data"]["lease-sidecar.json"]) == shipped
    titles = " ".join(p["title"] for p in shipped["panels"]).lower()
    for topic in ("leaders per lease", "transitions", "renew", "errors"):
        assert topic in titles


def test_rules_and_their_values(rendered: list[dict[str, Any]]):
    exprs = rule_exprs(find(rendered, "PrometheusRule"))
    assert set(exprs) == ALERTS
    tuned = documents(template("mon", "monitoring", [
        "monitoring.prometheusRule.enabled=true",
        "monitoring.prometheusRule.alerts.flapping.window=30m",
        "monitoring.prometheusRule.alerts.flapping.acquisitions=9",
        "monitoring.prometheusRule.alerts.backendDown.enabled=false"]).stdout)
    tuned_exprs = rule_exprs(find(tuned, "PrometheusRule"))
    assert "LeaseSidecarBackendDown" not in tuned_exprs
    assert tuned_exprs["LeaseSidecarLeaderFlapping"].endswith("[30m])) > 9")


def test_schema_refuses_bad_monitoring_values():
    for bad in ("monitoring.prometheusRule.alerts.flapping.acquisitions=0",
                "monitoring.podMonitor.interval=often",
                "monitoring.dashboard.unknown=1"):
        proc = template("mon", "monitoring", [bad], check=False)
        assert proc.returncode != 0, bad
        assert "monitoring" in proc.stderr, proc.stderr


# ----------------------------------------------------------------- against a real /metrics


def selectors(node: Any) -> list[Any]:
    """Every vector selector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    children: list[Any] = []
    if isinstance(node, promql_parser.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql_parser.Call):
        children = list(node.args)
    elif isinstance(node, promql_parser.AggregateExpr):
        children = [node.expr, node.param]
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr,
                           promql_parser.SubqueryExpr)):
        children = [node.expr]
    return [s for child in children if child is not None for s in selectors(child)]


def matches(matcher: Any, labels: dict[str, str]) -> bool:
    value = labels.get(matcher.name, "")
    op = matcher.op
    if op == promql_parser.MatchOp.Equal:
        return value == matcher.value
    if op == promql_parser.MatchOp.NotEqual:
        return value != matcher.value
    found = re.fullmatch(matcher.value, value) is not None
    return found if op == promql_parser.MatchOp.Re else not found


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    status, text, _ = get_json(url + "/metrics")
    assert status == 200
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


@pytest.mark.slow
def test_every_queried_metric_exists_on_a_real_sidecar(rendered: list[dict[str, Any]],
                                                      tmp_path: Path):
    dashboard = json.loads(find(rendered, "ConfigMap", "-dashboard")["data"]["lease-sidecar.json"])
    queries = {f"rule {name}": expr
               for name, expr in rule_exprs(find(rendered, "PrometheusRule")).items()}
    queries |= {f"dashboard {i}": grafana_to_promql(e)
                for i, e in enumerate(dashboard_exprs(dashboard))}

    database = tmp_path / "leases.sqlite3"
    sidecar = SidecarProcess(tmp_path, "mon", args=[
        "--dsn", str(database), "--name", "jobs,reports",
        "--lease-duration", "3s", "--renew-interval", "300ms",
        "--renew-deadline", "2s"]).start()

    def count(operation: str, outcomes: set[str]) -> float:
        return sum(v for n, labels, v in scrape(sidecar.url)
                   if n == f"lease_sidecar_{operation}_duration_seconds_count"
                   and labels["outcome"] in outcomes)

    try:
        sidecar.wait_http()
        wait_until(lambda: sidecar.leader() == 200, 15)
        wait_until(lambda: count("renew", {"held"}) >= 2, 10, interval=0.1)
        # A real fault: another writer holds the database, so renews fail or time out,
        # the holder steps down, and its acquires fail until the writer lets go.
        blocker = sqlite3.connect(database, timeout=5, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            wait_until(lambda: count("renew", {"error", "timeout"}) > 0
                       and count("acquire", {"error"}) > 0, 20, interval=0.2)
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        wait_until(lambda: sidecar.leader() == 200, 20)
        samples = scrape(sidecar.url)
    finally:
        sidecar.stop()

    by_name: dict[str, list[dict[str, str]]] = {}
    for name, labels, _ in samples:
        by_name.setdefault(name, []).append(labels)
    values = {(n, tuple(sorted(labels.items()))): v for n, labels, v in samples}
    # The scrape is live, not a fixture: the leader says so, with its process metrics.
    assert values[("lease_sidecar_leader", (("lease", "jobs"),))] == 1
    assert values[("process_resident_memory_bytes", ())] > 10_000_000

    checked = set()
    for where, expr in queries.items():
        found = selectors(promql_parser.parse(expr))
        assert found, f"{where}: no selector in {expr}"
        for selector in found:
            name = selector.name
            assert name in by_name, f"{where}: {name} is not on /metrics"
            own = [m for m in selector.matchers.matchers if m.name not in TARGET_LABELS]
            assert any(all(matches(m, labels) for m in own) for labels in by_name[name]), \
                f"{where}: no series of {name} matches {[(m.name, m.value) for m in own]}"
            checked.add(name)
    # The queries cover what the issue asks for: leaders, transitions, renew latency,
    # errors, memory.
    assert {"lease_sidecar_leader", "lease_sidecar_transitions_total",
            "lease_sidecar_renew_duration_seconds_bucket",
            "lease_sidecar_renew_duration_seconds_count",
            "process_resident_memory_bytes"} <= checked


# ----------------------------------------------------------------- promtool


PROMTOOL_TESTS = {
    "rule_files": ["rules.yaml"],
    "evaluation_interval": "1m",
    "tests": [
        {   # nobody leads "reports" for longer than `for`; "jobs" is fine
            "interval": "1m",
            "input_series": [
                {"series": 'lease_sidecar_leader{namespace="ns",pod="a",lease="jobs"}',
                 "values": "1x10"},
                {"series": 'lease_sidecar_leader{namespace="ns",pod="b",lease="jobs"}',
                 "values": "0x10"},
                {"series": 'lease_sidecar_leader{namespace="ns",pod="c",lease="reports"}',
                 "values": "1 0x9"},
            ],
            "alert_rule_test": [{
                "eval_time": "5m", "alertname": "LeaseSidecarNotExactlyOneLeader",
                "exp_alerts": [{"exp_labels": {"namespace": "ns", "lease": "reports",
                                               "severity": "critical"}}]}],
        },
        {   # a handover gap shorter than `for` is no alert; two leaders are
            "interval": "1m",
            "input_series": [
                {"series": 'lease_sidecar_leader{namespace="ns",pod="a",lease="jobs"}',
                 "values": "1 1 0 0 0 0"},
                {"series": 'lease_sidecar_leader{namespace="ns",pod="b",lease="jobs"}',
                 "values": "0 0 0 1 1 1"},
                {"series": 'lease_sidecar_leader{namespace="ns",pod="c",lease="two"}',
                 "values": "1x5"},
                {"series": 'lease_sidecar_leader{namespace="ns",pod="d",lease="two"}',
                 "values": "1x5"},
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "LeaseSidecarNotExactlyOneLeader",
                 "exp_alerts": [{"exp_labels": {"namespace": "ns", "lease": "two",
                                                "severity": "critical"}}]},
                {"eval_time": "4m", "alertname": "LeaseSidecarNotExactlyOneLeader",
                 "exp_alerts": [{"exp_labels": {"namespace": "ns", "lease": "two",
                                                "severity": "critical"}}]},
            ],
        },
        {   # renews failing all along on pod a; pod b renews fine
            "interval": "1m",
            "input_series": [
                {"series": 'lease_sidecar_renew_duration_seconds_count'
                           '{namespace="ns",pod="a",lease="jobs",outcome="error"}',
                 "values": "0+2x15"},
                {"series": 'lease_sidecar_renew_duration_seconds_count'
                           '{namespace="ns",pod="b",lease="jobs",outcome="error"}',
                 "values": "0x15"},
                {"series": 'lease_sidecar_renew_duration_seconds_count'
                           '{namespace="ns",pod="b",lease="jobs",outcome="held"}',
                 "values": "0+30x15"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "LeaseSidecarRenewFailures", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "LeaseSidecarRenewFailures",
                 "exp_alerts": [{"exp_labels": {"namespace": "ns", "pod": "a", "lease": "jobs",
                                                "severity": "warning"}}]},
            ],
        },
        {   # backend down on pod a only
            "interval": "1m",
            "input_series": [
                {"series": 'lease_sidecar_backend_up{namespace="ns",pod="a",lease="jobs"}',
                 "values": "0x10"},
                {"series": 'lease_sidecar_backend_up{namespace="ns",pod="b",lease="jobs"}',
                 "values": "1x10"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "LeaseSidecarBackendDown", "exp_alerts": []},
                {"eval_time": "6m", "alertname": "LeaseSidecarBackendDown",
                 "exp_alerts": [{"exp_labels": {"namespace": "ns", "pod": "a", "lease": "jobs",
                                                "severity": "warning"}}]},
            ],
        },
        {   # "jobs" changes hands every minute across two pods; "calm" twice in 20 minutes
            "interval": "1m",
            "input_series": [
                {"series": 'lease_sidecar_transitions_total'
                           '{namespace="ns",pod="a",lease="jobs",event="acquired"}',
                 "values": "0 1 1 2 2 3 3 4 4 5 5 6 6 7 7 8 8 9 9 10 10"},
                {"series": 'lease_sidecar_transitions_total'
                           '{namespace="ns",pod="b",lease="jobs",event="acquired"}',
                 "values": "0 0 1 1 2 2 3 3 4 4 5 5 6 6 7 7 8 8 9 9 10"},
                {"series": 'lease_sidecar_transitions_total'
                           '{namespace="ns",pod="c",lease="calm",event="acquired"}',
                 "values": "0x10 1x10"},
                {"series": 'lease_sidecar_transitions_total'
                           '{namespace="ns",pod="d",lease="calm",event="acquired"}',
                 "values": "0x15 1x5"},
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "LeaseSidecarLeaderFlapping", "exp_alerts": []},
                {"eval_time": "18m", "alertname": "LeaseSidecarLeaderFlapping",
                 "exp_alerts": [{"exp_labels": {"namespace": "ns", "lease": "jobs",
                                                "severity": "warning"}}]},
            ],
        },
    ],
}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = gobuild.ensure_binary("promtool")
    return subprocess.run([str(binary), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_promtool_checks_and_unit_tests_the_rules(rendered: list[dict[str, Any]],
                                                 tmp_path: Path):
    spec = find(rendered, "PrometheusRule")["spec"]
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(spec))
    checked = promtool("check", "rules", "full.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout

    # The unit tests compare labels; annotations are checked above, not here.
    bare = json.loads(json.dumps(spec))
    for group in bare["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(bare))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(PROMTOOL_TESTS))
    tested = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout + tested.stderr

    # The tests can fail: a rule that never fires breaks them.
    for group in bare["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(0) > 1"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(bare))
    broken = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert broken.returncode != 0
