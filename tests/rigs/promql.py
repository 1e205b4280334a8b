"""A small reader of PromQL, for tests/unit/observe/test_grafana.py: which metric names and label names an
expression uses (in selectors, in ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``),
without evaluating it.  It knows the expressions a dashboard writes; anything else it cannot place is
an error rather than a guess, and ``promtool check rules`` parses the same expressions beside it.
"""

from __future__ import annotations

import re

import attrs

TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<range>\[[^\]]*\])
    |(?P<number>\d[\w.]*)
    |(?P<name>[A-Za-z_:][\w:]*)
    |(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}@])""",
    re.VERBOSE,
)
AGGREGATORS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"}) | GROUPING
MATCH = frozenset({"=", "!=", "=~", "!~"})


@attrs.frozen
class Query:
    """What one PromQL expression reads: metric names, each selector's matchers (metric, label, op,
    value), and the labels its grouping clauses name."""

    metrics: tuple[str, ...]
    matchers: tuple[tuple[str, str, str, str], ...]
    grouping: tuple[str, ...]


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of each token but spaces; anything this reader does not know is an error."""
    found, at = [], 0
    while at < len(expr):
        match = TOKEN.match(expr, at)
        if match is None:
            raise ValueError(f"cannot read {expr[at:]!r} in {expr!r}")
        assert match.lastgroup is not None
        if match.lastgroup != "space":
            found.append((match.lastgroup, match.group()))
        at = match.end()
    return found


def read(expr: str) -> Query:
    """The metric names and labels ``expr`` uses."""
    toks = tokens(expr)
    metrics: list[str] = []
    matchers: list[tuple[str, str, str, str]] = []
    grouping: list[str] = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        following = toks[i + 1][1] if i + 1 < len(toks) else ""
        i += 1
        if kind != "name":
            if text == "{":
                raise ValueError(f"a selector without a metric name in {expr!r}")
            continue
        if text in GROUPING and following == "(":
            end = next(j for j in range(i, len(toks)) if toks[j][1] == ")")
            grouping += [t for k, t in toks[i + 1 : end] if k == "name"]
            i = end + 1
        elif following == "(" or text in AGGREGATORS or text.lower() in KEYWORDS:
            continue  # a function, an aggregation, an operator
        else:
            metrics.append(text)
            if following == "{":
                end = next(j for j in range(i, len(toks)) if toks[j][1] == "}")
                inside = toks[i + 1 : end]
                for j in range(0, len(inside), 4):
                    (_, label), (_, op), (_, value) = inside[j : j + 3]
                    assert op in MATCH, f"not a matcher: {label} {op} {value} in {expr!r}"
                    matchers.append((text, label, op, value[1:-1]))
                i = end + 1
    return Query(tuple(metrics), tuple(matchers), tuple(grouping))
