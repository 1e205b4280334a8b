"""docs/grafana/onebit.json: a dashboard Grafana imports as it is, whose every query asks only for what
onebitd exports, so that it cannot rot when a metric or a label is renamed.

Where the names come from: a real scrape of ``/metrics`` from onebitd (supervisor/observe/metrics.py's
code, run by ``run_daemon`` with the fake decoder and a fake worker provider), with two models so that
the store and provider families carry their ``model`` label, after requests that give every labelled
family a sample: one of model ``a`` on the file route (its provider's prefill), one of model ``b``,
which waits for its load.  A family's label names and values are those its samples carry, read by
prometheus_client's text parser; a family with no sample yet has none, so a panel that reads one fails
here until the test makes a request that fills it (nothing is taken from the metric objects
themselves).  Prometheus's target labels (``instance``, ``job``), which it adds at scrape, are allowed
besides; every selector filters on the dashboard's ``$instance`` variable.

The queries are read by the small PromQL reader below: metric names, the label names of selectors,
of ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``, and the ``{{label}}`` of
legends.  ``promtool check rules`` parses every query, so what the reader reads is PromQL.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from supervisor import config as configuration
from tests.fakes import fake_provider
from tests.rigs.helpers import client_for
from tests.rigs.promql import Query, read
from tests.rigs.rig import HANDOFF_ALWAYS, PROMPT, TIMEOUT, Control, RouteLines, make_config, ready, run_daemon, several

ROOT = Path(__file__).parents[3]
DASHBOARD = ROOT / "docs" / "grafana" / "onebit.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Added by Prometheus to every series it scrapes, not by the exposition.
TARGET_LABELS = frozenset({"instance", "job"})
INSTANCE = ("instance", "=~", "$instance")
# Grafana's own variables; in a range they stand for a duration.
BUILTIN = frozenset({"__rate_interval", "__interval", "__range"})
GRID_WIDTH = 24  # Grafana's grid is 24 columns wide


def test_the_reader_reads_metrics_selectors_and_grouping() -> None:
    query = read(
        'histogram_quantile(0.9, sum by (le, route) (rate(a_bucket{x="1", y=~"$v"}[$__rate_interval])))'
        " / ignoring(z) group_left(w) b offset 5m > bool 1"
    )
    assert query == Query(
        ("a_bucket", "b"), (("a_bucket", "x", "=", "1"), ("a_bucket", "y", "=~", "$v")), ("le", "route", "z", "w")
    )
    assert read("sum(rate(c[1m])) by (q)").grouping == ("q",)
    for unreadable in ['{__name__="a"}', "a # a comment", "rate(a[1m]) $x"]:
        with pytest.raises(ValueError, match=r"cannot read|without a metric name"):
            read(unreadable)


# -- the dashboard's queries --------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


@attrs.frozen
class Target:
    """One query of the dashboard: where it is (for messages), its PromQL and its legend."""

    where: str
    expr: str
    legend: str = ""


def targets(board: dict[str, Any]) -> Iterator[Target]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield Target(f"panel {panel['title']!r} {target['refId']}", target["expr"], target.get("legendFormat", ""))


LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*(\w+)\s*\)")


def variable_queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable, metric, label) of each ``label_values(metric, label)`` variable."""
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = LABEL_VALUES.fullmatch(query)
        assert match is not None, f"variable {variable['name']}: not label_values(metric, label): {query!r}"
        yield variable["name"], match.group(1), match.group(2)


@attrs.frozen
class Exported:
    """A scrape: each sample name's labels with the values seen; the families, named as the parser names them."""

    labels: dict[str, dict[str, set[str]]]
    families: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Exported:
        labels: dict[str, dict[str, set[str]]] = {}
        families = {}
        for family in text_string_to_metric_families(text):
            families[family.name] = family.type
            for sample in family.samples:
                seen = labels.setdefault(sample.name, defaultdict(set))
                for label, value in sample.labels.items():
                    seen[label].add(value)
        return cls(labels, families)

    def label_names(self, metric: str) -> set[str]:
        return set(self.labels.get(metric, {})) | TARGET_LABELS

    def missing(self, metric: str) -> str | None:
        """Why ``metric`` (a sample's name: ``_total``, ``_bucket``... included) is no series of the scrape."""
        if metric in self.labels:
            return None
        family = re.sub(r"_(total|bucket|sum|count)$", "", metric)
        if family in self.families:
            return (
                f"{metric}: onebitd's family {family} had no such sample in the scrape (make a request that fills it)"
            )
        return f"{metric}: no metric onebitd exports"


