"""Figures a test measured (section -> name -> value), printed in the summary of the run
(tests/conftest.py's pytest_terminal_summary)."""

from __future__ import annotations

FIGURES: dict[str, dict[str, str]] = {}
