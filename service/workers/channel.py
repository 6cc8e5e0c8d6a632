"""The control channel between the supervisor and its workers: a unix socket per end, each call one pickled
request and one pickled answer (length-prefixed).

Local and private: the sockets live in a directory only the server's user may enter (mode 0700), made by the
supervisor, so pickle reads only what the server's own processes wrote. An answer is ("ok", value) or
("error", (code, message, retry_after_ms)): a ServingError raised on the far end is raised again where the call
was made, as the class of its code. Calls on one connection are numbered, and answered as they finish.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from service.errors import ServingError

__all__ = ["ChannelError", "Peer", "serve"]

HEADER = struct.Struct("!Q")

log = logging.getLogger("qkv.workers")


class ChannelError(Exception):
    """The far end did not answer: not started yet, restarting, or gone."""


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def _receive(reader: asyncio.StreamReader) -> Any:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


async def serve(path: Path, handle: Callable[[Any], Awaitable[Any]]) -> asyncio.Server:
    """Answer each request arriving at `path` with `handle(request)`. The requests of one connection are
    started in the order they arrive (a sequence's requests keep their order), and run side by side."""

    async def answer(writer: asyncio.StreamWriter, number: int, message: Any) -> None:
        try:
            reply: tuple[int, str, Any] = (number, "ok", await handle(message))
        except ServingError as e:  # sent as its code and message: the class itself may not unpickle there
            reply = (number, "error", (e.code, e.message, e.retry_after_ms))
        except Exception as e:  # a bug on this end: the caller gets it as an error, this end goes on
            log.exception("control request %r failed", message[0] if isinstance(message, tuple) else "")
            reply = (number, "error", ("INTERNAL", f"{type(e).__name__}: {e}", None))
        if not writer.is_closing():
            writer.write(_frame(reply))

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                number, message = await _receive(reader)
                task = asyncio.create_task(answer(writer, number, message))
                running.add(task)
                task.add_done_callback(running.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the far end closed, or this end stops
        finally:
            for task in running:
                task.cancel()
            writer.close()

    return await asyncio.start_unix_server(connected, path)


def _error(code: str, message: str, retry_after_ms: int | None) -> ServingError:
    """The far end's ServingError, as the class of its code."""
    kind = next((k for k in ServingError.__subclasses__() if k.code == code), ServingError)
    return kind(message, retry_after_ms)


class Peer:
    """Calls to one end of the channel over one connection, opened at the first call and again after a
    failure: calls are sent in the order they are made, and answered as they finish."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name
        self._connection: asyncio.Future[asyncio.StreamWriter] | None = None
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._numbers = itertools.count()
        self._reader: asyncio.Task[None] | None = None

    async def _connect(self) -> asyncio.StreamWriter:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as e:
            raise ChannelError(f"{self.name} is not answering: {e.strerror or e}") from None
        self._reader = asyncio.create_task(self._read(reader))
        return writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                number, status, value = await _receive(reader)
                waiting = self._waiting.pop(number, None)
                if waiting is not None and not waiting.done():
                    if status == "error":
                        waiting.set_exception(_error(*value))
                    else:
                        waiting.set_result(value)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._broken()

    def _broken(self) -> None:
        """The connection is gone: every call waiting on it fails; the next call opens another."""
        connection, self._connection = self._connection, None
        if connection is not None and connection.done() and connection.exception() is None:
            connection.result().close()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(ChannelError(f"{self.name} is not answering: the connection closed"))

    async def call(self, message: Any, timeout: float | None = None) -> Any:
        """The far end's answer to `message`; its ServingError raised here; ChannelError when it does not
        answer (within `timeout` seconds, when given)."""
        if self._connection is None:
            self._connection = asyncio.ensure_future(self._connect())
        connection = self._connection
        try:
            writer = await connection  # every call waiting here resumes in the order it came
        except ChannelError:
            if self._connection is connection:
                self._connection = None
            raise
        number = next(self._numbers)
        answer = self._waiting[number] = asyncio.get_running_loop().create_future()
        writer.write(_frame((number, message)))
        try:
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise ChannelError(f"{self.name} is not answering: no answer in {timeout:g} s") from None
        finally:
            self._waiting.pop(number, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._broken()
