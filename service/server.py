"""The server assembled and run: the data plane, its gRPC (and HTTP/REST) front ends, health, reflection,
metrics, drain.

The front ends (service/frontends/grpc_api.py, rest_api.py) decode, await the one data plane
(service/serving/dataplane.py) and encode. Models are loaded before the port opens; a model that fails
to load stops the start. Who may call it (TLS, bearer tokens) is service/frontends/security.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import __version__, protocol
from service.config import ServerSettings, check
from service.errors import ConfigError
from service.frontends import grpc_api, shared_memory
from service.frontends.orca import LoadReports
from service.frontends.security import BearerTokens, TokenAuth, bearer_tokens, server_credentials, ssl_context
from service.frontends.shared_memory_grpc import SharedMemoryService
from service.models.common import Result
from service.models.response_cache import ResponseCache
from service.observability import logs
from service.observability.metrics import CacheMetrics, Metrics
from service.priority import ComputeThreads
from service.repository.layout import RepositoryError
from service.scheduling.loop_idle import new_event_loop
from service.serving.dataplane import DataPlane
from service.serving.memory import one_malloc_arena, return_freed_memory

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import Tracing

__all__ = ["Server", "serve"]

log = logging.getLogger("qkv.server")

HEALTH_SERVICE = "grpc.health.v1.Health"
# After a large or refused request, once its message is freed, the heap's free pages go back to the
# system: a parsed message of millions of small fields leaves its memory scattered through the heap,
# which glibc would otherwise keep. When the message is freed is not seen (the transport holds it until the
# call is done, later on a busy machine), so the hand-back is repeated at growing delays: TRIM_DELAY_S after
# the request, then TRIM_BACKOFF times longer each time, TRIM_TIMES in all; at most once a TRIM_INTERVAL_S.
TRIM_DELAY_S = 0.2
TRIM_INTERVAL_S = 1.0
TRIM_BACKOFF = 4.0
TRIM_TIMES = 4  # the last some 13 s after the request
SWITCH_INTERVAL_S = 0.0005
QUIET_SECONDS = 0.3  # drain: no new request for this long before the transport stops
CLOSE_FLOOR_S = 1.0  # drain: what versions get to stop their threads, even when the grace period is spent


def _tracing(settings: ServerSettings) -> Tracing | None:
    """The tracer, when requests are traced; opentelemetry is imported only then."""
    if not settings.traced:
        return None
    from service.observability.tracing import Tracing

    ratio = settings.trace_sample_ratio if settings.trace_sample_ratio >= 0 else None
    return Tracing(ratio, settings.tracing_exporter, settings.tracing_file)


class Server:
    """Models + gRPC server + metrics endpoint, started and drained as one.

    All of a server's state hangs off this object (its models, metrics, compute threads, regions): several
    servers run in one process, each on its own ports. `reuse_port`: the gRPC and HTTP ports may be shared with
    other processes binding them the same way (SO_REUSEPORT: N workers behind one port); otherwise a port already
    taken fails the start rather than splitting its traffic with whoever holds it. `plane` and `regions`: the
    classes of the data plane and the shared memory regions, and `interceptors` more gRPC interceptors (a
    worker's: service/workers/).
    """

    def __init__(
        self,
        settings: ServerSettings,
        reuse_port: bool = False,
        plane: type[DataPlane] = DataPlane,
        regions: type[shared_memory.SharedMemoryRegistry] = shared_memory.SharedMemoryRegistry,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.settings, self.reuse_port = settings, reuse_port
        self._interceptors = list(interceptors)
        check(settings)  # every setting, then the TLS files and tokens: a bad one stops the start (ConfigError)
        self._credentials = server_credentials(settings)
        self._tokens = BearerTokens(
            bearer_tokens(settings.auth_token_file),
            bearer_tokens(settings.admin_token_file, "--admin-token-file"),
            settings.isolate_tokens,
            settings.token_share,
        )
        self.metrics = Metrics(enabled=settings.metrics)
        self.compute = ComputeThreads(settings.compute_nice)  # this server's compute threads: priority, cores
        self.tracing = _tracing(settings)
        self.cache: ResponseCache[Result] | None = None  # --cache-size 0: none
        if settings.cache_size > 0:
            self.cache = ResponseCache(settings.cache_size, CacheMetrics(self.metrics), settings.cache_across_tokens)
        self.plane = plane(  # a worker's (service/workers/) keeps global state global across workers
            settings,
            self.metrics,
            self.tracing,
            self.return_memory_later,
            self.cache,
            self._model_changed,
            self.compute,
        )
        self.registry = self.plane.registry
        self.shared_memory = regions(
            settings.shared_memory_max_regions,
            settings.shared_memory_max_bytes,
            settings.max_message_bytes,
            key_prefix=settings.shared_memory_key_prefix,
            unverified_peers=settings.shared_memory_unverified_peers,
        )
        self.health = health.aio.HealthServicer()
        self.grpc_port = 0
        self.metrics_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._trim: asyncio.Task[None] | None = None  # memory handed back soon, after a large request
        self._trimmed = 0.0  # monotonic time of the last hand-back
        self._trims_left, self._trim_delay = 0, TRIM_DELAY_S  # the hand-backs still due, and the next's delay
        self._http: Any = None  # service.frontends.rest_api.RestServer, when --http-port is not -1

    def _options(self) -> list[tuple[str, Any]]:
        s = self.settings
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_send_message_bytes),
            ("grpc.max_concurrent_streams", s.max_concurrent_streams),
            ("grpc.keepalive_time_ms", 60_000),  # find dead peers
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.max_connection_idle_ms", 600_000),
            ("grpc.so_reuseport", int(self.reuse_port)),
        ]
        if s.max_connection_age > 0:
            options += [
                ("grpc.max_connection_age_ms", int(s.max_connection_age * 1000)),
                ("grpc.max_connection_age_grace_ms", int(s.grace_period * 1000)),
            ]
        return options

    @property
    def draining(self) -> bool:
        return self.plane.draining

    async def _model_changed(self, name: str, ready: bool) -> None:
        if not self.draining:
            status = health_pb2.HealthCheckResponse
            await self.health.set(name, status.SERVING if ready else status.NOT_SERVING)
            if self.registry.started:  # the whole server's, as ServerReady answers (--strict-readiness)
                await self.health.set("", status.SERVING if self.plane.ready() else status.NOT_SERVING)

    async def start(self) -> None:
        """Ports bound, models loaded (a model that fails to load stops the start), then serving."""
        s = self.settings
        credentials = self._credentials
        interceptors = [TokenAuth(self._tokens)] if self._tokens else []
        interceptors += self._interceptors
        server = self._grpc = grpc.aio.server(options=self._options(), interceptors=interceptors)

        def bound() -> tuple[str, int]:  # the server's end of a connection: a peer's user is found by it
            return s.host, self.grpc_port

        server.add_generic_rpc_handlers(
            (
                grpc_api.generic_handler(
                    grpc_api.InferenceService(
                        self.plane, self.shared_memory, self._tokens, bound, s.max_send_message_bytes
                    )
                ),
            )
        )
        regions = SharedMemoryService(self.shared_memory, self._tokens, bound)
        server.add_generic_rpc_handlers((protocol.generic_handler(regions),))
        server.add_generic_rpc_handlers(
            (protocol.generic_handler(LoadReports(self.plane, self.metrics), protocol.ORCA_SERVICE),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [protocol.SERVICE_NAME, protocol.ORCA_SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME],
            server,
            pool=protocol.POOL,
        )
        address = f"{s.host}:{s.grpc_port}" if ":" not in s.host else f"[{s.host}]:{s.grpc_port}"
        try:
            self.grpc_port = (
                server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
            )
        except RuntimeError as e:  # grpc: "Failed to bind to address ..."
            raise ConfigError("--grpc-port", f"cannot bind the gRPC port {address}: {e}") from None
        if s.metrics_port >= 0:
            metrics_host = s.metrics_host or s.host
            try:
                self.metrics_port = self.metrics.serve(metrics_host, s.metrics_port, s.http_timeout)
            except OSError as e:
                where = f"{metrics_host}:{s.metrics_port}"
                raise ConfigError("--metrics-port", f"cannot bind the metrics port {where}: {e}") from None
        if s.http_port >= 0:
            from service.frontends.rest_api import RestServer  # aiohttp, only when HTTP is on

            self._http = RestServer(self.plane, self.metrics, s, self._tokens, ssl_context(s), self.shared_memory)
            self.http_port = self._http.bind(s.host, s.http_port, self.reuse_port)
        await self.registry.start()  # the ports are bound (one in use stops the start), not yet serving
        await server.start()
        if self._http is not None:
            await self._http.start()
        for name in self.registry.ready_names():
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        status = health_pb2.HealthCheckResponse
        await self.health.set("", status.SERVING if self.plane.ready() else status.NOT_SERVING)

    def return_memory_later(self) -> None:
        """The heap's free pages handed back to the system soon, and again at growing delays (once the
        request's message is gone); a later large request starts the delays over."""
        self._trims_left, self._trim_delay = TRIM_TIMES, TRIM_DELAY_S
        if self._trim is None:
            self._trim = asyncio.create_task(self._return_memory())

    async def _return_memory(self) -> None:
        try:
            while self._trims_left > 0:
                self._trims_left -= 1
                delay, self._trim_delay = self._trim_delay, self._trim_delay * TRIM_BACKOFF
                await asyncio.sleep(max(delay, self._trimmed + TRIM_INTERVAL_S - time.monotonic()))
                # A refused call's message can sit in a reference cycle (its frames, via the abort's
                # traceback) that only a collection frees; after gc.freeze a collection takes some 2 ms.
                gc.collect()
                await asyncio.to_thread(return_freed_memory)  # malloc_trim: ctypes lets go of the GIL
                self._trimmed = time.monotonic()
        finally:
            self._trim = None

    async def drain(self) -> None:
        """Stop taking work, let admitted requests finish (up to the grace period), stop."""
        plane = self.plane
        if plane.draining:
            return
        plane.draining = True
        await self.health.enter_graceful_shutdown()  # every service reports NOT_SERVING at once
        deadline = time.monotonic() + self.settings.grace_period
        await self._settle(deadline)
        if plane.active:
            log.warning("grace period over with %d requests still running", plane.active)
        if self._grpc is not None:
            await self._grpc.stop(max(0.0, deadline - time.monotonic()))
        if self._http is not None:
            await self._http.stop()
        await self.registry.close(max(CLOSE_FLOOR_S, deadline - time.monotonic()))
        self.shared_memory.close()
        if self._trim is not None:
            self._trim.cancel()
        if self.tracing is not None:  # export what is buffered, for tracing.SHUTDOWN_S at most
            await asyncio.to_thread(self.tracing.shutdown)

    async def _settle(self, deadline: float) -> None:
        """Until admitted work is answered (every version's in-flight leases given back) and clients have
        stopped sending for QUIET_SECONDS, or `deadline`: a call that arrives while the transport shuts
        down would be cancelled instead of answered UNAVAILABLE."""
        while (left := deadline - time.monotonic()) > 0:
            busy = [m.in_flight.idle() for m in self.registry.served() if m.in_flight.count]
            if busy:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*busy), left)
                continue
            quiet = self.plane.last_arrival + QUIET_SECONDS - time.monotonic()
            if quiet <= 0:
                return
            await asyncio.sleep(min(quiet, left))  # to the end of the quiet period, then look again

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


