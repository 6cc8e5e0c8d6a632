"""The supervisor of `qkv serve --workers N`: it holds the ports, starts the workers, keeps the global state's
record, restarts a worker that dies, and drains them all on SIGTERM.

- Ports: it binds the gRPC and HTTP ports first, with SO_REUSEPORT and without listening (so port 0 is
  chosen once, and the port stays the server's while a worker restarts); each worker binds the same ports
  the same way and listens, and the kernel spreads connections over the workers.
- Global state: a worker's model load or unload, and its shared memory registrations, come here over the
  control channel (service/workers/channel.py); a load or unload is applied on every worker, a region's change
  on every other, and answered once all have (the first error names its worker). What was changed is kept,
  and replayed to a worker that replaces one that died.
- Start: the workers are forked at the start, before any thread or event loop, so that what they import is
  shared (fork.py); a worker started again is spawned.
- Metrics: the metrics port is the supervisor's: every worker's metrics, combined (metrics_view.py).
- A worker that dies is started again (after RESTART_DELAY_S, doubling up to RESTART_DELAY_MAX_S while it keeps
  dying within its first minute); the requests it had in flight fail on their connections (UNAVAILABLE), the
  other workers go on serving. SIGTERM or SIGINT: each worker drains (--grace-period), then the supervisor
  exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from service import __version__
from service.config import ServerSettings, check
from service.errors import ConfigError, NotFound, ServingError
from service.observability import logs
from service.observability.metrics_http import MetricsServer
from service.workers import channel, fork, plan
from service.workers.metrics_view import WorkerMetrics
from service.workers.worker import SPEC_VARIABLE, WorkerSpec, socket_path

__all__ = ["Supervisor", "supervise"]

log = logging.getLogger("qkv.workers")

READY_TIMEOUT_S = 600.0  # a worker's start: its models loaded and warmed up
POLL_S = 0.1
RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 30.0
STABLE_S = 60.0  # a worker that lived this long restarts without delay


def _reserve(host: str, port: int, flag: str) -> socket.socket:
    """The port bound (SO_REUSEPORT, not listening): the workers bind it too. It is first bound without
    SO_REUSEPORT, so that a port another process holds (even one that shares it, as another supervisor's)
    stops the start rather than splitting its traffic with it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe, sock = socket.socket(family, socket.SOCK_STREAM), socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a last run's connections in TIME_WAIT do not count
    try:
        with probe:
            probe.bind((host, port))
            port = probe.getsockname()[1]  # port 0: the one chosen
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(flag, f"cannot bind the port {host}:{port} ({flag}): {e.strerror}") from None
    return sock


@dataclasses.dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | fork.Forked | None = None
    peer: channel.Peer | None = None
    metrics_port: int = 0
    started: float = 0.0
    delay: float = RESTART_DELAY_S
    ready: bool = False


MAX_UNIX_PATH = 107  # AF_UNIX's sun_path: 108 bytes, the terminating NUL aside
SOCKET_NAME_ROOM = 24  # a control socket's name under the directory ("worker-255.sock") and a slash, with room


def control_directory() -> Path:
    """The control sockets' directory, of mode 0700 (the server's user only): under TMPDIR, or under /tmp
    where TMPDIR is too deep for a socket's path."""
    directory = Path(tempfile.mkdtemp(prefix="qkv-workers-"))
    if len(os.fsencode(directory)) + SOCKET_NAME_ROOM > MAX_UNIX_PATH:
        directory.rmdir()
        directory = Path(tempfile.mkdtemp(prefix="qkv-workers-", dir="/tmp"))
    return directory


class Supervisor:
    def __init__(self, settings: ServerSettings, count: int) -> None:
        self.settings, self.count = settings, count
        self.directory = control_directory()
        self.workers = [_Worker(i) for i in range(count)]
        # What was changed since the start, numbered: each model's last change (name -> (number, "load",
        # parameters) or (number, "unload")), every region change, and the registrations still in force.
        self.changes = 0
        self.models: dict[str, tuple[Any, ...]] = {}
        self.region_log: list[tuple[int, str, tuple[Any, ...]]] = []
        self.regions: list[tuple[Any, ...]] = []
        self.stopping = False
        self._sockets: list[socket.socket] = []
        self.grpc_port = self.http_port = self.metrics_port = 0
        self._view = WorkerMetrics(lambda: [w.metrics_port for w in self.workers if w.ready and w.metrics_port])

    # --- start --------------------------------------------------------------------------------------

    def _bind(self) -> None:
        s = self.settings
        grpc_socket = _reserve(s.host, s.grpc_port, "--grpc-port")
        self._sockets.append(grpc_socket)
        self.grpc_port = grpc_socket.getsockname()[1]
        if s.http_port >= 0:
            http_socket = _reserve(s.host, s.http_port, "--http-port")
            self._sockets.append(http_socket)
            self.http_port = http_socket.getsockname()[1]

    def _spec(self, index: int, models: tuple[str, ...] | None, regions: tuple[Any, ...]) -> WorkerSpec:
        s = self.settings
        if models is not None and s.model_control_mode == "explicit":
            s = dataclasses.replace(s, load_model=models)  # what the others serve now
        settings = dataclasses.replace(
            s,
            grpc_port=self.grpc_port,
            http_port=self.http_port if s.http_port >= 0 else -1,
            metrics_host="127.0.0.1",  # each worker's own, scraped by the supervisor
            metrics_port=0 if s.metrics_port >= 0 else -1,
        )
        cores = plan.pinned(index, self.count)
        return WorkerSpec(settings, index, self.count, self.directory, tuple(cores), regions, os.getpid())

    def fork_workers(self) -> None:
        """Bind the ports and fork every worker, before any thread or event loop (fork.py); where this process
        cannot fork safely, `run` spawns them."""
        self._bind()
        fork.preload()
        if not fork.single_threaded():
            log.info("the supervisor runs threads: workers are spawned, not forked")
            return
        for worker in self.workers:
            worker.process = fork.fork(self._spec(worker.index, None, ()), self._sockets)
            self._started(worker)

    def _spawn(self, worker: _Worker, models: tuple[str, ...] | None = None, regions: tuple[Any, ...] = ()) -> None:
        env = {**os.environ, SPEC_VARIABLE: self._spec(worker.index, models, regions).encode()}
        worker.process = subprocess.Popen([sys.executable, "-m", "service.workers.worker"], env=env)
        self._started(worker)

    def _started(self, worker: _Worker) -> None:
        worker.started, worker.ready, worker.metrics_port = time.monotonic(), False, 0
        worker.peer = channel.Peer(socket_path(self.directory, worker.index), f"worker {worker.index}")

    async def _until_ready(self, worker: _Worker) -> bool:
        """Wait for the worker to answer on its channel; False when it exits first."""
        assert worker.process is not None and worker.peer is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping:
            if worker.process.poll() is not None:
                return False
            with contextlib.suppress(channel.ChannelError):
                info = await worker.peer.call(("info",), timeout=5.0)
                worker.metrics_port, worker.ready = info["metrics_port"], True
                return True
            await asyncio.sleep(POLL_S)
        return False

    # --- the global state ---------------------------------------------------------------------------

    async def _control(self, message: tuple[Any, ...]) -> Any:
        operation, origin = message[0], message[1]
        if operation == "load":
            name, parameters = message[2], message[3]
            await self._everywhere(("load", name, parameters), lambda: self._record_model(name, "load", parameters))
        elif operation == "unload":
            name = message[2]
            await self._everywhere(("unload", name), lambda: self._record_model(name, "unload"))
        elif operation == "regions":
            change, args = message[2], message[3]
            self._record_region(change, args)
            await self._everywhere(("regions", change, args), None, skip=origin, ignore=NotFound)
        else:
            raise ValueError(f"unknown control request {operation!r}")
        return None

    def _record_model(self, name: str, *change: Any) -> None:
        self.changes += 1
        self.models[name] = (self.changes, *change)

    def _record_region(self, change: str, args: tuple[Any, ...]) -> None:
        self.changes += 1
        self.region_log.append((self.changes, change, args))
        if change == "register":
            self.regions.append(args)
            return
        name, caller = args  # unregister: one region, or every one of the caller's
        self.regions = [a for a in self.regions if not (a[5] == caller and (not name or a[0] == name))]

    async def _everywhere(
        self,
        message: tuple[Any, ...],
        record: Any,
        skip: int | None = None,
        ignore: type[ServingError] | None = None,
    ) -> None:
        """`message` applied on every ready worker (but `skip`); `record()` once one has applied it; the
        first error (naming its worker, unless every worker
        failed alike). A worker not answering (restarting) is left out: the change is
        replayed to it when it is back."""
        workers = [w for w in self.workers if w.ready and w.peer is not None and w.index != skip]
        results = await asyncio.gather(*(w.peer.call(message) for w in workers if w.peer), return_exceptions=True)
        errors = [(w, r) for w, r in zip(workers, results, strict=True) if isinstance(r, ServingError)]
        if record is not None and len(errors) < len(workers):
            record()
        errors = [(w, e) for w, e in errors if ignore is None or not isinstance(e, ignore)]
        if errors:
            worker, error = errors[0]
            if len(errors) == len(workers) and len({e.message for _, e in errors}) == 1:
                raise error  # the request's own error, the same on every worker: answered as one server would
            raise type(error)(f"{error.message} (worker {worker.index})", error.retry_after_ms)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, (ServingError, channel.ChannelError)):
                raise result

    async def _ready_models(self) -> tuple[str, ...] | None:
        """The models a ready worker serves now (None: no worker answers)."""
        for worker in self.workers:
            if worker.ready and worker.peer is not None:
                with contextlib.suppress(ServingError, channel.ChannelError):
                    return tuple(await worker.peer.call(("models",)))
        return None

    async def _replay(self, worker: _Worker, since: int) -> None:
        """On a worker that replaces one that died, once it answers: the changes made after it was started
        (it started with the models then served and the regions then registered), and the loads that
        carried a config.json of their own."""
        assert worker.peer is not None
        for name, (number, *last) in list(self.models.items()):
            if number > since or (last[0] == "load" and last[1]):
                with contextlib.suppress(ServingError, channel.ChannelError):
                    await worker.peer.call((last[0], name, *last[1:]))
        for number, change, args in list(self.region_log):
            if number > since:
                with contextlib.suppress(ServingError, channel.ChannelError):
                    await worker.peer.call(("regions", change, args))

    # --- run ----------------------------------------------------------------------------------------

    async def _restart(self, worker: _Worker, code: int) -> None:
        lived = time.monotonic() - worker.started
        worker.delay = RESTART_DELAY_S if lived > STABLE_S else min(RESTART_DELAY_MAX_S, worker.delay * 2)
        log.warning("worker %d exited with %d after %.1f s: starting it again", worker.index, code, lived)
        await asyncio.sleep(worker.delay if lived <= STABLE_S else 0.0)
        if self.stopping:
            return
        since, models = self.changes, await self._ready_models()
        self._spawn(worker, models, tuple(self.regions))
        if await self._until_ready(worker):
            await self._replay(worker, since)

    async def run(self) -> int:
        s = self.settings
        if not self._sockets:
            self._bind()
        control = await channel.serve(socket_path(self.directory, None), self._control)
        metrics = None
        if s.metrics_port >= 0:
            registry = CollectorRegistry(auto_describe=False)  # the view is read at each scrape, never before
            registry.register(self._view)
            metrics = MetricsServer(registry, s.http_timeout, off_loop=True)  # a scrape waits on every worker's
            host = s.metrics_host or s.host
            try:
                self.metrics_port = metrics.bind(host, s.metrics_port)
            except OSError as e:
                where = f"{host}:{s.metrics_port}"
                raise ConfigError("--metrics-port", f"cannot bind the metrics port {where}: {e}") from None
            await metrics.start()
        stop = asyncio.Event()

        def signalled() -> None:
            self.stopping = True  # a start under way gives up
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled)
        for worker in self.workers:
            if worker.process is None:  # not forked (fork_workers)
                self._spawn(worker)
        started = await asyncio.gather(*(self._until_ready(w) for w in self.workers))
        if not all(started):
            failed = [w for w, ok in zip(self.workers, started, strict=True) if not ok]
            code = next((w.process.poll() for w in failed if w.process and w.process.poll()), None)
            log.error("worker %d did not start", failed[0].index)
            await self._stop()
            control.close()
            return 0 if stop.is_set() else code or 2
        http = f"{s.host}:{self.http_port}" if s.http_port >= 0 else "off"
        print(
            f"qkv {__version__} serving {self.count} workers on grpc {s.host}:{self.grpc_port} metrics "
            f"{s.metrics_host or s.host}:{self.metrics_port} http {http}",
            flush=True,
        )
        restarts: dict[int, asyncio.Task[None]] = {}  # worker index -> its restart under way
        while not stop.is_set():
            for worker in self.workers:
                process = worker.process
                if process is None or worker.index in restarts or (code := process.poll()) is None:
                    continue
                worker.ready = False  # dead, or died while starting again: started (again) after a delay
                task = asyncio.create_task(self._restart(worker, code))
                restarts[worker.index] = task
                task.add_done_callback(partial(_forget, restarts, worker.index))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
        log.info("signal received: draining %d workers (grace %.1f s)", self.count, s.grace_period)
        await self._stop()
        for task in list(restarts.values()):
            task.cancel()
        control.close()
        if metrics is not None:
            await metrics.stop()
        log.info("stopped")
        return 0

    async def _stop(self) -> None:
        """SIGTERM to every worker, and wait for them to drain (SIGKILL past the grace period and a margin)."""
        self.stopping = True
        processes = [w.process for w in self.workers if w.process is not None and w.process.poll() is None]
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.grace_period + 10.0
        for process in processes:
            try:
                await asyncio.to_thread(process.wait, max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
        for worker in self.workers:
            if worker.peer is not None:
                worker.peer.close()

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._view.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _forget(restarts: dict[int, asyncio.Task[None]], index: int, _: asyncio.Task[None]) -> None:
    restarts.pop(index, None)


def supervise(settings: ServerSettings, count: int) -> int:
    """`qkv serve --workers N` (N > 1): run the supervisor until SIGTERM; its exit status."""
    check(settings)  # once, here: a bad setting stops the start before any worker
    logs.configure(settings.log_level, settings.access_log)
    supervisor = Supervisor(settings, count)
    try:
        supervisor.fork_workers()
        return asyncio.run(supervisor.run())
    finally:
        supervisor.close()
