"""Who may call the server: TLS (and mutual TLS) credentials and bearer tokens.

Every file is read and checked at start, so a bad certificate, key or token file stops the
server before any model loads, instead of failing at the first handshake. Probes stay open:
health, reflection and the protocol's own liveness/readiness calls carry no token.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from service import protocol
from service.callers import Caller
from service.config import ServerSettings
from service.errors import ConfigError

__all__ = [
    "OPEN_METHODS",
    "REPOSITORY_METHODS",
    "BearerTokens",
    "TokenAuth",
    "bearer_tokens",
    "server_credentials",
    "ssl_context",
]

# The protocol's own liveness/readiness calls stay open, like grpc.health: probes carry no token.
OPEN_METHODS = frozenset(f"/{protocol.SERVICE_NAME}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady"))
# With --admin-token-file, these take an admin token and no other.
REPOSITORY_METHODS = frozenset(
    f"/{protocol.SERVICE_NAME}/{m}" for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class BearerTokens:
    """The tokens of --auth-token-file and --admin-token-file, and whether an `authorization` value
    offers one that passes.

    `tokens` pass the inference calls (all are open when there are none); `admin` tokens, when given,
    are the only ones that pass the repository calls (index, load, unload). With `isolate`
    (--isolate-tokens), each inference token is a caller of its own (`caller`), holding at most `share` of
    each bound on what callers keep (--token-share)."""

    def __init__(
        self, tokens: list[str], admin: list[str] | None = None, isolate: bool = False, share: float = 1.0
    ) -> None:
        # Digests: equal lengths, so compare_digest's time says nothing about a token's length either.
        self.tokens = [_digest(t.encode()) for t in tokens]
        self.admin = [_digest(t.encode()) for t in admin or []]
        self.isolate = isolate and bool(self.tokens)
        self._callers = [Caller(f"token {i + 1}", share) for i in range(len(self.tokens))]
        self._admin_caller = Caller("admin", share)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.admin)

    def wants_admin(self, repository: bool) -> bool:
        return repository and bool(self.admin)

    def allows(self, authorization: str | None, repository: bool = False) -> bool:
        wanted = self.admin if self.wants_admin(repository) else self.tokens
        if not wanted:  # admin tokens only: the other calls are open
            return True
        if not isinstance(authorization, str) or authorization[:7].lower() != "bearer ":
            return False
        offered = _digest(authorization[7:].strip().encode())
        # compare against every token, so the time taken says nothing about which matched
        return any([hmac.compare_digest(offered, t) for t in wanted])

    def caller(self, authorization: str | None) -> Caller | None:
        """With --isolate-tokens, the caller whose token `authorization` offers (an admin token's callers are
        one, "admin"); None without isolation, or for a value that offers no token (refused before this)."""
        if not self.isolate or not isinstance(authorization, str) or authorization[:7].lower() != "bearer ":
            return None
        offered = _digest(authorization[7:].strip().encode())
        matched = [hmac.compare_digest(offered, t) for t in self.tokens]  # every token compared, as in `allows`
        if any(matched):
            return self._callers[matched.index(True)]
        return self._admin_caller if any([hmac.compare_digest(offered, t) for t in self.admin]) else None

    def caller_of(self, metadata: Any) -> Caller | None:
        """`caller` of a gRPC call's metadata."""
        if not self.isolate:
            return None
        return self.caller(next((v for k, v in metadata or () if k == "authorization" and isinstance(v, str)), None))


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Bearer tokens on the inference service; health and reflection stay open for probes."""

    def __init__(self, tokens: BearerTokens) -> None:
        self.tokens = tokens

    def _allowed(self, method: str, metadata: Any) -> bool:
        offered = next((v for k, v in metadata or () if k == "authorization" and isinstance(v, str)), None)
        return self.tokens.allows(offered, method in REPOSITORY_METHODS)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in OPEN_METHODS or not details.method.startswith(f"/{protocol.SERVICE_NAME}/"):
            return await continuation(details)
        if self._allowed(details.method, details.invocation_metadata):
            return await continuation(details)
        which = "admin " if self.tokens.wants_admin(details.method in REPOSITORY_METHODS) else ""

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or invalid {which}bearer token (send metadata 'authorization: Bearer TOKEN')",
            )

        method = protocol.SERVICE.methods_by_name.get(details.method.rsplit("/", 1)[-1])
        if method is not None and method.client_streaming:  # ModelStreamInfer: refused the same way
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def _read(path: Path, what: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(flag, f"cannot read {what} {path}: {e.strerror}", path) from None


def bearer_tokens(path: Path | None, flag: str = "--auth-token-file") -> list[str]:
    """The bearer tokens of a token file (--auth-token-file, --admin-token-file), one a line (blank lines
    skipped); [] without one."""
    if not path:
        return []
    try:
        text = _read(path, "token file", flag).decode()
    except UnicodeDecodeError as e:
        raise ConfigError(flag, f"token file {path} is not UTF-8 text (byte {e.start})", path) from None
    tokens = [t.strip() for t in text.splitlines() if t.strip()]
    if not tokens:
        raise ConfigError(flag, f"token file {path} holds no token", path)
    return tokens


def server_credentials(s: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS (and mutual TLS) server credentials, every file checked now: a bad one stops the start."""
    if not s.tls_cert and not s.tls_key:
        if s.tls_client_ca:
            raise ConfigError("--tls-client-ca", "--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (s.tls_cert and s.tls_key):
        raise ConfigError("--tls-cert", "--tls-cert and --tls-key go together")
    cert, key = _read(s.tls_cert, "TLS certificate", "--tls-cert"), _read(s.tls_key, "TLS key", "--tls-key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError("--tls-cert", f"TLS certificate {s.tls_cert} holds no PEM certificate", s.tls_cert)
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError("--tls-key", f"TLS key {s.tls_key} holds no PEM private key", s.tls_key)
    _check_key_matches(cert, key, s)
    ca = None
    if s.tls_client_ca:
        ca = _read(s.tls_client_ca, "client CA", "--tls-client-ca")
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError as e:
            why = f"client CA {s.tls_client_ca} holds no valid PEM certificate: {e}"
            raise ConfigError("--tls-client-ca", why, s.tls_client_ca) from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def ssl_context(s: ServerSettings) -> ssl.SSLContext | None:
    """The same TLS (and mutual TLS) for the HTTP port, from the files server_credentials checked."""
    if not s.tls_cert or not s.tls_key:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(s.tls_cert, s.tls_key)
    if s.tls_client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(s.tls_client_ca))
    return context


def _check_key_matches(cert: bytes, key: bytes, s: ServerSettings) -> None:
    """Refuse a certificate or key that does not parse, or a key not of the certificate.

    gRPC itself would only fail at the first handshake, long after the start looked fine.
    """
    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
    except ValueError as e:
        raise ConfigError("--tls-cert", f"cannot parse TLS certificate {s.tls_cert}: {e}", s.tls_cert) from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # TypeError: the key is encrypted
        raise ConfigError("--tls-key", f"cannot parse TLS key {s.tls_key}: {e}", s.tls_key) from None
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if public.public_bytes(*fmt) != private.public_key().public_bytes(*fmt):
        why = f"TLS key {s.tls_key} is not the private key of certificate {s.tls_cert}"
        raise ConfigError("--tls-key", why, s.tls_key)
