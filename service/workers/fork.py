"""Workers forked from the supervisor at the server's start: what they import (numpy, onnxruntime, grpc,
aiohttp, the server's modules, the built-in model kinds) is imported once, in the supervisor, and its code and
data pages are shared copy-on-write by every worker rather than held by each.

Forking is safe here because of when it happens: before the supervisor's event loop and any thread of its
own, any onnxruntime session, and any gRPC channel or server: only imported modules are copied. Each worker
then builds its own event loop, gRPC server and sessions, as a spawned one does. The imported objects are
moved out of the garbage collector's reach (gc.freeze) before the fork, so that a worker's collections do not
write to, and so copy, their pages.

Where the supervisor cannot fork safely (a thread of its own already runs; no os.fork) and for a worker
started again after it died (the supervisor runs threads by then), the worker is spawned: `python -m
service.workers.worker`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from service.models.catalog import BUILT_IN
from service.workers import worker
from service.workers.worker import WorkerSpec

__all__ = ["Forked", "fork", "preload", "single_threaded"]

PRELOAD = ("numpy", "onnxruntime", "grpc", "service.server", "service.frontends.rest_api")
WAIT_POLL_S = 0.01


def preload() -> None:
    """Import what every worker imports, and freeze the objects made so far (out of the collector's reach)."""
    kinds = [target.partition(":")[0] for target in BUILT_IN.values()]
    for name in (*PRELOAD, *kinds):
        with contextlib.suppress(ImportError):  # a kind whose extra is not installed: its workers import it
            importlib.import_module(name)
    gc.collect()
    gc.freeze()


def single_threaded() -> bool:
    """Whether no thread but this one runs Python code, and nothing made here runs threads of its own. The
    native threads that importing starts (OpenBLAS's pool, which stops and starts again around a fork; one
    idle thread of onnxruntime's module) are left behind by a fork: a worker makes its own sessions."""
    return threading.active_count() == 1 and hasattr(os, "fork")


class Forked:
    """A forked worker as the supervisor watches it: subprocess.Popen's poll, wait, send_signal and kill."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # (reaped already: nothing left to wait for)
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker (pid {self.pid})", timeout or 0.0)
            time.sleep(WAIT_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork(spec: WorkerSpec, close: list[socket.socket]) -> Forked:
    """Worker `spec.index`, forked; in the child, the supervisor's sockets (`close`) are closed and the worker
    runs until it exits, never returning here."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid)
    code = 1
    try:
        for sock in close:
            sock.close()
        code = worker.run(spec)
    except BaseException:  # whatever ends it, the child exits below, never back into the parent's stack
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
