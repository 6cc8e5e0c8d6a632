"""The conformance zoo: every v2 datatype, with and without a batch axis, through every protocol and encoding,
answered exactly as onnxruntime answers in process.

Models are built here with onnx.helper, one per (datatype, batch axis): several inputs and outputs, dynamic and
fixed dimensions, a scalar (rank 0), an output of another datatype (Shape, Cast to a string), arithmetic that
overflows or makes NaN. One real server serves them all; each request goes over gRPC with typed contents, gRPC
with raw contents, gRPC streaming (ModelStreamInfer), HTTP with JSON data and HTTP with binary data, with values
and with an empty tensor (a dimension of 0). An answer must have onnxruntime's datatype, shape and values: bit
for bit, NaN where onnxruntime has NaN. The cells the protocol cannot carry are refused by design, with
INVALID_ARGUMENT naming the input and the datatype (docs/design.md, "Conformance").
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service import protocol
from service.datatypes import NUMPY_DTYPES, decode_bytes, encode_bytes
from service.frontends.grpc_codec import CONTENTS_FIELD
from tests.conftest import RunningServer, start_server, stop_server

DATATYPES = list(NUMPY_DTYPES)  # the 13 the server serves; BF16 is refused (see below)
ONNX_TYPE = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}
FLOATS = ("FP16", "FP32", "FP64")
# onnxruntime's CPU kernels for ReduceSum (probed): the others have none.
REDUCIBLE = ("INT32", "INT64", *FLOATS)
ENCODINGS = ("grpc-typed", "grpc-raw", "grpc-stream", "http-json", "http-binary")
# Cells the v2 protocol cannot carry, refused by design: (datatype, encoding) -> what the refusal says.
REFUSED = {("FP16", "grpc-typed"): "input 'X': FP16 travels only in raw_input_contents"}
MAX_BATCH = 8
BATCH_ROWS = (2, 1, 3)  # rows of the requests sent to a model with a batch axis
WIDTHS = (4, 0, 1)  # the dynamic dimension "n" of those requests: 0 is the empty tensor
IMAGE, CLASSES = (3, 224, 224), 1000  # densenet's input and output
STRINGS = ["", "a", "naïve", "日本語 ✓", "x\x00y", "1e5", " spaced ", "b'q'"]


@dataclass(frozen=True)
class Case:
    """One zoo model: a datatype, with a batch axis (max_batch_size 8) or without one (max_batch_size 0)."""

    datatype: str
    batch: bool

    @property
    def name(self) -> str:
        return f"{self.datatype.lower()}_{'batch' if self.batch else 'nobatch'}"


CASES = [Case(d, b) for d in DATATYPES for b in (True, False)]


def _arithmetic(datatype: str, x: str, out: str) -> onnx.NodeProto:
    """Arithmetic onnxruntime has a kernel for in `datatype`: integers add (and wrap), floats divide (0 / 0 is
    NaN, max / max is 1), booleans negate."""
    if datatype == "BOOL":
        return helper.make_node("Not", [x], [out])
    if datatype in FLOATS:
        return helper.make_node("Div", [x, x], [out])
    return helper.make_node("Add", [x, x], [out])


def _graph(case: Case) -> onnx.ModelProto:
    """With a batch axis: X [batch, n], W [batch, 3] -> X_OUT = X, JOINED = X|W [batch, n + 3], and (not BYTES)
    ARITH = f(W), TEXT = W as strings. Without: X [2, n], S [] -> X_OUT = X, JOINED = X over X [4, n], S_OUT = S
    (a scalar), SHAPE = shape of X (INT64), and (not BYTES) ARITH = f(S), TEXT = X as strings; SUMS = X summed
    over n (0 when n is 0) where onnxruntime can sum the datatype."""
    t = ONNX_TYPE[case.datatype]
    numeric = case.datatype != "BYTES"
    nodes = [helper.make_node("Identity", ["X"], ["X_OUT"])]
    initializers = []
    if case.batch:
        inputs = [
            helper.make_tensor_value_info("X", t, ["batch", "n"]),
            helper.make_tensor_value_info("W", t, ["batch", 3]),
        ]
        outputs = [
            helper.make_tensor_value_info("X_OUT", t, ["batch", "n"]),
            helper.make_tensor_value_info("JOINED", t, ["batch", "m"]),
        ]
        nodes.append(helper.make_node("Concat", ["X", "W"], ["JOINED"], axis=1))
        if numeric:
            nodes += [
                _arithmetic(case.datatype, "W", "ARITH"),
                helper.make_node("Cast", ["W"], ["TEXT"], to=TensorProto.STRING),
            ]
            outputs += [
                helper.make_tensor_value_info("ARITH", t, ["batch", 3]),
                helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", 3]),
            ]
    else:
        inputs = [helper.make_tensor_value_info("X", t, [2, "n"]), helper.make_tensor_value_info("S", t, [])]
        outputs = [
            helper.make_tensor_value_info("X_OUT", t, [2, "n"]),
            helper.make_tensor_value_info("JOINED", t, [4, "n"]),
            helper.make_tensor_value_info("S_OUT", t, []),
            helper.make_tensor_value_info("SHAPE", TensorProto.INT64, [2]),
        ]
        nodes += [
            helper.make_node("Concat", ["X", "X"], ["JOINED"], axis=0),
            helper.make_node("Identity", ["S"], ["S_OUT"]),
            helper.make_node("Shape", ["X"], ["SHAPE"]),
        ]
        if numeric:
            nodes += [
                _arithmetic(case.datatype, "S", "ARITH"),
                helper.make_node("Cast", ["X"], ["TEXT"], to=TensorProto.STRING),
            ]
            outputs += [
                helper.make_tensor_value_info("ARITH", t, []),
                helper.make_tensor_value_info("TEXT", TensorProto.STRING, [2, "n"]),
            ]
        if case.datatype in REDUCIBLE:
            initializers.append(helper.make_tensor("axes", TensorProto.INT64, [1], [1]))
            nodes.append(helper.make_node("ReduceSum", ["X", "axes"], ["SUMS"], keepdims=0))
            outputs.append(helper.make_tensor_value_info("SUMS", t, [2]))
    graph = helper.make_graph(nodes, case.name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _save(model: onnx.ModelProto, directory: Path, config: dict[str, Any] | None) -> None:
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))


def _bf16_model(directory: Path) -> None:
    """x BF16 [2, 3] -> y = x|x: onnxruntime has CPU kernels for bfloat16 Identity, Concat and Shape (no
    arithmetic), but its Python API gives no bfloat16 arrays back ("No corresponding Numpy type")."""
    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 6])
    graph = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["y"], axis=1)], "bf16", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, directory, {"max_batch_size": 0})


def _densenet_like(directory: Path, batch: bool) -> None:
    """An image classifier's shapes with small weights: x FP32 [3, 224, 224] (or [batch, 3, 224, 224]) -> y FP32
    [1000] (or [batch, 1000]), each channel's mean times a fixed [3, 1000] matrix."""
    lead: list[Any] = ["batch"] if batch else []
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, *IMAGE])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, CLASSES])
    w = np.random.default_rng(3).standard_normal((3, CLASSES)).astype(np.float32)
    axes = [-2, -1]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["means"], axes=axes, keepdims=0),
        helper.make_node("MatMul", ["means", "w"], ["y"]),
    ]
    weights = helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel().tolist())
    graph = helper.make_graph(nodes, directory.name, [x], [y], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _save(model, directory, None)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("conformance") / "models"
    for case in CASES:
        _save(_graph(case), root / case.name, {"max_batch_size": MAX_BATCH if case.batch else 0, "instances": 1})
    _bf16_model(root / "bf16")
    _densenet_like(root / "densenet", batch=False)  # no config.json: the defaults
    _densenet_like(root / "densenet_batch", batch=True)
    _save(
        _graph(Case("FP32", True)),
        root / "rows_counted",
        {"max_batch_size": MAX_BATCH, "batching": {"max_queue_tokens": 2}},
    )
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    """One server on the zoo; the BF16 model is in the repository but loaded only by its test (explicit mode)."""
    names = [case.name for case in CASES] + ["densenet", "densenet_batch", "rows_counted"]
    loads = [arg for name in names for arg in ("--load-model", name)]
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit", *loads]
    s = start_server(args, repo.parent / "server.log", timeout=300)
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


Outputs = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def local(repo: Path) -> Callable[[str, Outputs], Outputs]:
    """onnxruntime in process on a model of the zoo: what the server must answer."""
    sessions: dict[str, ort.InferenceSession] = {}

    def run(model: str, feeds: Outputs) -> Outputs:
        if model not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            path = str(repo / model / "1" / "model.onnx")
            sessions[model] = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        session = sessions[model]
        as_text = {k: _as_str(v) if v.dtype == np.object_ else v for k, v in feeds.items()}
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, as_text), strict=True))

    return run


