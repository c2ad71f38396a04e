"""deploy/grafana/pagedkv.json: a well-formed dashboard whose every PromQL expression names
only metrics the services export (the allocator's and executors' from their own registries,
the gateway's from the list below), and which shows every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.metrics import AllocatorCollector
from allocator_svc.service import AllocatorServicer
from common.interceptor import guarded_handler
from common.metrics import RpcMetrics, service_registry

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pagedkv.json"

# Exported, deliberately not charted: the interpreter's own (the process's CPU and memory are).
NOT_CHARTED = re.compile(r"^(python_|process_(?!cpu_seconds|resident_memory))")
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "table", "bargauge", "heatmap"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "info": ("_info",), "unknown": ("",)}
# PromQL words that are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}


def _families() -> dict[str, str]:
    """Every metric family the allocator and an executor export, and the gateway's: name ->
    type. The services' come from their registries, built as their __main__ builds them."""
    from common.executor_description import ExecutorDescription
    from executor_svc.service import SERVICE_NAME as EXECUTOR_SERVICE
    from executor_svc.service import ExecutorServicer, StepMetrics
    from gateway.metrics import GatewayMetrics

    # The gateway's, from its own registry (its engine-state families come with no engines).
    families = {m.name: m.type for m in GatewayMetrics("m").registry.collect()}
    allocator = service_registry()
    allocator.register(AllocatorCollector(Allocator(Limits())))
    guarded_handler(AllocatorServicer(Allocator(Limits())), "pagedkv.allocator.v1.AllocatorService",
                    metrics=RpcMetrics(allocator))
    info = ExecutorDescription(
        instance_id="id", model_name="model", model_fingerprint="fp", num_blocks=64,
        block_size=16, num_cpu_blocks=0, backend="cpu", device="cpu", max_model_len=2048,
        eos_token_ids=(2,), vocab_size=512, max_num_batched_tokens=2048, max_num_seqs=256)
    runner: Any = SimpleNamespace(info=info, requests={})
    executor = service_registry()
    guarded_handler(ExecutorServicer(runner, metrics=StepMetrics(executor, runner)),
                    EXECUTOR_SERVICE, metrics=RpcMetrics(executor))
    for registry in (allocator, executor):
        for family in registry.collect():
            families[family.name] = family.type
    return families


def _exported_series(families: dict[str, str]) -> dict[str, str]:
    """The names a PromQL expression may select (`_total`, `_bucket` ...) -> their family."""
    return {name + suffix: name for name, kind in families.items()
            for suffix in _SUFFIXES[kind]}


def _selected_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions, keywords,
    labels (in matchers or groupings), durations or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        following = expr[match.end():].lstrip()[:1]
        word = match.group()
        if following != "(" and word.lower() not in _KEYWORDS:
            names.add(word)
    return names


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            (metric,) = re.findall(r"label_values\(\s*([^,{)\s]+)", variable["definition"])
            exprs.append(metric)
    return exprs


def test_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    # Unique panel ids inside a 24-column grid, no two panels overlapping; every query
    # panel has targets with an expression and unique refIds, on the datasource variable.
    dashboard = _load()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"], panel
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        assert all(t["expr"].strip() for t in targets)
    # Every variable a query uses is defined (Grafana's own start with $__).
    used = {name for expr in _expressions(dashboard)
            for name in re.findall(r"\$\{?(\w+)", expr) if not name.startswith("__")}
    assert used <= variables.keys()


def test_dashboard_selects_only_exported_metrics_and_shows_them_all() -> None:
    families = _families()
    series = _exported_series(families)
    selected = {name for expr in _expressions(_load()) for name in _selected_names(expr)}
    assert selected - series.keys() == set(), "names no service exports (or a wrong suffix)"
    shown = {series[name] for name in selected}
    missing = {f for f in families if f not in shown and not NOT_CHARTED.match(f)}
    assert missing == set(), "exported metrics without a panel"


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.99, sum by (le, phase) (rate(a_bucket{x="y"}[$__rate_interval])))',
     {"a_bucket"}),
    ("sum(rate(vllm:prompt_tokens_total{model_name=~\"$model_name\"}[5m])) / sum(b)",
     {"vllm:prompt_tokens_total", "b"}),
    ("sum by (pool_id) (c - d) > bool 0", {"c", "d"}),
])
def test_selected_names_finds_metrics_not_functions_or_labels(expr: str, names: set[str]) -> None:
    assert _selected_names(expr) == names
