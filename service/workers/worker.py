"""One worker process of `qkv serve --workers N`: a whole server (service/server.py) on the shared ports, its
control channel's end, and what the supervisor asks of it there.

Forked by the supervisor at the server's start (service/workers/fork.py), or started as `python -m
service.workers.worker`, its `WorkerSpec` pickled in the environment (QKV_WORKER_SPEC). It pins itself to its
share of the cores before any thread starts (service/workers/plan.py), so that onnxruntime's sessions, created
here and never forked, size themselves to that share.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import gc
import logging
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import ServerSettings
from service.errors import ConfigError, ServingError
from service.models import runtime
from service.observability import logs
from service.priority import spread_lone_runs, usable_cores
from service.repository.layout import RepositoryError
from service.scheduling.loop_idle import new_event_loop
from service.server import SWITCH_INTERVAL_S, Server
from service.serving.memory import one_malloc_arena, return_freed_memory
from service.workers import channel
from service.workers.identity import WorkerIdentity
from service.workers.routing import WorkerLink, WorkerPlane, WorkerRegions
from service.workers.statistics import counts

__all__ = ["SPEC_VARIABLE", "WorkerSpec", "main", "run", "socket_path"]

SPEC_VARIABLE = "QKV_WORKER_SPEC"
PR_SET_PDEATHSIG = 1

log = logging.getLogger("qkv.workers")


@dataclass(frozen=True)
class WorkerSpec:
    settings: ServerSettings  # the ports are the shared ones; the metrics port is the worker's own, on loopback
    index: int
    count: int
    directory: Path  # the control channel's sockets (mode 0700)
    cores: tuple[int, ...]  # this worker's share (empty: left as it is)
    regions: tuple[tuple[Any, ...], ...] = ()  # the shared memory registrations in force (a restarted worker)
    supervisor: int = 0  # its pid

    def encode(self) -> str:
        return base64.b64encode(pickle.dumps(self)).decode()


def socket_path(directory: Path, index: int | None) -> Path:
    """The control socket of worker `index`, or the supervisor's (None)."""
    return directory / ("supervisor.sock" if index is None else f"worker-{index}.sock")


async def _control(server: Server, plane: WorkerPlane, message: tuple[Any, ...]) -> Any:
    """What the supervisor (or, for a sequence's request, another worker) asks of this one."""
    operation, args = message[0], message[1:]
    if operation == "info":
        return {"pid": os.getpid(), "metrics_port": server.metrics_port}
    if operation == "models":
        return server.registry.ready_names()
    if operation == "load":
        return await plane.apply_load(*args)
    if operation == "unload":
        return await plane.apply_unload(*args)
    if operation == "regions":
        name, values = args
        return getattr(server.shared_memory, name)(*values) if name in ("register", "unregister") else None
    if operation == "infer":
        return await plane.apply_infer(*args)
    if operation == "statistics":
        return counts(plane.own_statistics(*args))
    raise ValueError(f"unknown control request {operation!r}")


async def _work(spec: WorkerSpec) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = Server(spec.settings, True, WorkerPlane, WorkerRegions, [WorkerIdentity(spec.index)])
    link = WorkerLink(
        spec.index,
        spec.count,
        channel.Peer(socket_path(spec.directory, None), "the supervisor"),
        [channel.Peer(socket_path(spec.directory, i), f"worker {i}") for i in range(spec.count)],
    )
    assert isinstance(server.plane, WorkerPlane) and isinstance(server.shared_memory, WorkerRegions)
    server.plane.link = server.shared_memory.link = link
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for region in spec.regions:  # registered on the other workers before this one started
        try:
            server.shared_memory.register(*region)
        except ServingError as e:
            log.warning("worker %d: shared memory region %s not registered again: %s", spec.index, region[0], e)
    try:
        await server.start()
    except BaseException:
        await server.drain()
        raise
    path = socket_path(spec.directory, spec.index)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # the last one's, when this worker replaces one that died
    control = await channel.serve(path, lambda message: _control(server, server.plane, message))  # type: ignore[arg-type]
    gc.collect()
    gc.freeze()  # as a single server does (service/server.py)
    return_freed_memory()  # what building and warming up the sessions freed
    log.info("worker %d (pid %d) serving", spec.index, os.getpid())
    await stop.wait()
    await server.drain()
    control.close()
    for peer in [link.supervisor, *link.workers]:
        peer.close()
    return 0


def _exit_with_supervisor(supervisor: int) -> bool:
    """SIGTERM to this worker when the supervisor dies (Linux's PR_SET_PDEATHSIG), so that no worker outlives
    it and holds the ports; False when it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return not supervisor or os.getppid() == supervisor


def run(spec: WorkerSpec) -> int:
    """The worker's life, from its start (spawned, or forked by the supervisor) to its exit status."""
    if not _exit_with_supervisor(spec.supervisor):
        return 0
    if spec.cores and hasattr(os, "sched_setaffinity"):
        spread_lone_runs(usable_cores())  # a request alone on an idle server may still use every core
        os.sched_setaffinity(0, spec.cores)  # before any thread: every thread started here inherits it
    one_malloc_arena()
    runtime.use_cpu_arena(spec.settings.worker_cpu_arena)  # before any session
    logs.configure(spec.settings.log_level, spec.settings.access_log)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(_work(spec))
    except (RepositoryError, ConfigError) as e:
        print(f"qkv serve: worker {spec.index}: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2


def main() -> int:
    """A spawned worker (`python -m service.workers.worker`): its spec is in the environment."""
    return run(pickle.loads(base64.b64decode(os.environ.pop(SPEC_VARIABLE))))


if __name__ == "__main__":
    sys.exit(main())