def _as_str(a: np.ndarray) -> np.ndarray:
    """BYTES elements as onnxruntime takes a string tensor: str, UTF-8 decoded."""
    out = np.empty(a.shape, dtype=np.object_)
    out.reshape(-1)[:] = [x.decode() if isinstance(x, bytes) else str(x) for x in a.reshape(-1)]
    return out


def _values(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values of `datatype` in `shape`, the datatype's extremes among them (finite floats: NaN and infinity are
    refused as inputs, docs/security.md; the graphs make them)."""
    size = int(np.prod(shape))
    if datatype == "BYTES":
        return np.array(
            [STRINGS[int(i)].encode() for i in rng.integers(0, len(STRINGS), size)], dtype=np.object_
        ).reshape(shape)
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if datatype == "BOOL":
        return rng.integers(0, 2, size).astype(np.bool_).reshape(shape)
    if dtype.kind == "f":
        info = np.finfo(dtype)
        flat = (rng.standard_normal(size) * 100).astype(dtype)
        special = [info.max, -info.max, 0.0, -0.0, info.smallest_subnormal, info.tiny, -1.5]
    else:
        iinfo = np.iinfo(dtype)
        flat = rng.integers(iinfo.min, iinfo.max, size, dtype=dtype, endpoint=True)
        special = [iinfo.min, iinfo.max, 0, 1]
    picks = rng.permutation(len(special))[:size]
    flat[: len(picks)] = np.array(special, dtype=dtype)[picks]
    return flat.reshape(shape)


def _requests(case: Case, seed: int = 0) -> list[Outputs]:
    """The inputs sent to a model: values, an empty tensor (n = 0), a narrow one."""
    rng = np.random.default_rng(seed)
    out = []
    for rows, n in zip(BATCH_ROWS, WIDTHS, strict=True):
        if case.batch:
            out.append({"X": _values(case.datatype, (rows, n), rng), "W": _values(case.datatype, (rows, 3), rng)})
        else:
            out.append({"X": _values(case.datatype, (2, n), rng), "S": _values(case.datatype, (), rng)})
    return out


def _request(model: str, datatype: str, inputs: Outputs, typed: bool) -> Any:
    """A ModelInferRequest of `inputs`, in typed contents or in raw_input_contents."""
    req = protocol.ModelInferRequest(model_name=model)
    for name, a in inputs.items():
        t = req.inputs.add(name=name, datatype=datatype, shape=list(a.shape))
        if not typed:
            req.raw_input_contents.append(
                encode_bytes(a) if datatype == "BYTES" else a.astype(a.dtype.newbyteorder("<")).tobytes()
            )
        elif datatype in CONTENTS_FIELD:
            getattr(t.contents, CONTENTS_FIELD[datatype]).extend(a.reshape(-1).tolist())
        # FP16 has no typed field: the tensor goes with no contents, as a client that tried would send it
    return req


def _from_response(response: Any) -> Outputs:
    out = {}
    for t, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        shape = tuple(t.shape)
        if t.datatype == "BYTES":
            out[t.name] = decode_bytes(raw, int(np.prod(shape)), t.name).reshape(shape)
        else:
            dtype = np.dtype(NUMPY_DTYPES[t.datatype]).newbyteorder("<")
            out[t.name] = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)
    return out


class Refused(Exception):
    """The server's refusal: its status (a gRPC code's name or an HTTP status) and message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def _infer(served: RunningServer, encoding: str, model: str, datatype: str, inputs: Outputs) -> Outputs:
    """Every output of `model` for `inputs` (all of `datatype`), sent as `encoding` sends it; Refused if refused."""
    if encoding.startswith("grpc"):
        with grpc.insecure_channel(served.url) as channel:
            stub = protocol.Stub(channel)
            req = _request(model, datatype, inputs, typed=encoding == "grpc-typed")
            if encoding == "grpc-stream":
                (answer,) = list(stub.ModelStreamInfer(iter([req]), timeout=60))
                if answer.error_message:
                    code, _, message = answer.error_message.partition(": ")
                    raise Refused(code, message)
                return _from_response(answer.infer_response)
            try:
                return _from_response(stub.ModelInfer(req, timeout=60))
            except grpc.RpcError as e:
                raise Refused(e.code().name, e.details() or "") from None
    binary = encoding == "http-binary"
    with h.InferenceServerClient(served.http_url) as hc:
        tensors = []
        for name, a in inputs.items():
            t = h.InferInput(name, list(a.shape), datatype)
            t.set_data_from_numpy(a, binary_data=binary)
            tensors.append(t)
        names = [o["name"] for o in hc.get_model_metadata(model)["outputs"]]
        try:
            answer = hc.infer(model, tensors, outputs=[h.InferRequestedOutput(n, binary_data=binary) for n in names])
        except InferenceServerException as e:
            raise Refused(str(e.status()), str(e.message())) from None
        return {n: answer.as_numpy(n) for n in names}


