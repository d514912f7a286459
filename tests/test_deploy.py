"""What deploy/ ships: the Grafana dashboard's queries name only metrics a live server
exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.conftest import running_server

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "trio-llm-server.json"
def query_metrics(expr: str) -> set[str]:
    """The metric names an expression reads: its words, less functions (a word before
    "("), grouping labels, label matchers, ranges and variables."""
    label_values = re.match(r"label_values\(\s*([^,)]+)", expr)
    if label_values:
        expr = label_values.group(1)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    words = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\(?)", expr)
    return {w for w, call in words if not call and not w.startswith("$")}


def test_query_metrics():
    assert query_metrics(
        'histogram_quantile(0.9, sum by (le) (rate(trio_llm:x_bucket{model_name=~"$m"}[5m])))'
    ) == {"trio_llm:x_bucket"}
    assert query_metrics("sum by (cause) (rate(a_total[1m]))") == {"a_total"}
    assert query_metrics("label_values(b_total, model_name)") == {"b_total"}


async def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    wanted = set().union(*(query_metrics(e) for e in exprs))
    assert len(wanted) >= 15
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    async with running_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            assert r.status_code == 400  # (so that the rejections counter has a sample)
            scrape = (await http.get("/metrics")).text
    exported = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)", scrape, re.M))
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
