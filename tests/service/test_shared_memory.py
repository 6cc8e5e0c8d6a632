"""Triton's system shared memory extension, end to end: tritonclient's own shared memory utilities against a
real server on loopback, over gRPC and HTTP; hostile registrations and requests; regions unregistered while
requests use them."""

from __future__ import annotations

import asyncio
import fcntl
import http.client
import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service import protocol
from service.callers import Caller
from service.errors import NotFound, PermissionDenied, ResourceExhausted
from service.frontends.peers import _proc_uid, access, grpc_address, peer_uid
from service.frontends.security import BearerTokens
from service.frontends.shared_memory import SharedMemoryRegistry, check_may_change, peer_host
from service.tools.bench.servers import scrape, variant
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.queue_helpers import until_computing

MAX_REGIONS = 4
MAX_BYTES = 1 << 20
SIZE = 16 * 4  # one INT32 [1, 16] tensor of `simple`


def _simple(directory: Path) -> None:
    """Triton's example model: INPUT0, INPUT1 INT32 [1, 16] -> OUTPUT0 = sum, OUTPUT1 = difference."""
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, [1, 16]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, TensorProto.INT32, [1, 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "simple", ins, outs), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "workers-2"])
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """simple, and g2p_encoder with one instance (held by a blocker); small shared memory limits; one process, or
    two workers (a region registered on one is registered on both)."""
    scratch = tmp_path_factory.mktemp("shm")
    one = {"instances": 1, "batching": {"max_queue_wait_ms": 60_000, "max_queue_tokens": 65536}}
    models = variant(MODELS, scratch / "models", {"g2p_encoder": one})
    _simple(models / "simple")
    limits = ["--shared-memory-max-regions", str(MAX_REGIONS), "--shared-memory-max-bytes", str(MAX_BYTES)]
    args = ["--model-repository", str(models), "--compute-nice", "0", "--workers", request.param, *limits]
    s = start_server(args, scratch / "server.log")
    yield s
    stop_server(s)


def _key(name: str) -> str:
    return f"/qkv_test_{os.getpid()}_{name}"  # unique on a machine other test runs share


