"""Every gRPC status, and the HTTP status that answers it on REST: one table for both front ends
(docs/design.md, "HTTP/REST"). A data-plane error carries its gRPC status name (service/errors.py)."""

from __future__ import annotations

import grpc

from service.errors import ServingError

__all__ = ["HTTP_STATUS", "grpc_status", "http_status"]

# Every gRPC status name -> the HTTP status that answers it (the message is the same on both protocols):
# Google's mapping (google/rpc/code.proto), and nginx's 499 for a client that left.
HTTP_STATUS = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,  # the client left; nobody reads it
    "UNKNOWN": 500,
    "INTERNAL": 500,
    "DATA_LOSS": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


def grpc_status(error: ServingError) -> grpc.StatusCode:
    return grpc.StatusCode[error.code]


def http_status(error: ServingError) -> int:
    return HTTP_STATUS[error.code]
