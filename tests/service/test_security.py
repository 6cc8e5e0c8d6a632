"""Transport security and access on a real server: bearer tokens, TLS, mutual TLS, message size, start-up errors."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from service import protocol
from service.tools.client import Client, g2p_request
from service.tools.process import READY
from tests.conftest import MODELS, ROOT, RunningServer, start_server, stop_server

TOKENS = ["first-token", "s3cr3t-Token-two"]


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def ec_key(path: Path) -> Path:
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", path)
    return path


@dataclass
class Pki:
    server_cert: Path  # self-signed, SAN IP:127.0.0.1
    server_key: Path
    other_cert: Path  # another self-signed certificate (its key does not match server_key)
    ca_cert: Path  # signs client_cert
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from a CA the server does not trust
    rogue_key: Path


def _signed_client(d: Path, name: str, ca_cert: Path, ca_key: Path) -> tuple[Path, Path]:
    key = ec_key(d / f"{name}.key")
    openssl("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", d / f"{name}.csr")
    openssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
            "-days", "2", "-out", d / f"{name}.pem")  # fmt: skip
    return d / f"{name}.pem", key


def _self_signed(d: Path, name: str, *extra: str) -> tuple[Path, Path]:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-keyout", d / f"{name}.key", "-out", d / f"{name}.pem", "-subj", f"/CN={name}", *extra)  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    server_cert, server_key = _self_signed(d, "server", "-addext", "subjectAltName=IP:127.0.0.1")
    other_cert, _ = _self_signed(d, "other", "-addext", "subjectAltName=IP:127.0.0.1")
    ca_cert, ca_key = _self_signed(d, "ca", "-addext", "basicConstraints=critical,CA:TRUE")
    rogue_ca, rogue_ca_key = _self_signed(d, "rogue-ca", "-addext", "basicConstraints=critical,CA:TRUE")
    client_cert, client_key = _signed_client(d, "client", ca_cert, ca_key)
    rogue_cert, rogue_key = _signed_client(d, "rogue", rogue_ca, rogue_ca_key)
    return Pki(server_cert, server_key, other_cert, ca_cert, client_cert, client_key, rogue_cert, rogue_key)


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status  # type: ignore[no-any-return]


# --- bearer tokens ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("tokens")
    (d / "tokens").write_text(f"\n{TOKENS[0]}\n  {TOKENS[1]}  \n\n")
    s = start_server(["--auth-token-file", str(d / "tokens")], d / "log")
    yield s
    stop_server(s)


def test_inference_needs_a_valid_bearer_token(token_server: RunningServer) -> None:
    request = g2p_request(["hello"])
    with grpc.insecure_channel(token_server.url) as ch:
        stub = protocol.Stub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in e.value.details()
        wrong = [
            [("authorization", "Bearer not-a-token")],
            [("authorization", f"Bearer {TOKENS[0]}x")],  # a prefix of nothing, one character longer
            [("authorization", f"Bearer {TOKENS[0][:-1]}")],  # one character short
            [("authorization", TOKENS[0])],  # no scheme
            [("authorization", f"Basic {TOKENS[0]}")],
            [("x-token", TOKENS[0])],
        ]
        for metadata in wrong:
            assert code_of(lambda m=metadata: stub.ModelInfer(request, timeout=10, metadata=m)) == (
                grpc.StatusCode.UNAUTHENTICATED
            ), metadata
        # every RPC of the inference service is guarded, not only ModelInfer ...
        assert code_of(lambda: stub.ServerMetadata(protocol.ServerMetadataRequest(), timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        # ... but the protocol's liveness and readiness probes, which carry no token
        assert stub.ServerLive(protocol.ServerLiveRequest(), timeout=5).live
        assert stub.ServerReady(protocol.ServerReadyRequest(), timeout=5).ready
        assert stub.ModelReady(protocol.ModelReadyRequest(name="g2p"), timeout=5).ready
        for token in TOKENS:  # each line of the file is a token; surrounding spaces do not count
            reply = stub.ModelInfer(request, timeout=10, metadata=[("authorization", f"Bearer {token}")])
            assert reply.outputs[0].name == "PHONEMES" and reply.raw_output_contents[0]
        # the streaming RPC too, refused as a stream
        stream = stub.ModelStreamInfer(iter([request]), timeout=10)
        assert code_of(lambda: list(stream)) == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", f"Bearer {TOKENS[1]}")]
        (answer,) = stub.ModelStreamInfer(iter([request]), timeout=10, metadata=good)
        assert not answer.error_message and answer.infer_response.outputs[0].name == "PHONEMES"


def test_health_stays_open_without_a_token(token_server: RunningServer) -> None:
    with grpc.insecure_channel(token_server.url) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="g2p"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_tritonclient_and_the_qkv_client_send_tokens(token_server: RunningServer) -> None:
    c = g.InferenceServerClient(token_server.url)
    x = g.InferInput("TEXT", [1], "BYTES")
    x.set_data_from_numpy(np.array([b"cat"], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        c.infer("g2p", [x])
    assert "UNAUTHENTICATED" in str(e.value.status())
    result = c.infer("g2p", [x], headers={"authorization": f"Bearer {TOKENS[1]}"})
    assert result.as_numpy("PHONEMES")[0]
    with Client(token_server.url, timeout=10, token=TOKENS[0]) as ok:
        assert ok.g2p(["cat"])[0]
    with Client(token_server.url, timeout=10, token="nope") as bad:
        assert code_of(lambda: bad.g2p(["cat"])) == grpc.StatusCode.UNAUTHENTICATED


def test_token_file_from_the_environment(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("env-token\n")
    s = start_server([], tmp_path / "log", env={"QKV_AUTH_TOKEN_FILE": str(tmp_path / "tokens")})
    try:
        with grpc.insecure_channel(s.url) as ch:
            stub = protocol.Stub(ch)
            assert code_of(lambda: stub.ModelInfer(g2p_request(["a"]), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.ModelInfer(g2p_request(["a"]), timeout=10, metadata=[("authorization", "Bearer env-token")])
            assert reply.raw_output_contents[0]
        assert "auth_token_file=<set>" in s.output()  # the settings line does not print the path of secrets
    finally:
        stop_server(s)


# --- TLS and mutual TLS ----------------------------------------------------------------------------


def _http(url: str, path: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None,
          body: bytes | None = None) -> tuple[int, bytes]:  # fmt: skip
    scheme = "https" if context else "http"
    request = urllib.request.Request(f"{scheme}://{url}{path}", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_needs_the_same_bearer_token_and_probes_stay_open(token_server: RunningServer) -> None:
    url, generate = token_server.http_url, "/v2/models/g2p/generate"
    body = b'{"text_input": "cat"}'
    for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": TOKENS[0]},
                    {"Authorization": f"Basic {TOKENS[0]}"}):  # fmt: skip
        status, answer = _http(url, generate, headers, body=body)
        assert status == 401 and "bearer token" in json.loads(answer)["error"], (headers, status)
    for path in ("/v2", "/v2/models/g2p", "/v2/models/g2p/config", "/v2/models/stats"):  # every endpoint ...
        assert _http(url, path)[0] == 401, path
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/g2p/ready"):  # ... but the probes
        assert _http(url, path)[0] == 200, path
    for token in TOKENS:
        status, answer = _http(url, generate, {"Authorization": f"Bearer {token}"}, body=body)
        assert status == 200 and json.loads(answer)["text_output"] == "K AE1 T"
    c = h.InferenceServerClient(url)
    x = h.InferInput("TEXT", [1], "BYTES")
    x.set_data_from_numpy(np.array([b"cat"], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        c.infer("g2p", [x])
    assert e.value.status() == "401"
    assert c.infer("g2p", [x], headers={"Authorization": f"Bearer {TOKENS[1]}"}).as_numpy("PHONEMES")[0] == b"K AE1 T"


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("tls")
    s = start_server(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)], d / "log")
    yield s
    stop_server(s)


def test_tls_with_tritonclient(tls_server: RunningServer, pki: Pki) -> None:
    c = g.InferenceServerClient(tls_server.url, ssl=True, root_certificates=str(pki.server_cert))
    assert c.is_server_ready()
    x = g.InferInput("TEXT", [2], "BYTES")
    x.set_data_from_numpy(np.array([b"attention", b"cat"], dtype=object))
    phonemes = c.infer("g2p", [x]).as_numpy("PHONEMES")
    assert phonemes.shape == (2,) and all(p for p in phonemes)
    creds = grpc.ssl_channel_credentials(pki.server_cert.read_bytes())
    with Client(tls_server.url, timeout=10, credentials=creds) as qkv:
        assert qkv.g2p(["cat"]) == [phonemes[1].decode()]


def test_http_serves_tls_with_the_same_certificate(tls_server: RunningServer, pki: Pki) -> None:
    trusted = ssl.create_default_context(cafile=str(pki.server_cert))
    assert _http(tls_server.http_url, "/v2/health/ready", context=trusted)[0] == 200
    c = h.InferenceServerClient(tls_server.http_url, ssl=True, ssl_context_factory=lambda: trusted)
    x = h.InferInput("TEXT", [1], "BYTES")
    x.set_data_from_numpy(np.array([b"cat"], dtype=object))
    assert c.infer("g2p", [x]).as_numpy("PHONEMES")[0] == b"K AE1 T"
    with pytest.raises(urllib.error.URLError):  # a client that does not trust the certificate
        _http(tls_server.http_url, "/v2/health/ready", context=ssl.create_default_context())
    with pytest.raises((ConnectionError, http.client.HTTPException)):  # plaintext against the TLS port
        _http(tls_server.http_url, "/v2/health/ready")


def test_plaintext_client_against_the_tls_port_fails(tls_server: RunningServer) -> None:
    with grpc.insecure_channel(tls_server.url) as ch:
        assert code_of(lambda: protocol.Stub(ch).ModelInfer(g2p_request(["cat"]), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert code_of(lambda: health(ch)) == grpc.StatusCode.UNAVAILABLE


def test_tls_client_without_the_ca_fails(tls_server: RunningServer, pki: Pki) -> None:
    # the system roots, which do not hold our self-signed certificate
    with grpc.secure_channel(tls_server.url, grpc.ssl_channel_credentials()) as ch:
        assert code_of(lambda: protocol.Stub(ch).ModelInfer(g2p_request(["cat"]), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    # a different certificate as the root: the server's chain does not verify against it
    with grpc.secure_channel(tls_server.url, grpc.ssl_channel_credentials(pki.other_cert.read_bytes())) as ch:
        assert code_of(lambda: health(ch)) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("mtls")
    args = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca_cert)]
    s = start_server(args, d / "log")
    yield s
    stop_server(s)


def _mtls_code(url: str, pki: Pki, cert: Path | None, key: Path | None) -> grpc.StatusCode:
    creds = grpc.ssl_channel_credentials(
        pki.server_cert.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )
    with grpc.secure_channel(url, creds) as ch:
        return code_of(lambda: protocol.Stub(ch).ModelInfer(g2p_request(["cat"]), timeout=5))


def test_mutual_tls_requires_a_client_certificate_from_the_ca(mtls_server: RunningServer, pki: Pki) -> None:
    assert _mtls_code(mtls_server.url, pki, None, None) == grpc.StatusCode.UNAVAILABLE
    assert _mtls_code(mtls_server.url, pki, pki.rogue_cert, pki.rogue_key) == grpc.StatusCode.UNAVAILABLE
    assert _mtls_code(mtls_server.url, pki, pki.client_cert, pki.client_key) == grpc.StatusCode.OK
    c = g.InferenceServerClient(
        mtls_server.url,
        ssl=True,
        root_certificates=str(pki.server_cert),
        private_key=str(pki.client_key),
        certificate_chain=str(pki.client_cert),
    )
    assert c.is_server_ready()
    client = ssl.create_default_context(cafile=str(pki.server_cert))
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # HTTP too: no client certificate, refused
        _http(mtls_server.http_url, "/v2/health/ready", context=client)
    client.load_cert_chain(pki.client_cert, pki.client_key)
    assert _http(mtls_server.http_url, "/v2/health/ready", context=client)[0] == 200


# --- message size and the metrics address ----------------------------------------------------------


def test_oversized_message_is_refused_by_grpc_and_metrics_bind_their_own_address(tmp_path: Path) -> None:
    limit = 1 << 20
    s = start_server(["--max-message-bytes", str(limit), "--metrics-host", "127.0.0.2"], tmp_path / "log")
    try:
        big = protocol.ModelInferRequest(model_name="g2p_encoder")
        for name in ("input_ids", "attention_mask"):
            big.inputs.add(name=name, datatype="INT64", shape=[1, 80_000])
        big.raw_input_contents.extend([np.ones((1, 80_000), np.int64).tobytes()] * 2)
        assert big.ByteSize() > limit
        with grpc.insecure_channel(s.url) as ch:
            stub = protocol.Stub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(big, timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in e.value.details()  # gRPC's own message: no model code ran
            assert stub.ModelInfer(g2p_request(["still", "fine"]), timeout=10).raw_output_contents[0]
        m = READY.search(s.output())
        assert m is not None and m.group(3) == "127.0.0.2"
        port = int(m.group(4))
        body = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5).read().decode()
        assert "qkv_requests_total" in body
        with pytest.raises(urllib.error.URLError):  # the gRPC host does not serve the metrics
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        stop_server(s)


# --- start-up errors -------------------------------------------------------------------------------


def serve_exit(*args: str | Path, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`qkv serve ARGS`, run to its exit (`user`: a command prefix that runs it as another user)."""
    cmd = [*(user or []), sys.executable, "-m", "service.cli", "serve", "--model-repository", str(MODELS),
           "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0",
           *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def _start_up_cases(pki: Pki, d: Path) -> list[tuple[str, list[str | Path], str]]:
    (d / "junk.pem").write_text("this is not PEM\n")
    (d / "broken.pem").write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    (d / "empty-tokens").write_text("\n  \n")
    (d / "binary-tokens").write_bytes(b"\xff\xfe\x00token")
    openssl("pkey", "-in", pki.server_key, "-aes-128-cbc", "-passout", "pass:pw", "-out", d / "encrypted.key")
    cert, key = pki.server_cert, pki.server_key
    return [
        ("missing cert", ["--tls-cert", d / "nope.pem", "--tls-key", key], f"cannot read TLS certificate {d}/nope.pem"),
        ("missing key", ["--tls-cert", cert, "--tls-key", d / "nope.key"], f"cannot read TLS key {d}/nope.key"),
        (
            "cert is a directory",
            ["--tls-cert", d, "--tls-key", key],
            f"cannot read TLS certificate {d}: Is a directory",
        ),
        ("cert not PEM", ["--tls-cert", d / "junk.pem", "--tls-key", key], f"{d}/junk.pem holds no PEM certificate"),
        ("key not PEM", ["--tls-cert", cert, "--tls-key", d / "junk.pem"], f"{d}/junk.pem holds no PEM private key"),
        ("key is a cert", ["--tls-cert", cert, "--tls-key", cert], f"{cert} holds no PEM private key"),
        ("broken cert", ["--tls-cert", d / "broken.pem", "--tls-key", key], f"cannot parse TLS certificate {d}/broken"),
        ("encrypted key", ["--tls-cert", cert, "--tls-key", d / "encrypted.key"], "cannot parse TLS key"),
        (
            "mismatched key",
            ["--tls-cert", pki.other_cert, "--tls-key", key],
            f"TLS key {key} is not the private key of certificate {pki.other_cert}",
        ),
        ("cert alone", ["--tls-cert", cert], "--tls-cert and --tls-key go together"),
        ("client CA alone", ["--tls-client-ca", pki.ca_cert], "--tls-client-ca needs --tls-cert and --tls-key"),
        (
            "client CA not PEM",
            ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", d / "junk.pem"],
            f"client CA {d}/junk.pem holds no valid PEM certificate",
        ),
        ("missing tokens", ["--auth-token-file", d / "nope"], f"cannot read token file {d}/nope"),
        ("empty tokens", ["--auth-token-file", d / "empty-tokens"], f"{d}/empty-tokens holds no token"),
        ("binary tokens", ["--auth-token-file", d / "binary-tokens"], f"{d}/binary-tokens is not UTF-8 text"),
    ]


def test_bad_tls_and_token_files_stop_the_start_with_a_clear_message(pki: Pki, tmp_path: Path) -> None:
    cases = _start_up_cases(pki, tmp_path)
    for case, args, message in cases:
        done = serve_exit(*args)
        assert done.returncode != 0, (case, done.stdout)
        assert message in done.stderr, (case, done.stderr)
        assert "Traceback" not in done.stderr, case
        assert "serving" not in done.stdout, case


def test_an_unreadable_certificate_stops_the_start(pki: Pki) -> None:
    """Root reads any file, so as root the server is run as `nobody` (setpriv), to whom the certificate is
    unreadable and everything else it needs is not."""
    user: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "running as root: setpriv (util-linux) runs the server as another user"
        user = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        locked, key = Path(d) / "locked.pem", Path(d) / "server.key"
        locked.write_bytes(pki.server_cert.read_bytes())
        key.write_bytes(pki.server_key.read_bytes())
        locked.chmod(0)
        key.chmod(0o644)
        done = serve_exit("--tls-cert", locked, "--tls-key", key, user=user)
    assert done.returncode != 0
    assert f"cannot read TLS certificate {locked}: Permission denied" in done.stderr, done.stderr


def test_a_port_in_use_stops_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flag, message in (
            ("--grpc-port", "cannot bind the gRPC port"),
            ("--metrics-port", "cannot bind the metrics port"),
            ("--http-port", "cannot bind the HTTP port"),
        ):
            done = serve_exit(flag, port)  # given twice: the last one counts
            assert done.returncode != 0, flag
            assert f"{message} 127.0.0.1:{port}" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
