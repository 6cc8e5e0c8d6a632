"""Input limits and a property test: any ModelInferRequest gets a designed gRPC status, and the server stays up.

One real server for the module, on the shipped models plus `scale`, a small FP32 tensor model
(so that non-finite floats reach a model that takes floats). Requests are built with
`service.protocol` classes from random parts: model names (served and not), datatypes (real and
made up), shapes (negative, zero, huge, too many dimensions), raw contents of right and wrong
sizes, typed contents in the right and the wrong field, invalid UTF-8, unknown input and output
names, random parameters, and near-valid requests so that the model paths run too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import protocol
from service.datatypes import NUMPY_DTYPES, encode_bytes
from service.frontends.grpc_codec import CONTENTS_FIELD
from service.tools.client import g2p_outputs, g2p_request
from tests.conftest import MODELS, RunningServer, scale_model, start_server, stop_server

ALLOWED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
TIMEOUT = 60.0  # a call that takes this long counts as a hang (a busy machine answers well within it)
SHORT = 0.005  # some requests get a deadline this short: DEADLINE_EXCEEDED is then a fine answer
DATATYPES = [*NUMPY_DTYPES, "WEIRD", "", "int64", "FP8"]
MODEL_NAMES = ["g2p", "g2p_encoder", "scale"] * 3 + ["unknown", "", "g2p "]
INPUT_NAMES = ["TEXT", "input_ids", "attention_mask", "x", "nope", ""]
OUTPUT_NAMES = ["PHONEMES", "ATTENTION", "last_hidden_state", "y", "nope", ""]
HUGE = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1]
WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz'-.", min_size=1, max_size=12)
SEEN: Counter[str] = Counter()
BIG_AND_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]  # real requests


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("fuzz")
    repo = d / "models"
    repo.mkdir()
    for name in ("g2p", "g2p_encoder"):
        (repo / name).symlink_to(MODELS / name, target_is_directory=True)
    scale_model(repo / "scale")
    s = start_server(["--model-repository", str(repo)], d / "server.log")
    yield s
    stop_server(s)


dims = st.one_of(
    st.integers(0, 4),
    st.integers(1, 3),
    st.integers(-3, -1),
    st.sampled_from(HUGE),
    st.integers(-(2**63), 2**63 - 1),
)
shapes = st.one_of(
    st.lists(dims, max_size=4),
    st.lists(dims, min_size=1, max_size=2),
    st.lists(st.just(1), min_size=30, max_size=70),  # too many dimensions (numpy stops at 64)
)


def _count(shape: list[int]) -> int | None:
    n = 1
    for d in shape:
        n *= d
    return n if 0 <= n <= 4096 and all(d >= 0 for d in shape) else None


@st.composite
def contents(draw: st.DrawFn, datatype: str, shape: list[int]) -> tuple[str, object]:
    """('raw', bytes) | ('typed', (field, values)) | ('none', None), sized right or wrong."""
    n = _count(shape)
    kind = draw(st.sampled_from(["raw", "typed", "typed", "none"]))
    if kind == "none":
        return "none", None
    size = n if n is not None and draw(st.integers(0, 3)) else draw(st.integers(0, 40))
    if kind == "raw":
        if datatype == "BYTES" and draw(st.booleans()):
            elements = draw(st.lists(st.binary(max_size=12), min_size=size, max_size=size))
            raw = encode_bytes(np.array(elements, dtype=object)) if elements else b""
            return "raw", raw + draw(st.sampled_from([b"", b"\x01", b"\xff\xff\xff\x7f"]))
        itemsize = np.dtype(NUMPY_DTYPES.get(datatype, np.int64)).itemsize
        length = size * itemsize + draw(st.sampled_from([0, 0, 0, 1, -1]))
        return "raw", draw(st.binary(min_size=max(0, length), max_size=max(0, length)))
    field = CONTENTS_FIELD.get(datatype) if draw(st.booleans()) else None
    field = field or draw(st.sampled_from(sorted(set(CONTENTS_FIELD.values()))))
    values: list[object]
    if field == "bytes_contents":
        values = draw(st.lists(st.binary(max_size=16), min_size=size, max_size=size))
    elif field == "bool_contents":
        values = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    elif field in ("fp32_contents", "fp64_contents"):
        values = draw(st.lists(st.floats(width=32), min_size=size, max_size=size))
    else:
        low, high = {
            "int_contents": (-(2**31), 2**31 - 1),
            "int64_contents": (-(2**63), 2**63 - 1),
            "uint_contents": (0, 2**32 - 1),
            "uint64_contents": (0, 2**64 - 1),
        }[field]
        small = st.integers(max(low, -2), 40)
        values = draw(st.lists(st.one_of(st.integers(low, high), small), min_size=size, max_size=size))
    return "typed", (field, values)


@st.composite
def junk_requests(draw: st.DrawFn) -> object:
    req = protocol.ModelInferRequest(
        model_name=draw(st.sampled_from(MODEL_NAMES)),
        model_version=draw(st.sampled_from(["", "", "1", "2", "x"])),
        id=draw(st.text(max_size=8)),
    )
    raws: list[bytes] = []
    for _ in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(shapes)
        t = req.inputs.add(name=draw(st.sampled_from(INPUT_NAMES)), datatype=datatype, shape=shape)
        kind, value = draw(contents(datatype, shape))
        if kind == "raw":
            raws.append(value)  # type: ignore[arg-type]
        elif kind == "typed":
            field, values = value  # type: ignore[misc]
            getattr(t.contents, field).extend(values)
    if raws:
        extra = draw(st.sampled_from([0, 0, 0, 1, -1]))  # sometimes one raw_input_contents too many or few
        raws = raws + [b"\x00" * 8] * extra if extra >= 0 else raws[:extra]
        req.raw_input_contents.extend(raws)
    _decorate(draw, req)
    return req


def _decorate(draw: st.DrawFn, req: object) -> None:
    """Random outputs and parameters."""
    for name in draw(st.lists(st.sampled_from(OUTPUT_NAMES), max_size=3)):
        req.outputs.add(name=name)  # type: ignore[attr-defined]
    for key in draw(st.lists(st.sampled_from(["beam_size", "max_output_length", "x", ""]), max_size=2)):
        p = req.parameters[key]  # type: ignore[attr-defined]
        which = draw(st.sampled_from(["bool_param", "int64_param", "string_param", "double_param", "uint64_param"]))
        value = {
            "bool_param": st.booleans(),
            "int64_param": st.one_of(st.integers(-2, 10), st.integers(-(2**63), 2**63 - 1)),
            "string_param": st.text(max_size=5),
            "double_param": st.floats(),
            "uint64_param": st.one_of(st.integers(0, 10), st.integers(0, 2**64 - 1)),
        }[which]
        setattr(p, which, draw(value))


@st.composite
def near_valid_g2p(draw: st.DrawFn) -> object:
    """TEXT elements of a few words, some with invalid UTF-8, odd characters, too long, raw or typed."""
    element = st.one_of(
        st.lists(WORD, min_size=1, max_size=3).map(lambda ws: " ".join(ws).encode()),
        st.binary(max_size=20),  # invalid UTF-8 and control characters
        st.text(max_size=12).map(str.encode),  # unicode the model cannot spell
        st.just(b"a" * 40),
        st.just(b"x " * 70),
    )
    elements = draw(st.lists(element, min_size=1, max_size=4))
    req = protocol.ModelInferRequest(model_name="g2p")
    t = req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(elements)])
    if draw(st.booleans()):
        req.raw_input_contents.append(encode_bytes(np.array(elements, dtype=object)))
    else:
        t.contents.bytes_contents.extend(elements)
    _decorate(draw, req)
    return req


@st.composite
def near_valid_encoder(draw: st.DrawFn) -> object:
    """input_ids / attention_mask of random (mostly small) shapes, ids in and out of the vocabulary."""
    batch = draw(st.one_of(st.integers(0, 4), st.just(65)))
    seq = draw(st.one_of(st.integers(0, 24), st.sampled_from([512, 513])))
    if batch * seq > 4096:
        batch = 1
    ids = draw(st.sampled_from(["in", "edge", "out"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    high = {"in": 33, "edge": 34, "out": 2**40}[ids]
    input_ids = rng.integers(-1 if ids == "out" else 0, high, size=(batch, seq), dtype=np.int64)
    mask_seq = seq if draw(st.integers(0, 9)) else seq + 1
    mask = rng.integers(0, 2, size=(batch, mask_seq), dtype=np.int64)
    req = protocol.ModelInferRequest(model_name="g2p_encoder")
    names = ["input_ids", "attention_mask"]
    if draw(st.integers(0, 9)) == 0:
        names = draw(st.permutations(["input_ids", "attention_mask", "input_ids"]))[:2]  # duplicates, missing
    for name in names:
        req.inputs.add(name=name, datatype="INT64", shape=[batch, seq if name == "input_ids" else mask_seq])
    req.raw_input_contents.extend([input_ids.tobytes(), mask.tobytes()])
    _decorate(draw, req)
    return req


@st.composite
def near_valid_scale(draw: st.DrawFn) -> object:
    """x FP32 [batch, 3 or not], floats including NaN and infinities, raw or typed."""
    batch, width = draw(st.integers(0, 3)), draw(st.sampled_from([3, 3, 3, 2, 4]))
    values = draw(st.lists(st.floats(width=32), min_size=batch * width, max_size=batch * width))
    req = protocol.ModelInferRequest(model_name="scale")
    t = req.inputs.add(name="x", datatype="FP32", shape=[batch, width])
    if draw(st.booleans()):
        req.raw_input_contents.append(np.array(values, dtype=np.float32).tobytes())
    else:
        t.contents.fp32_contents.extend(values)
    _decorate(draw, req)
    return req


requests = st.one_of(junk_requests(), near_valid_g2p(), near_valid_encoder(), near_valid_scale())


def _call(stub: protocol.Stub, request: object, timeout: float) -> tuple[str, str, object]:
    try:
        return "OK", "", stub.ModelInfer(request, timeout=timeout)  # type: ignore[attr-defined]
    except grpc.RpcError as e:
        return e.code().name, e.details() or "", None


def test_every_request_gets_a_designed_status_and_the_server_survives(fuzz_server: RunningServer) -> None:
    channel = grpc.insecure_channel(fuzz_server.url)
    stub = protocol.Stub(channel)
    slowest = [0.0]

    @settings(
        max_examples=1500,
        deadline=None,
        database=None,
        suppress_health_check=BIG_AND_SLOW,
    )
    @given(request=requests, short=st.integers(0, 19))
    def check(request: object, short: int) -> None:
        timeout = SHORT if short == 0 else TIMEOUT
        t0 = time.perf_counter()
        code, details, reply = _call(stub, request, timeout)
        elapsed = time.perf_counter() - t0
        slowest[0] = max(slowest[0], elapsed if timeout == TIMEOUT else 0.0)
        SEEN[code] += 1
        assert code in ALLOWED, f"{code}: {details}\n{request}"
        if code == "DEADLINE_EXCEEDED":
            assert timeout == SHORT, f"a {TIMEOUT} s call ran out of time (a hang?): {details}\n{request}"
        if code == "OK":
            assert reply is not None and len(reply.outputs) == len(reply.raw_output_contents) >= 1  # type: ignore[attr-defined]
        elif code != "DEADLINE_EXCEEDED":
            assert details, f"{code} without a message\n{request}"

    try:
        check()
        # the server is alive and still answers a valid request correctly
        assert fuzz_server.process.poll() is None
        reply = stub.ModelInfer(g2p_request(["hello", "world"]), timeout=TIMEOUT)
        assert len(g2p_outputs(reply)["PHONEMES"]) == 2 and all(g2p_outputs(reply)["PHONEMES"])
        log = fuzz_server.output()
        assert not any(w in log for w in ("Traceback", "failed on this batch", "failed alone", "retried in halves")), (
            log[-3000:]
        )
    finally:
        channel.close()
    total = sum(SEEN.values())
    print(f"\nfuzz: {total} requests, codes {dict(SEEN)}, slowest answer {slowest[0] * 1e3:.0f} ms")
    assert total >= 300
    assert SEEN["OK"] > 0 and SEEN["INVALID_ARGUMENT"] > 0 and SEEN["NOT_FOUND"] > 0  # the mix reached every path


def test_every_request_on_a_stream_is_answered_once_with_a_designed_status(fuzz_server: RunningServer) -> None:
    """The same requests, a few at a time on one ModelStreamInfer stream: one answer each, found by id,
    an OK response or an error_message that starts with a designed status; the stream never breaks."""
    channel = grpc.insecure_channel(fuzz_server.url)
    stub = protocol.Stub(channel)
    codes: Counter[str] = Counter()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=BIG_AND_SLOW)
    @given(batch=st.lists(requests, min_size=1, max_size=12))
    def check(batch: list[object]) -> None:
        sent = []
        for i, request in enumerate(batch):
            copy = protocol.ModelInferRequest()
            copy.CopyFrom(request)  # type: ignore[arg-type]
            copy.id = str(i)
            sent.append(copy)
        answers = list(stub.ModelStreamInfer(iter(sent), timeout=TIMEOUT * 3))
        assert sorted(int(a.infer_response.id) for a in answers) == list(range(len(sent)))
        for a in answers:
            code = a.error_message.split(":", 1)[0] if a.error_message else "OK"
            codes[code] += 1
            assert code in ALLOWED - {"DEADLINE_EXCEEDED"}, f"{a.error_message}\n{sent[int(a.infer_response.id)]}"
            if code == "OK":
                assert len(a.infer_response.outputs) == len(a.infer_response.raw_output_contents) >= 1

    try:
        check()
        assert fuzz_server.process.poll() is None
        log = fuzz_server.output()
        assert not any(w in log for w in ("Traceback", "failed on this batch", "failed alone", "retried in halves")), (
            log[-3000:]
        )
    finally:
        channel.close()
    print(f"\nstream fuzz: {sum(codes.values())} requests, codes {dict(codes)}")
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0


def test_the_strategies_build_valid_protobuf(tmp_path: Path) -> None:
    """Sanity: a generated request survives serialisation (so the server sees what was drawn)."""

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(request=requests)
    def roundtrip(request: object) -> None:
        data = request.SerializeToString()  # type: ignore[attr-defined]
        assert protocol.ModelInferRequest.FromString(data) == request

    roundtrip()


# --- each limit, one by one: INVALID_ARGUMENT with a precise message, before anything is queued ----


def _tensor(model: str, *tensors: tuple[str, str, list[int], bytes | None]) -> object:
    req = protocol.ModelInferRequest(model_name=model)
    for name, datatype, shape, raw in tensors:
        req.inputs.add(name=name, datatype=datatype, shape=shape)
        if raw is not None:
            req.raw_input_contents.append(raw)
    return req


def _encoder(ids: np.ndarray, mask: np.ndarray | None = None) -> object:
    mask = np.ones_like(ids) if mask is None else mask
    return _tensor(
        "g2p_encoder",
        ("input_ids", "INT64", list(ids.shape), ids.tobytes()),
        ("attention_mask", "INT64", list(mask.shape), mask.tobytes()),
    )


def _text(*elements: bytes, typed: bool = False) -> object:
    req = protocol.ModelInferRequest(model_name="g2p")
    t = req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(elements)])
    if typed:
        t.contents.bytes_contents.extend(elements)
    else:
        req.raw_input_contents.append(encode_bytes(np.array(elements, dtype=object)))
    return req


def _typed(model: str, name: str, datatype: str, shape: list[int], field: str, values: list[object]) -> object:
    req = protocol.ModelInferRequest(model_name=model)
    getattr(req.inputs.add(name=name, datatype=datatype, shape=shape).contents, field).extend(values)
    return req


def _twice() -> object:
    req = _text(b"a", typed=True)
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"b")  # type: ignore[attr-defined]
    return req


def _both() -> object:
    req = _typed("g2p_encoder", "input_ids", "INT64", [1, 1], "int64_contents", [5])
    req.raw_input_contents.append(np.ones(1, np.int64).tobytes())  # type: ignore[attr-defined]
    return req


I64 = np.int64
LIMITS = [
    ("max batch", _encoder(np.full((65, 3), 5, I64)), "batch of 65 exceeds model 'g2p_encoder' max_batch_size 64"),
    (
        "sequence length",
        _encoder(np.full((1, 513), 5, I64)),
        "sequence length 513 exceeds model 'g2p_encoder' limit of 512",
    ),
    ("empty sequence", _encoder(np.zeros((1, 0), I64)), "input 'input_ids': shape [1, 0] has no elements"),
    ("empty batch", _encoder(np.zeros((0, 3), I64)), "the batch dimension (axis 0) is 0"),
    (
        "token id too big",
        _encoder(np.array([[5, 33, 6]], I64)),
        "input 'input_ids': token id 33 outside the vocabulary [0, 33)",
    ),
    (
        "token id negative",
        _encoder(np.array([[5, -1]], I64)),
        "input 'input_ids': token id -1 outside the vocabulary [0, 33)",
    ),
    ("lengths disagree", _encoder(np.ones((1, 3), I64), np.ones((1, 4), I64)), "disagree on the sequence length"),
    ("words per request", _text(b"a " * 65), "input 'TEXT': 65 words in one request, the limit is 64"),
    ("words over elements", _text(*[b"a b c"] * 22), "input 'TEXT': 66 words in one request, the limit is 64"),
    ("bytes per element", _text(b"a" * 1025), "input 'TEXT' element 0: 1025 bytes, the limit is 1024"),
    (
        "words read out",
        _text(b"cat", b"1" * 300),
        "input 'TEXT': its words read as more than 256 words (numbers spelled out), "
        "the limit is 256 (4 x max_words 64)",
    ),
    ("invalid UTF-8", _text(b"ok", b"a\xff", typed=True), "input 'TEXT' element 1 is not valid UTF-8 (byte 1)"),
    ("control character", _text(b"a\x07b"), "cannot spell character '\\x07' (U+0007) in 'a\\x07b'"),
    ("empty element", _text(b" ... "), "input 'TEXT' element 0 is empty"),
    (
        "NaN",
        _typed("scale", "x", "FP32", [1, 3], "fp32_contents", [1.0, float("nan"), 2.0]),
        "input 'x': contains NaN or infinite values",
    ),
    (
        "infinity raw",
        _tensor("scale", ("x", "FP32", [1, 3], np.array([[1, np.inf, 2]], np.float32).tobytes())),
        "input 'x': contains NaN or infinite values",
    ),
    (
        "fixed dimension",
        _tensor("scale", ("x", "FP32", [1, 4], np.ones((1, 4), np.float32).tobytes())),
        "input 'x': dimension 1 is 4, model 'scale' expects 3",
    ),
    (
        "huge shape, no data",
        _tensor("g2p_encoder", ("input_ids", "INT64", [2**40], None)),
        "input 'input_ids': shape [1099511627776] exceeds the limit of 16777216 elements",
    ),
    (
        "huge product",
        _tensor("g2p_encoder", ("input_ids", "INT64", [2**20, 2**20], None)),
        "exceeds the limit of 16777216 elements",
    ),
    (
        "zero times huge",
        _tensor("g2p_encoder", ("input_ids", "INT64", [0, 2**62], b"")),
        "exceeds the limit of 16777216 elements (zero dimensions aside)",
    ),
    (
        "negative dimension",
        _tensor("g2p_encoder", ("input_ids", "INT64", [-1, 3], None)),
        "input 'input_ids': negative dimension in shape [-1, 3]",
    ),
    (
        "too many dimensions",
        _tensor("g2p_encoder", ("input_ids", "INT64", [1] * 65, I64(5).tobytes())),
        "input 'input_ids': shape has 65 dimensions, the limit is 32",
    ),
    (
        "raw too short",
        _tensor("g2p_encoder", ("input_ids", "INT64", [1, 4], b"\x00" * 31)),
        "input 'input_ids': raw contents are 31 bytes, shape [1, 4] of INT64 needs 32",
    ),
    ("raw too long", _tensor("g2p_encoder", ("input_ids", "INT64", [1, 4], b"\x00" * 33)), "raw contents are 33 bytes"),
    (
        "raw BYTES cut",
        _tensor("g2p", ("TEXT", "BYTES", [1], b"\x05\x00\x00\x00abc")),
        "input 'TEXT': raw BYTES element of 5 bytes runs past the end",
    ),
    (
        "raw BYTES left over",
        _tensor("g2p", ("TEXT", "BYTES", [1], b"\x01\x00\x00\x00ab")),
        "input 'TEXT': 1 bytes left over after 1 BYTES elements",
    ),
    (
        "raw BYTES huge count",
        _tensor("g2p", ("TEXT", "BYTES", [2**24], b"")),
        "input 'TEXT': shape [16777216] exceeds the limit of 64 BYTES elements: model 'g2p' takes at most max_words 64",
    ),
    (
        "typed count",
        _typed("g2p_encoder", "input_ids", "INT64", [1, 4], "int64_contents", [1, 2, 3]),
        "input 'input_ids': 3 values in contents.int64_contents, shape [1, 4] needs 4",
    ),
    (
        "typed in the wrong field",
        _typed("g2p_encoder", "input_ids", "INT64", [1, 2], "int_contents", [1, 2]),
        "0 values in contents.int64_contents",
    ),
    (
        "UINT8 out of range",
        _typed("g2p", "TEXT", "UINT8", [2], "uint_contents", [1, 300]),
        "input 'TEXT': value 300 in contents.uint_contents is outside UINT8 [0, 255]",
    ),
    (
        "INT8 out of range",
        _typed("g2p", "TEXT", "INT8", [1], "int_contents", [-129]),
        "value -129 in contents.int_contents is outside INT8 [-128, 127]",
    ),
    (
        "FP16 typed",
        _typed("g2p", "TEXT", "FP16", [1], "fp32_contents", [1.0]),
        "input 'TEXT': FP16 travels only in raw_input_contents",
    ),
    ("unknown datatype", _tensor("g2p", ("TEXT", "STRING", [1], None)), "input 'TEXT': unknown datatype 'STRING'"),
    (
        "wrong datatype",
        _typed("g2p_encoder", "input_ids", "INT32", [1, 1], "int_contents", [5]),
        "input 'input_ids': datatype INT32, model 'g2p_encoder' expects INT64",
    ),
    ("duplicate input", _twice(), "input 'TEXT' given twice"),
    (
        "raw count",
        _tensor(
            "g2p_encoder", ("input_ids", "INT64", [1, 1], I64(5).tobytes()), ("attention_mask", "INT64", [1, 1], None)
        ),
        "1 raw_input_contents for 2 inputs: give one per input",
    ),
    ("raw and typed", _both(), "contents field must not be specified when using raw_input_contents for 'input_ids'"),
    (
        "unknown input",
        _tensor("g2p", ("WORDS", "BYTES", [1], encode_bytes(np.array([b"a"], object)))),
        "model 'g2p' has no input 'WORDS' (inputs: TEXT)",
    ),
    (
        "missing input",
        _tensor("g2p_encoder", ("input_ids", "INT64", [1, 1], I64(5).tobytes())),
        "model 'g2p_encoder': missing input 'attention_mask'",
    ),
]


def _executions(stub: protocol.Stub) -> dict[str, int]:
    stats = stub.ModelStatistics(protocol.ModelStatisticsRequest(), timeout=TIMEOUT)
    return {m.name: m.execution_count + m.inference_count for m in stats.model_stats}


def test_each_limit_is_refused_with_a_precise_message_before_anything_runs(fuzz_server: RunningServer) -> None:
    with grpc.insecure_channel(fuzz_server.url) as channel:
        stub = protocol.Stub(channel)
        before = _executions(stub)
        for case, request, message in LIMITS:
            code, details, _ = _call(stub, request, TIMEOUT)
            assert (code, case) == ("INVALID_ARGUMENT", case), details
            assert message in details, (case, details)
        assert _executions(stub) == before  # refused before anything ran: no model executed for any of them
        # the same requests, made valid, do run: the limits are not simply refusing everything
        assert _call(stub, _encoder(np.full((64, 3), 5, I64)), TIMEOUT)[0] == "OK"
        assert _call(stub, _encoder(np.full((1, 512), 32, I64)), TIMEOUT)[0] == "OK"
        assert _call(stub, _text(b"a " * 64), TIMEOUT)[0] == "OK"
        assert _call(stub, _typed("scale", "x", "FP32", [1, 3], "fp32_contents", [1.0, 2.0, 3.0]), TIMEOUT)[0] == "OK"
        assert _executions(stub) != before
