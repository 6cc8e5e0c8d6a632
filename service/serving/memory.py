"""The server's heap and the system: one malloc arena for every thread, and free pages handed back after an
unload or a large request (glibc keeps them otherwise)."""

from __future__ import annotations

import contextlib
import ctypes

__all__ = ["M_ARENA_MAX", "one_malloc_arena", "return_freed_memory"]

M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_malloc_arena() -> None:
    """Every thread allocates from glibc's main heap, called before the first threads start. Sessions are
    built on worker threads; in per-thread arenas, what an unloaded version freed could stay resident
    (unload after unload left 32 MiB of a 70 MiB model in one run of three), while free pages anywhere
    in the main heap go back to the system with malloc_trim (every unload returned to within 1 MiB).
    onnxruntime's tensors come from its own arena, so compute threads rarely call malloc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc keeps them otherwise): RSS falls after an unload."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
