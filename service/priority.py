"""Compute threads run at a lower CPU priority than the event loop.

On a machine with no idle core the event loop is what answers health checks, refuses what
cannot be served in time and hands results back; if it takes turns with the compute threads,
a refusal takes as long as the work it protects against. Linux applies nice per thread (a
thread's id works as a pid) and a thread inherits it from the thread that starts it, so
onnxruntime's own pool threads, started while a session loads, follow their loader.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["configure", "lower_this_thread", "run_lowered"]

_nice = 0
T = TypeVar("T")


def configure(nice: int) -> None:
    """How much lower (0..19) compute threads run than the thread that serves gRPC."""
    global _nice
    _nice = max(0, min(19, nice))


def lower_this_thread() -> None:
    """Called first thing in every compute thread (and around session loading)."""
    if _nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):  # a platform without per-thread nice: same priority
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _nice))


def run_lowered(fn: Callable[[], T]) -> T:
    """`fn()` in a new thread at compute priority: threads it starts (onnxruntime's) inherit it."""
    box: list[Any] = []

    def target() -> None:
        lower_this_thread()
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller's thread
            box.append((False, e))

    t = threading.Thread(target=target, name="qkv-load")
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
