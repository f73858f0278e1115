"""The metrics as Prometheus tooling reads them, on a real served cluster
(disaggregated over gRPC) after traffic: ``promtool check metrics`` is clean
(where promtool is installed; the same rules are checked in Python
everywhere), every series has the served model's ``model_name``, and every
query of the Grafana dashboard in deploy/ selects series that exist in the
scrape, with data, carrying the labels its legend names."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import disagg_spec, running_cluster

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvrelay-dashboard.json"
SELECTOR = re.compile(r"(kvrelay_[a-zA-Z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"')


@pytest.fixture(scope="module")
def scrape(ray_instance) -> tuple[str, str]:
    """(the exposition text after traffic, the model's name)."""
    with running_cluster(disagg_spec(1, 1, "grpc")) as rc:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rc.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                            max_tokens=6, temperature=0, stream=True))
        client.completions.create(model=model, prompt=["One, two,", "A, B,"], max_tokens=4, temperature=0)
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
        with urllib.request.urlopen(f"http://127.0.0.1:{rc.http_port}/metrics", timeout=30) as r:
            return r.read().decode(), model


def _samples(text: str):
    return [(family, s) for family in text_string_to_metric_families(text) for s in family.samples]


def test_every_series_has_the_model_name_and_the_names_follow_prometheus_rules(scrape):
    text, model = scrape
    samples = _samples(text)
    assert samples
    assert {s.labels.get("model_name") for _, s in samples} == {model}
    for family, s in samples:
        if family.type == "counter":
            assert s.name.endswith(("_total", "_created")), f"{s.name}: a counter's samples end in _total"
        else:
            assert not s.name.endswith("_total"), f"{s.name}: a {family.type} must not end in _total"
        assert family.documentation, f"{family.name}: no HELP"
    assert "kvrelay_replica_kv_blocks_total" not in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_is_clean(scrape):
    text, _ = scrape
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def _queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expression, legend format) of every panel target and template query."""
    out = [(p["title"], target["expr"], target.get("legendFormat", "")) for p in dashboard["panels"]
           for target in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"${var['name']}", var["query"]["query"], ""))
    return out


def test_every_dashboard_query_selects_series_with_data(scrape):
    text, model = scrape
    samples = [s for _, s in _samples(text)]
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(dashboard["panels"]) >= 15 and len(queries) > len(dashboard["panels"])
    for title, expr, legend in queries:
        selectors = SELECTOR.findall(expr)
        assert selectors, f"{title}: {expr} selects no kvrelay series"
        for name, braces in selectors:
            matchers = [(k, op, v.replace("$model_name", model)) for k, op, v in MATCHER.findall(braces)]
            hits = [s for s in samples if s.name == name and all(_matches(s.labels.get(k, ""), op, v)
                                                                   for k, op, v in matchers)]
            assert hits, f"{title}: no series {name}{braces} in the scrape"
            if name.endswith(("_bucket", "_count", "_sum", "_total")):
                assert any(s.value > 0 for s in hits), f"{title}: {name}{braces} has no data after traffic"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                assert all(label in s.labels for s in hits), f"{title}: legend label {label} not on {name}"


def _matches(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    found = re.fullmatch(want, value) is not None
    return found if op == "=~" else not found
