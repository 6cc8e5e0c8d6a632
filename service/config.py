"""Server settings: one dataclass, each field a `qkv serve` flag and a `QKV_*` environment variable.

Precedence: flag > environment > default. Per-model batching settings live in each model's
config.json instead (service/repository/layout.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from service.errors import ConfigError, out_of_range

__all__ = ["DEFAULT_URL", "ServerSettings", "add_arguments", "check", "from_arguments", "server_url"]

DEFAULT_URL = "127.0.0.1:8001"  # where the client tools look for a server when told nowhere else


def server_url() -> str:
    """The server the client tools call when --url is not given: $QKV_URL, else DEFAULT_URL."""
    return os.environ.get("QKV_URL") or DEFAULT_URL


def _setting(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ServerSettings:
    model_repository: Path = _setting(Path("models"), "directory of models (NAME/VERSION/...)")
    host: str = _setting("0.0.0.0", "address the gRPC and HTTP ports bind to")
    grpc_port: int = _setting(8001, "gRPC port (0: any free port, printed at start)")
    http_port: int = _setting(8000, "HTTP/REST port of the v2 protocol (0: any free port, printed at start; -1: off)")
    http_timeout: float = _setting(
        30.0, "seconds an HTTP client may take to send a request's headers or body, and a connection may idle"
    )
    metrics_host: str = _setting("", "address of the metrics port (default: --host)")
    metrics_port: int = _setting(8002, "Prometheus /metrics HTTP port (0: any free port; -1: off)")
    server_name: str = _setting(
        "qkv", "the server's name in ServerMetadata (Triton's health examples check for \"triton\")"
    )
    device: str = _setting(
        "cpu", "execution provider: cpu, or cuda (falls back to cpu when absent)", choices=("cpu", "cuda")
    )
    tls_cert: Path | None = _setting(None, "PEM certificate chain: serve TLS")
    tls_key: Path | None = _setting(None, "PEM private key of --tls-cert")
    tls_client_ca: Path | None = _setting(None, "PEM CA bundle: require client certificates (mutual TLS)")
    auth_token_file: Path | None = _setting(None, "bearer tokens, one a line, for inference RPCs")
    admin_token_file: Path | None = _setting(
        None, "bearer tokens, one a line, for the repository RPCs (index, load, unload); inference tokens do not pass"
    )
    model_control_mode: str = _setting(
        "none",
        "none: every model loaded at start, fixed; explicit: --load-model at start, then load/unload RPCs; "
        "poll: every model at start, and the repository re-read every --repository-poll-secs",
        choices=("none", "explicit", "poll"),
    )
    repository_poll_secs: float = _setting(15.0, "poll mode: seconds between reads of the model repository")
    load_model: tuple[str, ...] = _setting(
        (), "explicit mode: a model to load at start (repeat the flag; '*': every model)", append=True
    )
    exit_on_error: bool = _setting(
        True, "stop the start when a model fails to load (--no-exit-on-error: serve the others; the index says why)"
    )
    strict_readiness: bool = _setting(
        True,
        "the server is ready only while every model it loaded or tried to load is (--no-strict-readiness: once "
        "it answers)",
    )
    workers: str = _setting(
        "1",
        "worker processes serving behind the same ports: a number, or auto (one per two cores, within the memory "
        'available); docs/operations.md, "Worker processes"',
    )
    worker_cpu_arena: str = _setting(
        "off",
        "with --workers N, onnxruntime's CPU memory arena in a worker: shared by its sessions, each session's own "
        '(session), or off; docs/operations.md, "Worker processes"',
        choices=("shared", "session", "off"),
    )
    grace_period: float = _setting(10.0, "seconds in-flight requests get to finish after SIGTERM")
    max_connection_age: float = _setting(0.0, "seconds before a connection is asked to reconnect (0: never)")
    max_message_bytes: int = _setting(
        64 << 20, "largest request message the server receives (gRPC), or request body (HTTP)"
    )
    # Triton's gRPC limit in both directions is INT32_MAX; answers are the server's own, so only the
    # receiving side is bounded lower by default (a request is any client's).
    max_send_message_bytes: int = _setting((1 << 31) - 1, "largest response message the server sends over gRPC")
    max_concurrent_streams: int = _setting(1024, "HTTP/2 streams one connection may hold open")
    # 19, not 10: at 10x overload the refusal p99 was 16-61 ms against 67-154 ms at 10 (three pairs),
    # with the same throughput under load that does not overflow (BENCHMARKS.md).
    compute_nice: int = _setting(
        19, "how much lower (nice, 0-19) compute threads run than the gRPC event loop: refusals and health stay prompt"
    )
    # Only models whose config.json enables it use the cache, so the bound costs nothing until one does;
    # 64 MiB keeps some 86,000 g2p words (35,000 with attention) or a few thousand encoder outputs.
    cache_size: int = _setting(
        64 << 20, "bytes of answers the response cache may hold, all models together (0: no cache)"
    )
    cache_across_tokens: bool = _setting(
        False,
        "with --isolate-tokens: response cache answers reach every token's requests (default: each token's own); "
        "a token's statistics count its own cache hits either way",
    )
    shared_memory_max_regions: int = _setting(
        64, "system shared memory regions open at once (registered, or unregistered and still in use), at most; 0: off"
    )
    shared_memory_max_bytes: int = _setting(1 << 30, "bytes of all open system shared memory regions together, at most")
    shared_memory_key_prefix: str = _setting(
        "", "register only shared memory objects whose names (after the leading '/') start with this"
    )
    shared_memory_unverified_peers: bool = _setting(
        False,
        "register and use shared memory regions for a peer whose local user the server cannot find (beyond this "
        "host, not Linux), with the server's own rights on the object (default: refused)",
    )
    isolate_tokens: bool = _setting(
        False,
        "each --auth-token-file token's shared memory regions and sequences are its own: another token's are "
        "NOT_FOUND (default: shared by all, as in Triton)",
    )
    token_share: float = _setting(
        1.0,
        "with --isolate-tokens: the share of each bound on what callers keep (a model's max_sequences and "
        "max_state_bytes, --shared-memory-max-regions and -bytes) one token may hold, in (0, 1]",
    )
    access_log: bool = _setting(False, "one JSON line per request on stderr")
    metrics: bool = _setting(True, "record Prometheus metrics (--no-metrics: to measure what recording costs)")
    log_level: str = _setting("info", "debug, info, warning or error")
    tracing: bool = _setting(
        False, "export OpenTelemetry traces over OTLP, as the OTEL_* variables configure (needs the trace extra)"
    )
    trace_sample_ratio: float = _setting(
        -1.0, "share of requests traced when the caller did not decide (turns tracing on; -1: OTEL_TRACES_SAMPLER's)"
    )
    tracing_exporter: str = _setting(
        "otlp",
        "where spans go: otlp (a collector, as the OTEL_* variables say) or console (one JSON line a span on stdout; "
        "turns tracing on)",
        choices=("otlp", "console"),
    )
    tracing_file: Path | None = _setting(None, "write spans to this file, one JSON line a span (turns tracing on)")

    @property
    def traced(self) -> bool:
        """Whether requests are traced: --tracing, a sampling ratio given, or spans sent anywhere but OTLP."""
        return (
            self.tracing
            or self.trace_sample_ratio >= 0
            or self.tracing_exporter != "otlp"
            or self.tracing_file is not None
        )

    def summary(self) -> str:
        secret = {"auth_token_file", "tls_key"}
        return " ".join(
            f"{f.name}={'<set>' if f.name in secret and getattr(self, f.name) else getattr(self, f.name)}"
            for f in fields(self)
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(s: ServerSettings) -> None:
    """The one check of the server's settings, before anything binds, reads or loads: each setting that
    cannot work is a ConfigError naming its flag (and the file, for a file setting). The files the settings
    name are read by what uses them (TLS, tokens, tracing), which refuse them the same way."""

    def refuse(name: str, message: str, file: Path | None = None) -> None:
        raise ConfigError(_flag(name), message, file)

    for name, lowest in (("grpc_port", 0), ("http_port", -1), ("metrics_port", -1)):
        if problem := out_of_range(_flag(name), getattr(s, name), lowest, 65535):
            refuse(name, problem)
    for name, lowest in (("grace_period", 0), ("max_connection_age", 0), ("max_concurrent_streams", 1)):
        if problem := out_of_range(_flag(name), getattr(s, name), lowest):
            refuse(name, problem)
    for name in ("max_message_bytes", "max_send_message_bytes"):  # gRPC takes a message size as a C int
        if problem := out_of_range(_flag(name), getattr(s, name), 1, (1 << 31) - 1):
            refuse(name, problem)
    if problem := out_of_range("--compute-nice", s.compute_nice, 0, 19):
        refuse("compute_nice", problem)
    for name in ("http_timeout", "repository_poll_secs"):
        if getattr(s, name) <= 0:
            refuse(name, f"{_flag(name)} {getattr(s, name):g}: must be above 0 seconds")
    if s.trace_sample_ratio > 1 or (s.trace_sample_ratio < 0 and s.trace_sample_ratio != -1):
        refuse("trace_sample_ratio", f"--trace-sample-ratio {s.trace_sample_ratio:g}: give a share in [0, 1]")
    if s.tracing_file is not None and s.tracing_exporter != "otlp":
        refuse("tracing_file", f"--tracing-file and --tracing-exporter {s.tracing_exporter}: give one of them")
    if s.cache_size < 0:
        refuse("cache_size", f"--cache-size {s.cache_size}: give a number of bytes >= 0 (0: no cache)")
    if not 0 < s.token_share <= 1:
        refuse("token_share", f"--token-share {s.token_share:g}: give a share in (0, 1]")
    if s.isolate_tokens and s.auth_token_file is None:
        refuse("isolate_tokens", "--isolate-tokens needs --auth-token-file: the tokens are what it isolates")
    repository = Path(s.model_repository)
    if not repository.exists():
        refuse("model_repository", f"model repository not found: {repository}", repository)
    if not repository.is_dir():
        refuse("model_repository", f"model repository is not a directory: {repository}", repository)


def _parse_bool(value: str) -> bool:
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("", "0", "false", "no", "off"):  # empty: unset, as for every other setting
        return False
    raise ValueError(value)


def _convert(kind: str, value: str) -> Any:
    if "Path" in kind:
        return Path(value) if value else None
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return _parse_bool(value)
    if kind.startswith("tuple"):  # an environment variable: comma-separated
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def _converter(kind: str) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        return _convert(kind, value)

    convert.__name__ = kind  # argparse names it in its error: "invalid int value: 'abc'"
    return convert


class _Switch(argparse.Action):
    """An on/off flag: `--flag`, `--no-flag`, or Triton's `--flag=true` / `--flag=false`."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        negated = ["--no-" + o[2:] for o in option_strings if o.startswith("--")]
        super().__init__([*option_strings, *negated], dest, nargs="?", metavar="BOOL", **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        if option is not None and option.startswith("--no-"):
            if values is not None:
                parser.error(f"{option} takes no value")
            setattr(namespace, self.dest, False)
            return
        try:
            setattr(namespace, self.dest, True if values is None else _parse_bool(values))
        except ValueError:
            parser.error(f"{option}={values}: give true or false")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServerSettings):
        flag = "--" + f.name.replace("_", "-")
        env = "QKV_" + f.name.upper()
        help_text = f"{f.metadata['help']} [{env}]"
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action=_Switch, default=None, help=help_text)
        elif f.metadata.get("append"):
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:
            parser.add_argument(
                flag,
                type=_converter(kind),
                default=None,
                help=help_text,
                choices=f.metadata.get("choices"),
            )


def from_arguments(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerSettings:
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServerSettings):
        given = getattr(args, f.name, None)
        variable = "QKV_" + f.name.upper()
        env = environ.get(variable)
        if given is not None:
            values[f.name] = tuple(given) if isinstance(given, list) else given
        elif env is not None:
            try:
                value = _convert(str(f.type), env)
            except ValueError:
                raise ConfigError(variable, f"{variable}={env!r}: not a valid {f.type} value") from None
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(variable, f"{variable}={env!r}: choose from {', '.join(choices)}")
            values[f.name] = value
    return ServerSettings(**values)
