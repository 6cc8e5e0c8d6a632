"""The statistics extension summed over the workers: a worker answering ModelStatistics adds every other
worker's counts to its own.

ModelStatistics is answered synchronously by the front ends, so the other workers are asked synchronously
too, over a socket each worker answers on a thread of its own (never its event loop: two workers asking each
other at once cannot wait on each other). Each answer is a snapshot of the counts, taken under their lock.
A worker that does not answer within PEER_TIMEOUT_S (restarting) is left out of the sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.models.common import ModelStats

__all__ = ["Counts", "StatisticsServer", "asked", "summed"]

HEADER = struct.Struct("!Q")
PEER_TIMEOUT_S = 2.0
Counts = list[tuple[str, str, dict[str, Any]]]  # (model, version, ModelStats's fields) of each version


def _fields(stats: ModelStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if not f.name.startswith("_")}


def _read(sock: socket.socket) -> Any:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    (size,) = HEADER.unpack(exactly(HEADER.size))
    return pickle.loads(exactly(size))


def _write(sock: socket.socket, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(HEADER.pack(len(data)) + data)


class StatisticsServer:
    """Answers (model, version) with `counts(model, version)`, on a thread, at `path`."""

    def __init__(self, path: Path, counts: Callable[[str, str], list[tuple[str, str, ModelStats]]]) -> None:
        def answer(model: str, version: str) -> Counts:
            try:
                return [(n, v, _fields(s)) for n, v, s in counts(model, version)]
            except Exception:  # NotFound here: this worker has none to add
                return []

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError, ConnectionError, pickle.UnpicklingError):
                    model, version = _read(self.request)
                    _write(self.request, answer(model, version))

        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="qkv-statistics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def asked(path: Path, model: str, version: str) -> Counts:
    """Another worker's counts (none when it does not answer in time)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(PEER_TIMEOUT_S)
            sock.connect(str(path))
            _write(sock, (model, version))
            counts: Counts = _read(sock)
            return counts
    except (OSError, ConnectionError, pickle.UnpicklingError):
        return []


@dataclass
class SummedVersion:
    """A served version as the statistics message reads it: its name, version, config and counts."""

    name: str
    version: str
    config: Any
    stats: ModelStats


def summed(local: list[Any], others: list[Counts]) -> list[SummedVersion]:
    """Each of this worker's versions (`local`, ServedVersion) with the others' counts added."""
    answer = []
    for model in local:
        total = model.stats.snapshot()
        for counts in others:
            for name, version, fields in counts:
                if (name, version) == (model.name, model.version):
                    _add(total, fields)
        answer.append(SummedVersion(model.name, model.version, model.config, total))
    return answer


def _add(total: ModelStats, fields: dict[str, Any]) -> None:
    for key, value in fields.items():
        if key == "batches":
            for size, (count, ns) in value.items():
                entry = total.batches.setdefault(size, [0, 0])
                entry[0] += count
                entry[1] += ns
        elif key == "last_inference_ms":
            total.last_inference_ms = max(total.last_inference_ms, value)
        else:
            setattr(total, key, getattr(total, key) + value)