def _same(answer: Outputs, expected: Outputs, where: str) -> None:
    """Exactly onnxruntime's outputs: the same names, datatypes, shapes, and values bit for bit (NaN where
    onnxruntime has NaN, whatever its sign or payload: JSON keeps neither)."""
    assert sorted(answer) == sorted(expected), where
    for name, want in expected.items():
        got = answer[name]
        at = f"{where}, output {name}"
        assert got.shape == want.shape, (at, got.shape, want.shape)
        if want.dtype == np.object_:
            assert got.dtype == np.object_, (at, got.dtype)
            assert [x if isinstance(x, bytes) else str(x).encode() for x in got.reshape(-1)] == [
                str(x).encode() for x in want.reshape(-1)
            ], at
            continue
        assert got.dtype == want.dtype, (at, got.dtype, want.dtype)
        if want.dtype.kind == "f":
            nan = np.isnan(want)
            assert (np.isnan(got) == nan).all(), (at, got, want)
            got, want = got[~nan], want[~nan]
        assert got.tobytes() == want.tobytes(), (at, got, want)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_datatype_and_encoding_answers_as_onnxruntime(
    served: RunningServer, local: Callable[[str, Outputs], Outputs], case: Case, encoding: str
) -> None:
    for k, inputs in enumerate(_requests(case)):
        where = f"{case.name} over {encoding}, request {k} ({ {n: a.shape for n, a in inputs.items()} })"
        if (case.datatype, encoding) in REFUSED:
            with pytest.raises(Refused) as e:
                _infer(served, encoding, case.name, case.datatype, inputs)
            assert e.value.status == "INVALID_ARGUMENT", where
            assert REFUSED[(case.datatype, encoding)] in e.value.message, (where, e.value.message)
            continue
        _same(_infer(served, encoding, case.name, case.datatype, inputs), local(case.name, inputs), where)