def problems(board: dict[str, Any], exported: Exported) -> list[str]:
    """Every metric, label and label value the dashboard's queries and legends name that the scrape lacks."""
    found = []
    for target in targets(board):
        query = read(target.expr)
        if not query.metrics:
            found.append(f"{target.where}: reads no metric")
        found += [f"{target.where}: {why}" for m in query.metrics if (why := exported.missing(m))]
        for metric, label, op, value in query.matchers:
            if label not in exported.label_names(metric):
                found.append(f"{target.where}: {metric} has no label {label}")
            elif label not in TARGET_LABELS and op in ("=", "!=") and value not in exported.labels[metric][label]:
                found.append(f"{target.where}: {metric}'s {label} is never {value!r}")
        selectors = {(m, label, op, value) for m, label, op, value in query.matchers}
        found += [
            f'{target.where}: {m} without {{instance=~"$instance"}}'
            for m in query.metrics
            if (m, *INSTANCE) not in selectors
        ]
        known = set().union(*(exported.label_names(m) for m in query.metrics))
        found += [
            f"{target.where}: groups by {label}, which none of its metrics has"
            for label in query.grouping
            if label not in known
        ]
        legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", target.legend)
        found += [
            f"{target.where}: its legend names {label}, which none of its metrics has"
            for label in legend
            if label not in known
        ]
    for name, metric, label in variable_queries(board):
        found += [f"variable {name}: {why}" for why in [exported.missing(metric)] if why]
        if label not in exported.label_names(metric):
            found.append(f"variable {name}: {metric} has no label {label}")
    return found


def unread(board: dict[str, Any], exported: Exported) -> list[str]:
    """onebitd's families that no query reads (a metric added to metrics.py wants a panel)."""
    read_names = {m for target in targets(board) for m in read(target.expr).metrics}
    return sorted(
        family
        for family in exported.families
        if family.startswith("onebit_")
        and not any(re.sub(r"_(total|bucket|sum|count)$", "", m) == family for m in read_names)
    )


# -- against a real scrape ----------------------------------------------------------------------------


def two_models_one_provider(runtime: Path) -> configuration.Config:
    """Models a (the default, loaded at start) and b (loaded by its first request); a's prompts of
    four tokens or more go to the fake worker provider npu0 on the file route."""
    data = configuration.unstructure(several(runtime, ["a", "b"]))
    data["model"][0]["providers"] = ["npu0"]
    data["model"][1]["providers"] = []
    command = [sys.executable, str(fake_provider.PATH), "--worker"]
    worker = {"kind": "worker", "name": "npu0", "command": command, "fidelity_check": False}
    return make_config(
        runtime,
        decoder=data["decoder"],
        model=data["model"],
        hybrid={"enabled": True, "mode": "file", "min_prompt_tokens": 4, **HANDOFF_ALWAYS},
        cache={"enabled": True},
        provider=[worker],
    )


async def scrape(runtime: Path, route_lines: RouteLines) -> str:
    with trio.fail_after(TIMEOUT):
        async with (
            run_daemon(two_models_one_provider(runtime)) as running,
            client_for(running, timeout=TIMEOUT) as client,
        ):
            await ready(running, "worker")  # a, the default model's provider
            for model in ("a", "b"):
                reply = await client.post("/completion", json={"model": model, "prompt": PROMPT, "n_predict": 2})
                assert reply.status_code == 200, reply.text
            lines = await route_lines.until(2)
            assert [(line["model"], line["route"]) for line in lines] == [("a", "file"), ("b", "plain")]
            assert lines[1]["load_ms"] is not None  # b waited for its load
            scraped = await client.get("/metrics")
    assert scraped.status_code == 200
    return scraped.text