async def _serve(settings: ServerSettings) -> int:
    # Hand the GIL over sooner (default 5 ms): the event loop answers RPCs while decoding threads
    # run the Python parts of their steps.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = Server(settings)
    await server.start()
    # What start-up made (modules, descriptors, graphs' metadata) lives as long as the server. Frozen,
    # a full collection under load no longer walks it: 19-33 ms with every thread stopped, 2 ms after.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    models = ", ".join(
        f"{m.name} v{m.version} ({m.metadata.kind}, {m.metadata.provider})" for m in server.registry.served()
    )
    failed = server.registry.unavailable()
    if failed:  # --no-exit-on-error: the start went on without them (the log and the index say why)
        models += f"; UNAVAILABLE: {', '.join(failed)}"
    log.info("settings: %s", settings.summary())
    http = f"{settings.host}:{server.http_port}" if settings.http_port >= 0 else "off"
    print(
        f"qkv {__version__} serving {models or 'no models'} on grpc {settings.host}:{server.grpc_port} metrics "
        f"{settings.metrics_host or settings.host}:{server.metrics_port} http {http}",
        flush=True,
    )
    await stop.wait()
    log.info("signal received: draining (grace %.1f s)", settings.grace_period)
    await server.drain()
    log.info("stopped")
    return 0


def serve(settings: ServerSettings) -> int:
    one_malloc_arena()  # before any thread: memory an unloaded model frees goes back to the system
    logs.configure(settings.log_level, settings.access_log)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:  # its selector notes when it was idle
            return runner.run(_serve(settings))
    except RepositoryError as e:
        print(f"qkv: {e}", file=sys.stderr)
        return 2