@pytest.mark.parametrize("model", ["fp32_batch", "bytes_batch", "bool_batch", "uint64_batch", "fp16_batch"])
def test_concurrent_requests_stacked_into_batches_each_get_their_own_rows(
    served: RunningServer, local: Callable[[str, Outputs], Outputs], model: str
) -> None:
    """Requests of 1-3 rows at once, over a stream (read as they come, so they batch together) and from threads:
    stacking and cutting back keep every datatype's rows exact."""
    datatype = model.split("_")[0].upper()
    rng = np.random.default_rng(17)
    requests = [
        {"X": _values(datatype, (rows, 4), rng), "W": _values(datatype, (rows, 3), rng)} for rows in (1, 2, 3) * 6
    ]
    sent = []
    for k, inputs in enumerate(requests):
        sent.append(_request(model, datatype, inputs, typed=False))
        sent[-1].id = str(k)
    with grpc.insecure_channel(served.url) as channel:
        replies = list(protocol.Stub(channel).ModelStreamInfer(iter(sent), timeout=60))
    assert [r.error_message for r in replies] == [""] * len(requests)
    streamed = {int(r.infer_response.id): _from_response(r.infer_response) for r in replies}
    with ThreadPoolExecutor(6) as pool:
        threaded = list(pool.map(lambda x: _infer(served, "grpc-raw", model, datatype, x), requests))
    for k, inputs in enumerate(requests):
        _same(streamed[k], local(model, inputs), f"{model}, request {k} of {len(requests)} on one stream")
    for k, (inputs, answer) in enumerate(zip(requests, threaded, strict=True)):
        _same(answer, local(model, inputs), f"{model}, request {k} of {len(requests)} at once")


