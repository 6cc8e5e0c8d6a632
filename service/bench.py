"""`qkv bench`: load test against a server (filled in by the batching work)."""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str]) -> int:
    raise SystemExit("qkv bench: not built yet")
