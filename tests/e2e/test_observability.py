"""The dashboards and alerts name only metrics the server exports; request ids and JSON logs.

One `lightwell serve` (SmolLM2, JSON logs) on 127.0.0.1; every metric name in
deploy/grafana/lightwell-dashboard.json and deploy/prometheus/alerts.yml must appear in its
/metrics (promtool, where installed, also checks the rules file).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import time

import pytest
import yaml

from tests.e2e.test_server import MODEL, Server

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "lightwell-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(lightwell:[a-z0-9_:]+|process_[a-z0-9_]+)")
PROMETHEUS_MADE = {"up"}  # series Prometheus adds itself


@pytest.fixture(scope="module")
def server():
    srv = Server("--log-format", "json")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def exported(server) -> set[str]:
    names = set()
    for line in server.http.get("/metrics", headers=server.auth).text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names |= {name + s for s in suffixes.get(kind, [""])} | {name}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def dashboard_queries() -> dict[str, list[str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in panels}


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_dashboard_covers_the_issue_and_names_exported_metrics(server):
    names = exported(server)
    queries = dashboard_queries()
    titles = " ".join(queries).lower()
    for topic in ("ttft", "inter-token", "end-to-end", "throughput", "waiting", "kv cache",
                  "prefix cache", "preemption", "errors", "memory", "step time"):  # fmt: skip
        assert topic in titles, topic
    for title, exprs in queries.items():
        used = {m for e in exprs for m in METRIC.findall(e)}
        assert used, f"panel {title!r} names no metric"
        assert used <= names, f"panel {title!r} names metrics /metrics lacks: {used - names}"
        for e in exprs:
            assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_alert_rules_are_valid_and_name_exported_metrics(server):
    names = exported(server)
    rules = alert_rules()
    wanted = {"KVCacheNearlyFull", "WaitingQueueGrowing", "RequestErrors", "RequestTimeouts",
              "TTFTP99OverSLO"}  # fmt: skip
    assert wanted <= {r["alert"].removeprefix("Lightwell") for r in rules}
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
        assert rule["annotations"]["summary"]
        used = set(METRIC.findall(rule["expr"])) | (
            PROMETHEUS_MADE & set(re.findall(r"\w+", rule["expr"]))
        )
        assert used, rule["alert"]
        assert used - PROMETHEUS_MADE <= names, f"{rule['alert']}: {used - names}"
    kv = next(r for r in rules if r["alert"] == "LightwellKVCacheNearlyFull")
    assert "> 0.9" in kv["expr"] and kv["for"] == "5m"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_the_rules():
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_request_id_errors_and_json_logs(server):
    before = server.metric("request_errors_total", 'reason="bad_request"')
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    r = server.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-abc.1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc.1"
    assert r.json()["id"] == "cmpl-trace-abc.1"
    made = server.post("/v1/completions", json=body).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    bad = server.post("/v1/completions", json={**body, "max_tokens": -1})
    assert bad.status_code == 400 and bad.headers["x-request-id"]
    assert server.metric("request_errors_total", 'reason="bad_request"') == before + 1
    assert server.metric("engine_step_seconds_count") > 0
    assert server.metric("host_memory_total_bytes") > 0
    lines = [json.loads(x) for x in server.output().splitlines() if x.startswith("{")]
    assert any(
        e.get("request_id") == "cmpl-trace-abc.1" and "finished" in e["message"] for e in lines
    )
    assert any(e.get("request_id") == "trace-abc.1" and "POST" in e["message"] for e in lines)


def test_invalid_request_id_replaced_and_disconnect_counted(server):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
    r = server.post("/v1/completions", json={**body, "max_tokens": 1},
                    headers={"X-Request-Id": "two words"})  # fmt: skip
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    before = server.metric("request_timeouts_total", 'reason="client_disconnect"')
    with server.http.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=server.auth
    ) as stream:
        next(stream.iter_lines())  # the first chunk, then the client goes away
    deadline = time.time() + 20
    while time.time() < deadline:
        now = server.metric("request_timeouts_total", 'reason="client_disconnect"')
        if now == before + 1:
            break
        time.sleep(0.2)
    assert now == before + 1


def test_auto_tool_choice_without_a_parser_is_a_400(server):
    """SmolLM2's chat template names no tool-call format and this server sets no parser."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "needs a tool-call parser" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"
