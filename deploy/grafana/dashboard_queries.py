"""The PromQL of a Grafana dashboard, made runnable against a plain Prometheus.

``queries(path)`` returns ``(panel title, expr)`` for every target of every panel (rows'
nested panels included), with the dashboard's template variables replaced by values that
match everything (a multi/All variable becomes its ``allValue``, ``.*`` by default) and
Grafana's macros by fixed durations (``$__rate_interval`` -> ``1m`` ...). An unknown
``$variable`` raises ``ValueError``, so a typo cannot slip through as literal text.

    python deploy/grafana/dashboard_queries.py [deploy/grafana/dashboards/qkv.json]

prints one ``title<TAB>expr`` line per query.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DASHBOARD", "MACROS", "queries", "substitute"]

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "qkv.json"

#: Grafana's built-in macros, as fixed values a plain Prometheus query can use.
MACROS: Mapping[str, str] = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}

# $name, ${name}, ${name:format} and the deprecated [[name]] (not $1: regex references).
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::[^}]*)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])  # collapsed rows nest their panels


def _variable_values(dashboard: Mapping[str, Any]) -> dict[str, str]:
    values: dict[str, str] = {}
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") in {"query", "custom", "textbox", "constant", "interval"}:
            if var.get("includeAll") or var.get("multi"):
                values[var["name"]] = var.get("allValue") or ".*"
            else:
                current = (var.get("current") or {}).get("value")
                values[var["name"]] = current if isinstance(current, str) and current else ".*"
    return values


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace the variables and macros of one expression; ValueError on an unknown one."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in MACROS:
            return MACROS[name]
        if name in variables:
            return variables[name]
        raise ValueError(f"unknown dashboard variable ${name} in {expr!r}")

    return _VARIABLE.sub(repl, expr)


def queries(path: str | Path = DEFAULT_DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus target, ready to send to Prometheus."""
    dashboard = json.loads(Path(path).read_text(encoding="utf-8"))
    variables = _variable_values(dashboard)
    out: list[tuple[str, str]] = []
    for panel in _panels(dashboard.get("panels") or []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                out.append((panel.get("title", "?"), substitute(target["expr"], variables)))
    return out


if __name__ == "__main__":
    for title, expr in queries(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DASHBOARD):
        print(f"{title}\t{expr}")