class Regions:
    """Regions created with tritonclient's utilities and registered through `client` (grpc or http);
    all unregistered and destroyed at the end."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.handles: list[Any] = []

    def make(self, name: str, size: int, register: bool = True) -> Any:
        handle = shm.create_shared_memory_region(name, _key(name), size)
        self.handles.append(handle)
        if register:
            self.client.register_system_shared_memory(name, _key(name), size)
        return handle

    def close(self) -> None:
        self.client.unregister_system_shared_memory()
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def grpc_regions(served: RunningServer) -> Iterator[Regions]:
    r = Regions(g.InferenceServerClient(served.url))
    yield r
    r.close()


@pytest.fixture
def http_regions(served: RunningServer) -> Iterator[Regions]:
    r = Regions(h.InferenceServerClient(served.http_url))
    yield r
    r.close()


X0 = np.arange(16, dtype=np.int32).reshape(1, 16)
X1 = np.full((1, 16), 3, dtype=np.int32)


def test_grpc_inputs_and_outputs_in_shared_memory(served: RunningServer, grpc_regions: Regions) -> None:
    client = grpc_regions.client
    inputs_region = grpc_regions.make("in", 2 * SIZE)
    outputs_region = grpc_regions.make("out", 2 * SIZE)
    shm.set_shared_memory_region(inputs_region, [X0])
    shm.set_shared_memory_region(inputs_region, [X1], offset=SIZE)
    inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("in", SIZE)
    inputs[1].set_shared_memory("in", SIZE, offset=SIZE)
    outputs = [g.InferRequestedOutput("OUTPUT0"), g.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", SIZE)
    outputs[1].set_shared_memory("out", SIZE, offset=SIZE)
    result = client.infer("simple", inputs, outputs=outputs)
    response = result.get_response()
    assert list(response.raw_output_contents) == [b"", b""], "the outputs travel in the region, not the answer"
    out1 = result.get_output("OUTPUT1")
    assert (out1.datatype, list(out1.shape)) == ("INT32", [1, 16])
    assert out1.parameters["shared_memory_region"].string_param == "out"
    assert out1.parameters["shared_memory_offset"].int64_param == SIZE
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs_region, np.int32, [1, 16]), X0 + X1)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outputs_region, np.int32, [1, 16], offset=SIZE), X0 - X1)
    status = client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["in"] == {"name": "in", "key": _key("in"), "byte_size": str(2 * SIZE)}
    assert set(status) == {"in", "out"}
    assert "system_shared_memory" in client.get_server_metadata().extensions


def test_grpc_mixed_shared_memory_and_raw_tensors(served: RunningServer, grpc_regions: Regions) -> None:
    """INPUT0 raw and INPUT1 in a region (its raw_input_contents has one entry); OUTPUT1 in a region, OUTPUT0
    in the answer."""
    region = grpc_regions.make("mixed", 2 * SIZE)
    shm.set_shared_memory_region(region, [X1], offset=SIZE)
    inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(X0)
    inputs[1].set_shared_memory("mixed", SIZE, offset=SIZE)
    outputs = [g.InferRequestedOutput("OUTPUT0"), g.InferRequestedOutput("OUTPUT1")]
    outputs[1].set_shared_memory("mixed", SIZE)  # over the region's first tensor, read already
    result = grpc_regions.client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X0 + X1)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.int32, [1, 16]), X0 - X1)


def test_http_mixed_shared_memory_and_json_tensors(served: RunningServer, http_regions: Regions) -> None:
    client = http_regions.client
    region = http_regions.make("web", 2 * SIZE)
    shm.set_shared_memory_region(region, [X0])
    inputs = [h.InferInput("INPUT0", [1, 16], "INT32"), h.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("web", SIZE)
    inputs[1].set_data_from_numpy(X1, binary_data=False)
    outputs = [h.InferRequestedOutput("OUTPUT0", binary_data=False), h.InferRequestedOutput("OUTPUT1")]
    outputs[1].set_shared_memory("web", SIZE, offset=SIZE)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X0 + X1)
    out1 = result.get_output("OUTPUT1")
    assert "data" not in out1 and out1["parameters"]["shared_memory_region"] == "web"
    np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.int32, [1, 16], offset=SIZE), X0 - X1)
    assert client.get_system_shared_memory_status("web") == [
        {"name": "web", "key": _key("web"), "offset": 0, "byte_size": 2 * SIZE}
    ]
    assert "system_shared_memory" in client.get_server_metadata()["extensions"]


# --- hostile registrations and requests ---------------------------------------------------------------------


def _refused(call: Any, *args: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, timeout=10)
    return e.value.code(), e.value.details()


def _register(stub: Any, name: str, key: str, size: int, offset: int = 0, timeout: float = 10) -> Any:
    request = protocol.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=size)
    return stub.SystemSharedMemoryRegister(request, timeout=timeout)


def test_registrations_refused_by_name(served: RunningServer, grpc_regions: Regions, tmp_path: Path) -> None:
    grpc_regions.make("taken", SIZE)
    grpc_regions.make("unregistered", SIZE, register=False)
    with grpc.insecure_channel(served.url) as channel:
        stub = protocol.Stub(channel)

        def refused(name: str, key: str, size: int, offset: int = 0) -> tuple[grpc.StatusCode, str]:
            return _refused(_register, stub, name, key, size, offset)

        code, message = refused("ghost", "/qkv_no_such_object", SIZE)
        assert code == grpc.StatusCode.NOT_FOUND and "'ghost'" in message and "'/qkv_no_such_object'" in message
        code, message = refused("taken", _key("unregistered"), SIZE)
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'taken'" in message
        for key in ("/../etc/passwd", "a/b", "/", ""):
            code, message = refused("bad", key, SIZE)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "key" in message, key
        code, message = refused("long", _key("unregistered"), SIZE + 1)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"({SIZE} bytes)" in message
        code, message = refused("far", _key("unregistered"), 1, offset=2**63)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "'far'" in message
        code, message = refused("empty", _key("unregistered"), 0)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "byte_size" in message
        code, message = refused("huge", _key("unregistered"), MAX_BYTES + 1)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--shared-memory-max-bytes" in message
        link = Path("/dev/shm") / f"qkv_test_{os.getpid()}_link"
        link.symlink_to(tmp_path / "elsewhere")
        try:  # a symbolic link in /dev/shm is not followed
            code, message = refused("link", "/" + link.name, SIZE)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "'link'" in message
        finally:
            link.unlink()
        code, message = _refused(stub.SystemSharedMemoryStatus, protocol.SystemSharedMemoryStatusRequest(name="ghost"))
        assert code == grpc.StatusCode.NOT_FOUND and "'ghost'" in message
        code, message = _refused(
            stub.SystemSharedMemoryUnregister, protocol.SystemSharedMemoryUnregisterRequest(name="ghost")
        )
        assert code == grpc.StatusCode.NOT_FOUND and "'ghost'" in message
        for left in range(MAX_REGIONS - 1):  # "taken" is one
            _register(stub, f"r{left}", _key("unregistered"), SIZE)
        code, message = refused("one-too-many", _key("unregistered"), SIZE)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--shared-memory-max-regions" in message
        cuda = protocol.message_class("CudaSharedMemoryRegisterRequest")(name="gpu", byte_size=SIZE)
        code, message = _refused(stub.CudaSharedMemoryRegister, cuda)
        assert code == grpc.StatusCode.UNIMPLEMENTED and "no CUDA shared memory" in message


def _simple_request(region: str, size: int, offset: int = 0, output: bool = False) -> Any:
    """INPUT0 from `region` (or, with `output`, OUTPUT0 into it), INPUT1 raw."""
    request = protocol.ModelInferRequest(model_name="simple")
    first = request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    request.raw_input_contents.append(X1.tobytes())
    target = request.outputs.add(name="OUTPUT0") if output else first
    if output:
        request.raw_input_contents.insert(0, X0.tobytes())
    target.parameters["shared_memory_region"].string_param = region
    target.parameters["shared_memory_byte_size"].int64_param = size
    target.parameters["shared_memory_offset"].int64_param = offset
    return request


def test_requests_refused_by_name(served: RunningServer, grpc_regions: Regions) -> None:
    region = grpc_regions.make("small", SIZE)
    shm.set_shared_memory_region(region, [X0])
    with grpc.insecure_channel(served.url) as channel:
        stub = protocol.Stub(channel)
        cases = [
            (_simple_request("nowhere", SIZE), grpc.StatusCode.NOT_FOUND, "'nowhere'"),
            (_simple_request("small", SIZE, offset=4), grpc.StatusCode.INVALID_ARGUMENT, "region 'small' (64 bytes)"),
            (_simple_request("small", SIZE, offset=-8), grpc.StatusCode.INVALID_ARGUMENT, "'small'"),
            (_simple_request("small", SIZE - 4), grpc.StatusCode.INVALID_ARGUMENT, "needs 64"),
            (_simple_request("small", SIZE // 2, output=True), grpc.StatusCode.INVALID_ARGUMENT, "is 64 bytes"),
            (_simple_request("small", SIZE + 4, output=True), grpc.StatusCode.INVALID_ARGUMENT, "'small'"),
        ]
        orphan = _simple_request("small", SIZE)
        del orphan.inputs[0].parameters["shared_memory_region"]
        orphan.raw_input_contents.insert(0, X0.tobytes())
        cases.append((orphan, grpc.StatusCode.INVALID_ARGUMENT, "without 'shared_memory_region'"))
        wrong_type = _simple_request("small", SIZE)
        wrong_type.inputs[0].parameters["shared_memory_byte_size"].string_param = "64"
        cases.append((wrong_type, grpc.StatusCode.INVALID_ARGUMENT, "must be an integer"))
        both = _simple_request("small", SIZE)
        both.raw_input_contents.append(X0.tobytes())
        cases.append((both, grpc.StatusCode.INVALID_ARGUMENT, "not in shared memory"))
        for request, code, words in cases:
            got, message = _refused(stub.ModelInfer, request)
            assert got == code and words in message, message
        response = stub.ModelInfer(_simple_request("small", SIZE), timeout=10)  # and the server is unharmed
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.int32), (X0 + X1).ravel())
        # The client shrinks its object after registering it: a read comes back short, refused, never a fault.
        os.truncate(Path("/dev/shm") / _key("small").lstrip("/"), 8)
        got, message = _refused(stub.ModelInfer, _simple_request("small", SIZE))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "now holds 8 bytes" in message
        got, message = _refused(stub.ModelInfer, _simple_request("small", SIZE, output=True))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "now holds 8 bytes" in message
        assert stub.ServerLive(protocol.ServerLiveRequest(), timeout=10).live


def _http(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = url.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request(method, path, body=None if body is None else json.dumps(body).encode())
        r = c.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None
    finally:
        c.close()


def test_http_endpoints_and_their_errors(served: RunningServer, http_regions: Regions) -> None:
    http_regions.make("h", SIZE, register=False)
    url = served.http_url
    assert _http(url, "POST", "/v2/systemsharedmemory/region/h/register", {"key": _key("h"), "byte_size": SIZE}) == (
        200,
        None,
    )
    assert _http(url, "GET", "/v2/systemsharedmemory/status") == (
        200,
        [{"name": "h", "key": _key("h"), "offset": 0, "byte_size": SIZE}],
    )
    status, doc = _http(url, "POST", "/v2/systemsharedmemory/region/h/register", {"key": _key("h"), "byte_size": 8})
    assert status == 409 and "'h'" in doc["error"]
    status, doc = _http(url, "POST", "/v2/systemsharedmemory/region/x/register", {"key": _key("h"), "byte_size": -1})
    assert status == 400 and "byte_size" in doc["error"]
    status, doc = _http(url, "POST", "/v2/systemsharedmemory/region/x/register", {"byte_size": 8})
    assert status == 400 and "key" in doc["error"]
    status, doc = _http(url, "GET", "/v2/systemsharedmemory/region/x/status")
    assert status == 404 and "'x'" in doc["error"]
    status, doc = _http(url, "POST", "/v2/cudasharedmemory/region/x/register", {"raw_handle": {"b64": ""}})
    assert status == 501 and "no CUDA shared memory" in doc["error"]
    assert _http(url, "POST", "/v2/cudasharedmemory/unregister")[0] == 200  # nothing registered: done
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"shared_memory_region": "h"}},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": X1.ravel().tolist()},
        ]
    }
    status, doc = _http(url, "POST", "/v2/models/simple/infer", body)
    assert status == 400 and "'shared_memory_byte_size' must come with" in doc["error"]
    body["inputs"][0]["data"] = X0.ravel().tolist()
    body["inputs"][0]["parameters"]["shared_memory_byte_size"] = SIZE
    status, doc = _http(url, "POST", "/v2/models/simple/infer", body)
    assert status == 400 and "both a shared memory region and data" in doc["error"]
    assert _http(url, "POST", "/v2/systemsharedmemory/region/h/unregister") == (200, None)
    assert _http(url, "GET", "/v2/systemsharedmemory/status") == (200, [])


def test_only_loopback_or_an_admin_token_may_change_regions() -> None:
    tokens = BearerTokens(["user"], ["admin"])
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "unix"):
        check_may_change(host, None, tokens, "registering")
    for authorization in (None, "Bearer user", "Bearer wrong"):
        with pytest.raises(PermissionDenied, match=r"'10\.1\.2\.3'.*admin bearer token"):
            check_may_change("10.1.2.3", authorization, tokens, "registering")
    check_may_change("10.1.2.3", "Bearer admin", tokens, "registering")
    with pytest.raises(PermissionDenied):  # no admin tokens at all: loopback only
        check_may_change("10.1.2.3", None, BearerTokens([]), "registering")
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:%5B::1%5D:5000") == "::1"


def _outside_address() -> str | None:
    """An address of this host that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the source address
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_peer_beyond_loopback_needs_the_admin_token(tmp_path: Path) -> None:
    address = _outside_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    (tmp_path / "admin").write_text("sesame\n")
    s = start_server(["--host", "0.0.0.0", "--admin-token-file", str(tmp_path / "admin")], tmp_path / "server.log")
    key = _key("remote")
    handle = shm.create_shared_memory_region("remote", key, SIZE)
    try:
        port = s.url.rsplit(":", 1)[1]
        with grpc.insecure_channel(f"{address}:{port}") as channel:
            stub = protocol.Stub(channel)
            code, message = _refused(_register, stub, "remote", key, SIZE)
            assert code == grpc.StatusCode.PERMISSION_DENIED and address in message
            request = protocol.SystemSharedMemoryRegisterRequest(name="remote", key=key, byte_size=SIZE)
            stub.SystemSharedMemoryRegister(request, timeout=10, metadata=[("authorization", "Bearer sesame")])
        http_port = s.http_url.rsplit(":", 1)[1]
        status, doc = _http(f"{address}:{http_port}", "POST", "/v2/systemsharedmemory/unregister")
        assert status == 403 and address in doc["error"]
        assert _http(s.http_url, "POST", "/v2/systemsharedmemory/unregister") == (200, None)  # loopback may
    finally:
        shm.destroy_shared_memory_region(handle)
        stop_server(s)


