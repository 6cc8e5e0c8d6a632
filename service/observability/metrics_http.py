"""The metrics port (--metrics-port): Prometheus's exposition of the server's registry, on the server's own
event loop (docs/security.md, "Access").

One request a connection, as prometheus_client's own exporter serves it (HTTP/1.0 style: the answer, then
the close), but a connection is a coroutine on the event loop, not a thread: idle or slow clients cost a
socket each and nothing more. A connection that has not sent its request line and headers within the
timeout is closed, and so is one whose client does not read the answer within it; the listen backlog is
1024. The answer is prometheus_client's: the text format, or OpenMetrics when the Accept header asks;
gzip when accepted; `name[]` selects families; any path (Prometheus asks /metrics). asyncio streams only,
so that a server without the HTTP port never imports aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import socket
import urllib.parse
from http import HTTPStatus

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

__all__ = ["BACKLOG", "MAX_HEAD_BYTES", "MetricsServer"]

BACKLOG = 1024  # connections the kernel queues before they are accepted (Python's http.server: 5)
MAX_HEAD_BYTES = 16 << 10  # request line and headers; a scrape sends a few hundred bytes
ALLOW = "OPTIONS, GET, HEAD"

log = logging.getLogger("qkv.metrics")


class MetricsServer:
    """/metrics of one registry: bind (a port in use stops the start), then serve on the running loop."""

    def __init__(self, registry: CollectorRegistry, timeout: float, off_loop: bool = False) -> None:
        """`off_loop`: collect the registry on a thread, not the event loop (a collector that waits, as the
        workers' supervisor's waits on each worker's port, must not hold the loop meanwhile)."""
        self.registry, self.timeout, self.off_loop = registry, timeout, off_loop
        self._socket: socket.socket | None = None
        self._server: asyncio.Server | None = None

    def bind(self, host: str, port: int) -> int:
        """Bind and listen now; the port (port 0 picks a free one). OSError when it cannot."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        return int(self._socket.getsockname()[1])

    async def start(self) -> None:
        assert self._socket is not None, "bind first"
        self._server = await asyncio.start_server(
            self._connection, sock=self._socket, backlog=BACKLOG, limit=MAX_HEAD_BYTES
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = False
        headers: dict[str, str] = {}
        try:
            head = b""
            try:
                async with asyncio.timeout(self.timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return  # no whole request in time, or the client left: closed without a word
            except asyncio.LimitOverrunError:
                status, body = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request head too large\n"
            else:
                if self.off_loop:
                    status, headers, body = await asyncio.to_thread(self._answer, head)
                else:
                    status, headers, body = self._answer(head)
            lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Length: {len(body)}", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if not head.startswith(b"HEAD "):
                writer.write(body)
            async with asyncio.timeout(self.timeout):  # a client that does not read is not waited for
                await writer.drain()
            answered = True
        except (TimeoutError, ConnectionError):
            pass
        except Exception:  # a fault of the server's: logged, and the connection closed
            log.exception("the metrics port failed on a request")
        finally:
            if answered:
                writer.close()  # after what is written has gone
            else:
                writer.transport.abort()  # nothing owed, or a client that does not read: closed now
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout):
                    await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[HTTPStatus, dict[str, str], bytes]:
        """A request's head -> the status, headers and body of its answer."""
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return HTTPStatus.BAD_REQUEST, {}, b"not an HTTP request\n"
        method, target, _ = parts
        headers = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        if method == "OPTIONS":
            return HTTPStatus.OK, {"Allow": ALLOW}, b""
        if method not in ("GET", "HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, {"Allow": ALLOW}, b"use GET /metrics\n"
        url = urllib.parse.urlsplit(target)
        if url.path == "/favicon.ico":  # what a browser asks for first
            return HTTPStatus.OK, {}, b""
        return HTTPStatus.OK, *self.exposition(headers, urllib.parse.parse_qs(url.query))

    def exposition(self, headers: dict[str, str], params: dict[str, list[str]]) -> tuple[dict[str, str], bytes]:
        """The registry, encoded as the Accept header asks (gzipped when accepted): its headers and body."""
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        registry = self.registry.restricted_registry(params["name[]"]) if "name[]" in params else self.registry
        body: bytes = encoder(registry)
        answer = {"Content-Type": content_type}
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            answer["Content-Encoding"] = "gzip"
        return answer, body
