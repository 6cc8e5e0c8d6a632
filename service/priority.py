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

`ComputeThreads` holds one server's choice (its nice, its cores, the slots handed out so far): the server
owns one and hands it to the kinds it builds, so two servers in one process keep their own.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ComputeThreads", "cpu_budget", "cpu_quota", "dedicated_cores", "default_instances", "lone_cores",
    "spread_lone_runs", "spread_threads", "usable_cores",
]  # fmt: skip

T = TypeVar("T")


class ComputeThreads:
    """How one server runs its compute threads: `nice` (0..19) lower than the thread that serves gRPC, and,
    when niced, each on a core of its own among `cores` (default: those this process may use, when it may
    use them all)."""

    def __init__(self, nice: int = 0, cores: list[int] | None = None) -> None:
        self.nice = max(0, min(19, nice))
        self.cores = (dedicated_cores() if self.nice else []) if cores is None else list(cores)
        self._slots = 0  # compute slots handed out so far (see `reserve`)
        self._lock = threading.Lock()  # versions load on several threads at once

    @property
    def slots(self) -> int:
        """The compute slots handed out so far."""
        return self._slots

    def reserve(self, instances: int) -> int:
        """The first of `instances` consecutive slots for one model's compute threads: slots, and so
        cores, continue across models, so that two one-instance models do not share a core."""
        with self._lock:
            first, self._slots = self._slots, self._slots + instances
        return first

    def lower_this_thread(self, slot: int | None = None) -> None:
        """Called first thing in every compute thread (and around session loading, with no slot).

        `slot` (from `reserve`, plus the instance's number) also keeps a niced thread on core `slot` of
        those allowed, round robin, so that a model's instances run on different cores.
        """
        if not self.nice:
            return
        tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):  # no per-thread nice or affinity: left as it is
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
        if slot is not None and len(self.cores) > 1:
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setaffinity(tid, {self.cores[slot % len(self.cores)]})

    def run_lowered(self, fn: Callable[[], T]) -> T:
        """`fn()` in a new thread at compute priority: threads it starts (onnxruntime's) inherit it."""
        box: list[Any] = []

        def target() -> None:
            self.lower_this_thread()
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


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_budget(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its cores, or fewer under a cgroup CPU quota (a container limited to 2
    CPUs on a 64-core node: 2)."""
    cores, quota = len(usable_cores()), cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


_spread: list[int] = []  # the cores a lone run may spread over, where wider than this process's (a pinned worker's)


def spread_lone_runs(cores: list[int]) -> None:
    """Let a lone run's threads spread over `cores` (called by a worker of `--workers N` with the cores it had
    before it pinned itself to its share): a request alone on an idle server may use every core, as with
    one process, while the worker's batches stay on its share."""
    global _spread
    _spread = list(cores)


def lone_cores() -> list[int]:
    """The cores a lone run's threads may use: `spread_lone_runs`'s, else this process's."""
    return _spread or usable_cores()


@contextlib.contextmanager
def spread_threads() -> Iterator[None]:
    """The calling thread's affinity widened to `lone_cores()` while it starts threads that inherit it (a lone
    session's onnxruntime pool, made in the block), then narrowed back."""
    own, lone = usable_cores(), lone_cores()
    wider = set(lone) - set(own) and hasattr(os, "sched_setaffinity")
    if wider:
        os.sched_setaffinity(0, lone)
    try:
        yield
    finally:
        if wider:
            os.sched_setaffinity(0, own)


def default_instances(intra_op_threads: int, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """A model's onnxruntime sessions when its config names none: two (two sessions of one thread beat one of
    two on CPU: one batch forms while the other runs), but no more sessions of `intra_op_threads` each than
    the CPUs this process may use hold. A worker of `--workers 2` pinned to one core runs one: a second
    would take turns with the first on that core and hold a second copy of the weights and arena."""
    return max(1, min(2, cpu_budget(cgroup) // max(1, intra_op_threads)))


def dedicated_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> list[int]:
    """The cores this process may use, if it may use them all: [] under a smaller CPU quota."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cores, quota = usable_cores(), cpu_quota(cgroup)
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