# --- regions unregistered while requests use them -----------------------------------------------------------


def _encoder_request(rows: int, seq: int, rng: np.random.Generator) -> Any:
    request = protocol.ModelInferRequest(model_name="g2p_encoder")
    request.inputs.add(name="input_ids", datatype="INT64", shape=[rows, seq])
    request.inputs.add(name="attention_mask", datatype="INT64", shape=[rows, seq])
    ids = rng.integers(4, 33, size=(rows, seq), dtype=np.int64)
    request.raw_input_contents.extend([ids.tobytes(), np.ones((rows, seq), np.int64).tobytes()])
    return request


def test_a_region_unregistered_while_a_request_waits_stays_open_until_it_is_answered(
    served: RunningServer, grpc_regions: Regions, request: pytest.FixtureRequest
) -> None:
    if request.node.callspec.params["served"] != "1":
        pytest.skip("a waiting request's regions count against the limit of its own worker only")
    rng = np.random.default_rng(3)
    blocker = _encoder_request(64, 512, rng)  # seconds of work on the one instance
    plain = _encoder_request(1, 16, rng)
    ids = np.frombuffer(plain.raw_input_contents[0], np.int64)
    out_size = 16 * 192 * 4
    inputs_region = grpc_regions.make("ids", ids.nbytes)
    outputs_region = grpc_regions.make("states", out_size)
    shm.set_shared_memory_region(inputs_region, [ids])
    request = protocol.ModelInferRequest()
    request.CopyFrom(plain)
    del request.raw_input_contents[0]
    output = request.outputs.add(name="last_hidden_state")
    for tensor, region, size in ((request.inputs[0], "ids", ids.nbytes), (output, "states", out_size)):
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = size

    async def run() -> tuple[Any, Any]:
        big = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(served.url, options=big) as channel:
            stub = protocol.Stub(channel)
            first = asyncio.ensure_future(stub.ModelInfer(blocker, timeout=300))
            await until_computing(served, first)
            waiting = asyncio.ensure_future(stub.ModelInfer(request, timeout=300))
            while scrape(served.metrics_url).get('qkv_queue_depth{model="g2p_encoder",version="1"}', 0) != 1:
                await asyncio.sleep(0.02)
            grpc_regions.client.unregister_system_shared_memory()  # both, while the request waits
            assert grpc_regions.client.get_system_shared_memory_status(as_json=True) == {}
            # The two still count against the limit: their descriptors stay open for the waiting request.
            for k in range(MAX_REGIONS - 2):
                grpc_regions.make(f"more{k}", 8)
            with pytest.raises(InferenceServerException, match="--shared-memory-max-regions"):
                grpc_regions.make("one-more", 8)
            assert not first.done(), "the blocker finished early: the request did not wait"
            answer = await waiting
            await first
            return answer, await stub.ModelInfer(plain, timeout=60)

    answer, expected = asyncio.run(run())
    assert list(answer.raw_output_contents) == [b""]
    got = shm.get_contents_as_numpy(outputs_region, np.float32, [1, 16, 192])
    want = np.frombuffer(expected.raw_output_contents[0], np.float32).reshape(1, 16, 192)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    grpc_regions.make("one-more", 8)  # the request is answered: its two regions are closed