@pytest.mark.parametrize("encoding", ["grpc", "http"])
def test_an_image_model_without_a_sequence_axis_is_served_with_the_default_queue_limits(
    served: RunningServer, local: Callable[[str, Outputs], Outputs], encoding: str
) -> None:
    """A densenet-shaped input (FP32 [3, 224, 224], 150,528 elements) counts one token a row, not its elements:
    the default max_queue_tokens (32,768) takes it, with or without a batch axis."""
    rng = np.random.default_rng(23)
    for model, shape in (("densenet", IMAGE), ("densenet_batch", (2, *IMAGE))):
        x = rng.standard_normal(shape).astype(np.float32)
        answer = _infer(served, "grpc-raw" if encoding == "grpc" else "http-binary", model, "FP32", {"x": x})
        _same(answer, local(model, {"x": x}), f"{model} over {encoding}")
        assert answer["y"].shape == (*shape[:-3], CLASSES)


def test_a_request_without_a_sequence_axis_counts_its_rows_against_max_queue_tokens(
    served: RunningServer, local: Callable[[str, Outputs], Outputs]
) -> None:
    """rows_counted: max_queue_tokens 2. Two rows of any width fit; three never can, and the refusal says so."""
    rng = np.random.default_rng(29)
    wide = {"X": _values("FP32", (2, 5000), rng), "W": _values("FP32", (2, 3), rng)}
    _same(_infer(served, "grpc-raw", "rows_counted", "FP32", wide), local("rows_counted", wide), "2 rows")
    three = {"X": _values("FP32", (3, 1), rng), "W": _values("FP32", (3, 3), rng)}
    with pytest.raises(Refused) as e:
        _infer(served, "grpc-raw", "rows_counted", "FP32", three)
    assert e.value.status == "INVALID_ARGUMENT"
    assert "one request of 3 tokens can never fit max_queue_tokens 2" in e.value.message, e.value.message