def misspelt(board: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """The dashboard with the first query holding ``old`` holding ``new`` instead (``old`` in its legend too)."""
    copy: dict[str, Any] = json.loads(json.dumps(board))
    for panel in copy["panels"]:
        for target in panel.get("targets", []):
            if old in target["expr"] or old in target.get("legendFormat", ""):
                target["expr"] = target["expr"].replace(old, new, 1)
                target["legendFormat"] = target.get("legendFormat", "").replace(old, new, 1)
                return copy
    raise AssertionError(f"no query holds {old!r}")


async def test_every_query_reads_only_what_a_real_scrape_of_onebitd_exports(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    exported = Exported.parse(await scrape(short_dir, route_lines))
    board = dashboard()
    found = problems(board, exported)
    assert not found, "\n".join(["the dashboard reads what onebitd does not export:", *found])
    missed = unread(board, exported)
    assert not missed, f"onebitd's families no panel reads (add one to docs/grafana/onebit.json): {missed}"
    # The check can fail: a misspelt metric, selector label, grouping label, legend label, value.
    for old, new, word in [
        ("onebit_requests_total", "onebit_request_total", "onebit_request_total: no metric"),
        ('fallback!="-"', 'fallbak!="-"', "no label fallbak"),
        ("by (le, route)", "by (le, rute)", "groups by rute"),
        ("{{outcome}}", "{{outcom}}", "legend names outcom"),
        ('state="loaded"', 'state="load"', "never 'load'"),
        ('fallback!="-"', 'fallback!="none"', "never 'none'"),
        ("_seconds_bucket", "_seconds_buckets", "_seconds_buckets: no metric"),
        ('{instance=~"$instance"}', "", 'without {instance=~"$instance"}'),
    ]:
        found = problems(misspelt(board, old, new), exported)
        assert any(word in problem for problem in found), (old, new, found)


def test_a_family_without_a_sample_is_told_apart_from_an_unknown_name() -> None:
    exported = Exported.parse("# HELP onebit_x_total What.\n# TYPE onebit_x_total counter\n")
    assert "family onebit_x had no such sample" in (exported.missing("onebit_x_total") or "")
    assert "no metric onebitd exports" in (exported.missing("onebit_y_total") or "")


# -- importable as it is ------------------------------------------------------------------------------


def overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
    )


def test_the_dashboard_is_one_grafana_imports_as_it_is() -> None:
    board = dashboard()
    assert (board["title"], board["uid"]) == ("onebit", "onebit")
    assert 36 <= board["schemaVersion"] <= 41
    assert board["id"] is None  # Grafana gives it one on import
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["DS_PROMETHEUS"]["type"], variables["DS_PROMETHEUS"]["query"]) == ("datasource", "prometheus")
    assert variables["instance"]["datasource"] == DATASOURCE
    required = {r["id"] for r in board["__requires"] if r["type"] == "panel"}
    ids: set[int] = set()
    grids: list[dict[str, int]] = []
    for panel in board["panels"]:
        where = f"panel {panel.get('title')!r}"
        assert isinstance(panel["id"], int), where
        assert panel["id"] not in ids, where
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, where
        assert all(isinstance(v, int) for v in grid.values()), where
        assert grid["x"] >= 0, where
        assert min(grid["w"], grid["h"]) >= 1, where
        assert grid["x"] + grid["w"] <= GRID_WIDTH, where
        assert not any(overlaps(grid, other) for other in grids), f"{where} overlaps another"
        grids.append(grid)
        if panel["type"] == "row":
            assert "targets" not in panel, where
            assert (panel["collapsed"], panel["panels"]) == (False, []), where  # its panels follow it
            continue
        assert panel["type"] in required, where
        assert panel["datasource"] == DATASOURCE, where
        assert panel["targets"], where
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), where
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, where
            assert target["expr"].strip(), where
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= BUILTIN | set(variables), f"{where}: {used - BUILTIN - set(variables)} undefined"
    titles = [panel["title"] for panel in board["panels"] if panel["type"] == "row"]
    assert titles == ["Now", "Requests and routes", "Latency", "Providers", "Prefix store", "Models", "Children"]


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.geteuid() == 0:
            pytest.fail("no promtool: run scripts/setup (it installs Debian's prometheus package as root)")
        pytest.skip("no promtool, and not root to install it: sudo apt-get install prometheus")
    board = dashboard()
    rules = []
    for n, target in enumerate(targets(board)):
        expr = re.sub(r"\$\{?(" + "|".join(BUILTIN) + r")\}?", "5m", target.expr)
        rules.append({"record": f"onebit:query_{n}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