def test_requests_under_unregistering_either_succeed_or_are_refused_by_name(
    served: RunningServer, grpc_regions: Regions
) -> None:
    region = grpc_regions.make("busy", SIZE)
    shm.set_shared_memory_region(region, [X0])
    expected = (X0 + X1).ravel()

    async def run() -> list[Any]:
        async with grpc.aio.insecure_channel(served.url) as channel:
            stub = protocol.Stub(channel)

            async def one() -> Any:
                try:
                    return await stub.ModelInfer(_simple_request("busy", SIZE), timeout=60)
                except grpc.aio.AioRpcError as e:
                    return e

            tasks = [asyncio.ensure_future(one()) for _ in range(200)]
            while not all(t.done() for t in tasks):
                await stub.SystemSharedMemoryUnregister(protocol.SystemSharedMemoryUnregisterRequest(name="busy"))
                await asyncio.sleep(0)
                await stub.SystemSharedMemoryRegister(
                    protocol.SystemSharedMemoryRegisterRequest(name="busy", key=_key("busy"), byte_size=SIZE)
                )
            outcomes = [t.result() for t in tasks]
            # registered once more (as the loop leaves it): a request after the churn is answered from it
            outcomes.append(await one())
            return outcomes

    outcomes = asyncio.run(run())
    for outcome in outcomes:
        if isinstance(outcome, grpc.aio.AioRpcError):
            assert outcome.code() == grpc.StatusCode.NOT_FOUND and "'busy'" in str(outcome.details())
        else:
            np.testing.assert_array_equal(np.frombuffer(outcome.raw_output_contents[0], np.int32), expected)
    assert not isinstance(outcomes[-1], grpc.aio.AioRpcError), outcomes[-1]