def _post(served: RunningServer, model: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{served.http_url}/v2/models/{model}/infer", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


BF16_REFUSAL = "input 'X': datatype BF16 is not served: onnxruntime's Python API takes and gives no bfloat16 arrays"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_bf16_is_refused_naming_the_input_and_the_datatype(served: RunningServer, encoding: str) -> None:
    """BF16: no typed contents field, no JSON form (Triton's clients refuse it) and no numpy type onnxruntime's
    Python API takes or gives, so none of the zoo's encodings carries it: INVALID_ARGUMENT, whatever the model."""
    raw = np.zeros(2 * 3, dtype=np.uint16).tobytes()  # bfloat16 zeros
    if encoding.startswith("grpc"):
        req = protocol.ModelInferRequest(model_name="fp32_nobatch")
        req.inputs.add(name="X", datatype="BF16", shape=[2, 3])
        if encoding != "grpc-typed":
            req.raw_input_contents.append(raw)
        with grpc.insecure_channel(served.url) as channel:
            stub = protocol.Stub(channel)
            if encoding == "grpc-stream":
                (reply,) = list(stub.ModelStreamInfer(iter([req]), timeout=60))
                status, message = reply.error_message.partition(": ")[::2]
            else:
                with pytest.raises(grpc.RpcError) as e:
                    stub.ModelInfer(req, timeout=60)
                status, message = e.value.code().name, e.value.details() or ""
        assert status == "INVALID_ARGUMENT"
    else:
        tensor: dict[str, Any] = {"name": "X", "datatype": "BF16", "shape": [2, 3]}
        if encoding == "http-json":
            header = json.dumps({"inputs": [tensor | {"data": [0.0] * 6}]}).encode()
            code, message = _post(served, "fp32_nobatch", header, {})
        else:
            header = json.dumps({"inputs": [tensor | {"parameters": {"binary_data_size": len(raw)}}]}).encode()
            code, message = _post(
                served, "fp32_nobatch", header + raw, {"Inference-Header-Content-Length": str(len(header))}
            )
        assert code == 400
    assert BF16_REFUSAL in message, message


def test_a_graph_with_a_bf16_tensor_is_refused_at_load_naming_it(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as gc:
        with pytest.raises(InferenceServerException) as e:
            gc.load_model("bf16")
        assert not gc.is_model_ready("bf16")
        assert gc.is_model_ready("fp32_batch")  # the others go on serving
    assert "input 'x' is tensor(bfloat16): datatype BF16 is not served" in str(e.value.message()), e.value.message()


def test_out_of_range_values_are_refused_naming_the_input_and_datatype(served: RunningServer) -> None:
    """What the zoo's typed and JSON encodings cannot carry into a datatype: a value outside its range."""
    cases = [
        ("int8_nobatch", "INT8", 128, "value 128 in contents.int_contents is outside INT8 [-128, 127]"),
        ("uint16_nobatch", "UINT16", 65536, "value 65536 in contents.uint_contents is outside UINT16 [0, 65535]"),
    ]
    for model, datatype, bad, said in cases:
        req = protocol.ModelInferRequest(model_name=model)
        x = req.inputs.add(name="X", datatype=datatype, shape=[2, 1])
        getattr(x.contents, CONTENTS_FIELD[datatype]).extend([0, bad])
        s = req.inputs.add(name="S", datatype=datatype, shape=[])
        getattr(s.contents, CONTENTS_FIELD[datatype]).extend([0])
        with grpc.insecure_channel(served.url) as channel, pytest.raises(grpc.RpcError) as e:
            protocol.Stub(channel).ModelInfer(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"input 'X': {said}" in (e.value.details() or "")
    for datatype, data, said in [
        ("UINT64", [2**64, 1], "value 18446744073709551616 is outside UINT64 [0, 18446744073709551615]"),
        ("UINT64", [2**63, -1], "value -1 is outside UINT64 [0, 18446744073709551615]"),
        ("INT64", [2**63, 1], "value 9223372036854775808 is outside INT64 [-9223372036854775808, 9223372036854775807]"),
        ("UINT64", [2**63, 1.5], "UINT64 data cannot hold numbers with a fraction"),
    ]:
        model = f"{datatype.lower()}_nobatch"
        body = {
            "inputs": [
                {"name": "X", "datatype": datatype, "shape": [2, 1], "data": data},
                {"name": "S", "datatype": datatype, "shape": [], "data": [0]},
            ]
        }
        code, message = _post(served, model, json.dumps(body).encode(), {})
        assert (code, f"input 'X': {said}" in message) == (400, True), (code, message)


# The property: drawn shapes and values of a few datatypes, over any encoding, answer as onnxruntime does.
PROPERTY_DATATYPES = ["INT32", "UINT8", "INT64", "FP32", "FP16", "BOOL", "BYTES"]


@st.composite
def drawn_requests(draw: st.DrawFn) -> tuple[Case, str, Outputs]:
    datatype = draw(st.sampled_from(PROPERTY_DATATYPES))
    case = Case(datatype, draw(st.booleans()))
    encoding = draw(st.sampled_from([e for e in ENCODINGS if (datatype, e) not in REFUSED]))
    rows, n = (draw(st.integers(1, MAX_BATCH)) if case.batch else 2), draw(st.integers(0, 6))
    shapes = {"X": (rows, n), "W" if case.batch else "S": (rows, 3) if case.batch else ()}
    return case, encoding, {name: draw(_arrays(datatype, shape)) for name, shape in shapes.items()}


def _arrays(datatype: str, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    size = int(np.prod(shape))
    if datatype == "BYTES":
        text = st.text(st.characters(codec="utf-8"), max_size=8).map(str.encode)
        return st.lists(text, min_size=size, max_size=size).map(lambda v: np.array(v, dtype=np.object_).reshape(shape))
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    if datatype == "BOOL":
        elements: st.SearchStrategy[Any] = st.booleans()
    elif dtype.kind == "f":
        elements = st.floats(width=8 * dtype.itemsize, allow_nan=False, allow_infinity=False)
    else:
        info = np.iinfo(dtype)
        elements = st.integers(int(info.min), int(info.max))
    return st.lists(elements, min_size=size, max_size=size).map(lambda v: np.array(v, dtype=dtype).reshape(shape))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=drawn_requests())
def test_drawn_shapes_and_values_answer_as_onnxruntime(
    served: RunningServer, local: Callable[[str, Outputs], Outputs], drawn: tuple[Case, str, Outputs]
) -> None:
    case, encoding, inputs = drawn
    where = f"{case.name} over {encoding}: { {n: a.shape for n, a in inputs.items()} }"
    _same(_infer(served, encoding, case.name, case.datatype, inputs), local(case.name, inputs), where)
