"""Compute threads run at a lower CPU priority than the event loop, each on its own core.

On a machine with no idle core the event loop is what answers health checks, refuses what
cannot be served in time and hands results back; if it takes turns with the compute threads,
a refusal takes as long as the work it protects against. Linux applies nice per thread (a
thread's id works as a pid) and a thread inherits it from the thread that starts it, so
onnxruntime's own pool threads, started while a session loads, follow their loader.

Niced threads are also spread over the cores by hand: the kernel balances cores by the weight
of what runs on them, and a niced thread weighs a fraction of the event loop (a tenth at nice 10,
a seventieth at 19), so it packed both instances of a model onto one core and left a quarter of
the other idle (g2p, two instances, c64, nice 10: 0.26-0.28 of a core idle and 963-1,072 words/s;
pinned, 0.07-0.09 idle and 1,194-1,390).
Not under a CPU quota smaller than the cores the process may use (a container limited to 2 CPUs
on a 64-core node): every such container would pin its compute onto the same first cores.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["configure", "cpu_quota", "dedicated_cores", "lower_this_thread", "reserve", "run_lowered"]

_nice = 0
_cores: list[int] = []  # the cores this process may use, for spreading compute threads
_slots = 0  # compute slots handed out so far (see `reserve`)
T = TypeVar("T")


def configure(nice: int) -> None:
    """How much lower (0..19) compute threads run than the thread that serves gRPC."""
    global _nice, _cores
    _nice = max(0, min(19, nice))
    _cores = dedicated_cores()


def reserve(instances: int) -> int:
    """The first of `instances` consecutive slots for one model's compute threads: slots, and so
    cores, continue across models, so that two one-instance models do not share a core."""
    global _slots
    first, _slots = _slots, _slots + instances
    return first


def dedicated_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> list[int]:
    """The cores this process may use, if it may use them all: [] under a smaller CPU quota."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    quota = cpu_quota(cgroup)
    return [] if quota is not None and quota < len(cores) else cores


def cpu_quota(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (v2 cpu.max, or v1 cfs quota / period); None when unlimited or unknown."""
    try:
        if (cgroup / "cpu.max").exists():
            quota, period = (cgroup / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us < 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def lower_this_thread(slot: int | None = None) -> None:
    """Called first thing in every compute thread (and around session loading, with no slot).

    `slot` (from `reserve`, plus the instance's number) also keeps a niced thread on core `slot` of
    those allowed, round robin, so that a model's instances run on different cores.
    """
    if not _nice:
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):  # no per-thread nice or affinity: left as it is
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _nice))
    if slot is not None and len(_cores) > 1:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(tid, {_cores[slot % len(_cores)]})


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