# --- whose objects: the peer's uid and the object's owner and mode ------------------------------------------


def _stat(uid: int, gid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def test_a_user_may_what_its_class_of_the_mode_lets_it() -> None:
    nobody = 65534
    assert access(0, _stat(1000, 1000, 0o000)) == (True, True)  # root
    assert access(nobody, _stat(nobody, 0, 0o600)) == (True, True)
    assert access(nobody, _stat(nobody, 0, 0o066)) == (False, False)  # the owner's bits, only
    assert access(nobody, _stat(0, 0, 0o600)) == (False, False)
    assert access(nobody, _stat(0, 0, 0o644)) == (True, False)
    assert access(nobody, _stat(0, 0, 0o622)) == (False, True)
    assert access(nobody, _stat(0, 0, 0o666)) == (True, True)


def test_the_peers_uid_is_that_of_its_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client, listener.accept()[0]:
            peer = client.getsockname()
            for find in (peer_uid, _proc_uid):  # by sock_diag, and by /proc/net/tcp where there is no netlink
                assert find(peer, ("127.0.0.1", port)) == os.getuid()
                assert find(peer, ("0.0.0.0", port)) == os.getuid()
                assert find(("::ffff:127.0.0.1", peer[1]), ("::", port)) == os.getuid()
                assert find(peer, ("127.0.0.1", port + 1)) is None  # not a connection to that port
                assert find(("192.0.2.1", peer[1]), ("127.0.0.1", port)) is None  # beyond this host
    assert grpc_address("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert grpc_address("ipv6:%5B::1%5D:5000") == ("::1", 5000)
    assert grpc_address("unix:/tmp/socket") is None


def _registry(directory: Path, **kwargs: Any) -> SharedMemoryRegistry:
    return SharedMemoryRegistry(MAX_REGIONS, MAX_BYTES, MAX_BYTES, directory, **kwargs)


def test_an_unknown_peer_is_refused_unless_the_operator_opted_in(tmp_path: Path) -> None:
    (tmp_path / "object").write_bytes(bytes(SIZE))
    with pytest.raises(PermissionDenied, match="cannot tell which user"):
        _registry(tmp_path).register("r", "/object", 0, SIZE, None)
    regions = _registry(tmp_path, unverified_peers=True)
    regions.register("r", "/object", 0, SIZE, None)
    regions.close()
    with pytest.raises(PermissionDenied, match=r"does not start with '/mine_' \(--shared-memory-key-prefix\)"):
        _registry(tmp_path, key_prefix="mine_").register("r", "/object", 0, SIZE, os.getuid())


@pytest.mark.skipif(os.geteuid() != 0, reason="objects of another user need root to make")
def test_a_region_is_opened_with_the_registering_users_rights_and_used_within_them(tmp_path: Path) -> None:
    nobody = 65534
    for name, mode in (("secret", 0o600), ("readable", 0o644), ("writable", 0o622)):
        (tmp_path / name).write_bytes(bytes(SIZE))
        os.chmod(tmp_path / name, mode)
    regions = _registry(tmp_path)
    with pytest.raises(PermissionDenied, match=r"uid 65534 may not open '/secret' .*mode 0600"):
        regions.register("secret", "/secret", 0, SIZE, nobody)
    regions.register("readable", "/readable", 0, SIZE, nobody)
    regions.register("writable", "/writable", 0, SIZE, nobody)
    flags = {r.name: fcntl.fcntl(r.fd, fcntl.F_GETFL) & os.O_ACCMODE for r in regions._regions.values()}
    assert flags == {"readable": os.O_RDONLY, "writable": os.O_WRONLY}  # no more than the user may
    regions.register("mine", "/secret", 0, SIZE, 0)  # root may anything

    def use(name: str, write: bool, uid: int | None, unverified: bool = False) -> None:
        regions.lease(name, "output" if write else "input", "").check_access(write, "a tensor", uid, unverified)

    use("readable", False, nobody)
    with pytest.raises(PermissionDenied, match="'readable' may not be written: it was registered by a user without"):
        use("readable", True, nobody)
    use("mine", True, 0)
    with pytest.raises(PermissionDenied, match=r"'mine' may not be read: uid 65534 may not open '/secret'"):
        use("mine", False, nobody)  # root's region, named by another user: only as far as that user may
    with pytest.raises(PermissionDenied, match="cannot tell which user"):
        use("mine", False, None)
    use("mine", False, None, unverified=True)  # the operator opted in
    os.chmod(tmp_path / "readable", 0o600)  # checked again at each use, against the mode now
    with pytest.raises(PermissionDenied, match="'readable' may not be read"):
        use("readable", False, nobody)
    os.chmod(tmp_path / "readable", 0o666)  # a right the user gained since is not one the region has
    with pytest.raises(PermissionDenied, match="'readable' may not be written: it was registered by a user without"):
        use("readable", True, nobody)
    regions.close()


def test_a_callers_regions_are_its_own(tmp_path: Path) -> None:
    (tmp_path / "object").write_bytes(bytes(SIZE))
    a, b = Caller("token 1", 0.5), Caller("token 2", 0.5)
    regions = _registry(tmp_path)
    regions.register("r", "/object", 0, SIZE, os.getuid(), a)
    regions.register("r", "/object", 0, SIZE, os.getuid(), b)  # the same name: B's own
    assert [s.name for s in regions.status("", a)] == ["r"] and regions.status() == []
    regions.unregister("r", b)
    with pytest.raises(NotFound):
        regions.status("r", b)
    with pytest.raises(NotFound):
        regions.unregister("r", b)
    with pytest.raises(NotFound):
        regions.lease("r", "input", "token 2")
    assert regions.status("r", a)[0].key == "/object"
    for i in range(MAX_REGIONS // 2 - 1):  # A's share: half of the regions
        regions.register(f"a{i}", "/object", 0, SIZE, os.getuid(), a)
    with pytest.raises(ResourceExhausted, match="this caller's share of the limit is 2"):
        regions.register("one-more", "/object", 0, SIZE, os.getuid(), a)
    regions.register("b", "/object", 0, SIZE, os.getuid(), b)
    regions.close()
