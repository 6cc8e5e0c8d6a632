"""Errors of the data plane, each carrying the gRPC status name it maps to (DESIGN.md, "Errors").

The batcher and runtime raise these without knowing gRPC; the server turns `code` into a status.
"""

from __future__ import annotations

__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "ServingError",
    "Unavailable",
]


class ServingError(Exception):
    code = "INTERNAL"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms  # sent as grpc-retry-pushback-ms when set


class InvalidArgument(ServingError):
    code = "INVALID_ARGUMENT"


class NotFound(ServingError):
    code = "NOT_FOUND"


class ResourceExhausted(ServingError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServingError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServingError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServingError):
    code = "CANCELLED"


class Internal(ServingError):
    code = "INTERNAL"
