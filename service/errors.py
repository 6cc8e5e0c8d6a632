"""Errors of the data plane, each carrying the gRPC status name it maps to (docs/design.md, "Errors").

The batcher and runtime raise these without knowing gRPC; the server turns `code` into a status.
A message travels in the call's trailing metadata, which gRPC limits (8 KiB by default), so what a
client sent is quoted through `quote` (a short, escaped prefix and the whole length), and no message
exceeds MAX_MESSAGE_BYTES whatever it holds.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "MAX_MESSAGE_BYTES",
    "QUOTE_CHARS",
    "AlreadyExists",
    "Cancelled",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServingError",
    "Unavailable",
    "UsageError",
    "clip",
    "in_range",
    "out_of_range",
    "quote",
    "readable_file",
]

QUOTE_CHARS = 64  # of a client's string, at most this many characters appear in a message
MAX_MESSAGE_BYTES = 1024  # UTF-8; percent-encoded in the trailers, at most 3 KiB there


def _escaped(value: str) -> str:
    """Printable characters as they are, the others escaped (a newline as \\n): one line always."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)


def clip(value: str, limit: int = QUOTE_CHARS) -> str:
    """A client's string for a log line: escaped, and cut after `limit` characters with the whole
    length said: abc… (100,000 characters)."""
    if len(value) <= limit:
        return _escaped(value)
    return f"{_escaped(value[:limit])}… ({len(value):,} characters)"


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """A client's string as an error message quotes it: 'abc', or 'abc…' (100,000 characters)."""
    if len(value) <= limit:
        return f"'{_escaped(value)}'"
    return f"'{_escaped(value[:limit])}…' ({len(value):,} characters)"


class ServingError(Exception):
    code = "INTERNAL"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        encoded = message.encode()
        if len(encoded) > MAX_MESSAGE_BYTES:  # a bound for every message, whatever it quotes
            message = encoded[: MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "…"
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms  # sent as grpc-retry-pushback-ms when set


class InvalidArgument(ServingError):
    code = "INVALID_ARGUMENT"


class NotFound(ServingError):
    code = "NOT_FOUND"


class AlreadyExists(ServingError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(ServingError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServingError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServingError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServingError):
    code = "CANCELLED"


class FailedPrecondition(ServingError):
    code = "FAILED_PRECONDITION"


class PermissionDenied(ServingError):
    code = "PERMISSION_DENIED"


class Internal(ServingError):
    code = "INTERNAL"


# What a command refuses (service/cli.py, export/): one line naming the input, and exit status 2.


class ConfigError(Exception):
    """A setting the server cannot start with, said in one line that names its key (a flag, an environment
    variable) and, where the setting names one, the file; raised by the one check of the settings
    (`service.config.check`) and by what reads the files they name. `qkv serve` prints it and exits 2."""

    def __init__(self, key: str, message: str, file: Path | str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.file = None if file is None else Path(file)


class UsageError(Exception):
    """An input a command cannot use, said in one line that names it; `main` prints it and exits 2."""


def readable_file(path: Path, what: str) -> Path:
    """`path` when it is a file this process may read, or a UsageError naming it as `what`."""
    if not path.exists():
        raise UsageError(f"{what} not found: {path}")
    if not path.is_file():
        raise UsageError(f"{what} is not a file: {path}")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{what} is not readable: {path}")
    return path


def in_range(flag: str, value: float, lowest: float, highest: float | None = None) -> None:
    """A UsageError naming `flag` and its value unless lowest <= value (<= highest)."""
    problem = out_of_range(flag, value, lowest, highest)
    if problem:
        raise UsageError(problem)


def out_of_range(flag: str, value: float, lowest: float, highest: float | None = None) -> str:
    """What is wrong with `flag`'s value, naming both, unless lowest <= value (<= highest): then ""."""
    if lowest <= value and (highest is None or value <= highest):
        return ""
    allowed = f"from {_number(lowest)} to {_number(highest)}" if highest is not None else f"{_number(lowest)} or more"
    return f"{flag} {_number(value)}: must be {allowed}"


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
