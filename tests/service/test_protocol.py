"""The v2 protocol through tritonclient (sync and asyncio), health and reflection, on a real server."""

from __future__ import annotations

import asyncio
import struct

import grpc
import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.grpc.aio as ga
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> g.InferenceServerClient:
    return g.InferenceServerClient(server.url)


def text_input(words: list[str], shape: list[int] | None = None) -> g.InferInput:
    x = g.InferInput("TEXT", shape or [len(words)], "BYTES")
    x.set_data_from_numpy(np.array([w.encode() for w in words], dtype=object).reshape(shape or [len(words)]))
    return x


def encoder_inputs(ids: np.ndarray, mask: np.ndarray | None = None) -> list[g.InferInput]:
    mask = np.ones_like(ids) if mask is None else mask
    a = g.InferInput("input_ids", list(ids.shape), "INT64")
    a.set_data_from_numpy(ids)
    b = g.InferInput("attention_mask", list(mask.shape), "INT64")
    b.set_data_from_numpy(mask)
    return [a, b]


def status_of(fn) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    try:
        fn()
    except InferenceServerException as e:
        return str(e.status()).replace("StatusCode.", ""), e.message()
    return "OK", ""


def test_server_and_model_metadata(client: g.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "qkv" and "statistics" in meta.extensions
    for name in ("g2p", "g2p_encoder"):
        assert client.is_model_ready(name)
    m = client.get_model_metadata("g2p_encoder")
    assert [i.name for i in m.inputs] == ["input_ids", "attention_mask"]
    assert [i.datatype for i in m.inputs] == ["INT64", "INT64"]
    assert list(m.inputs[0].shape) == [-1, -1]
    assert "CPUExecutionProvider" in m.platform
    g2p = client.get_model_metadata("g2p")
    assert [o.name for o in g2p.outputs] == ["PHONEMES", "ATTENTION", "WORDS", "REASONS", "SOURCES", "VARIANTS"]
    assert not client.is_model_ready("nope")


def test_model_config_and_statistics_extensions(client: g.InferenceServerClient) -> None:
    cfg = client.get_model_config("g2p_encoder").config
    assert cfg.max_batch_size == 64 and [i.name for i in cfg.input] == ["input_ids", "attention_mask"]
    assert cfg.parameters["provider"].string_value == "CPUExecutionProvider"
    before = client.get_inference_statistics("g2p_encoder").model_stats[0].inference_stats.success.count
    client.infer("g2p_encoder", encoder_inputs(np.full((2, 5), 7, np.int64)))
    after = client.get_inference_statistics("g2p_encoder").model_stats[0]
    assert after.inference_stats.success.count == before + 1
    assert after.execution_count >= 1 and after.inference_stats.compute_infer.ns > 0


def test_g2p_typed_and_raw_bytes_agree(client: g.InferenceServerClient, server: RunningServer) -> None:
    words = ["hello", "world", "Attention,", "transformer"]
    raw = client.infer("g2p", [text_input(words)], outputs=[g.InferRequestedOutput("PHONEMES")])
    phonemes = [p.decode() for p in raw.as_numpy("PHONEMES")]
    assert all(p and all(s.isupper() or s[-1].isdigit() for s in p.split()) for p in phonemes)
    # The same request with typed bytes_contents, through the raw stubs.
    from service import protocol

    req = protocol.ModelInferRequest(model_name="g2p")
    t = req.inputs.add(name="TEXT", datatype="BYTES", shape=[len(words)])
    t.contents.bytes_contents.extend(w.encode() for w in words)
    with grpc.insecure_channel(server.url) as ch:
        resp = protocol.Stub(ch).ModelInfer(req, timeout=10)
    count = resp.outputs[0].shape[0]
    data, out, off = resp.raw_output_contents[0], [], 0
    for _ in range(count):
        (n,) = struct.unpack_from("<I", data, off)
        out.append(data[off + 4 : off + 4 + n].decode())
        off += 4 + n
    assert out == phonemes


def test_multi_word_elements_join_with_bars(client: g.InferenceServerClient) -> None:
    one = client.infer("g2p", [text_input(["hello", "world"])]).as_numpy("PHONEMES")
    both = client.infer("g2p", [text_input(["hello world"])]).as_numpy("PHONEMES")
    assert both[0].decode() == f"{one[0].decode()} | {one[1].decode()}"


def test_attention_output_shape_and_rows_sum_to_one(client: g.InferenceServerClient) -> None:
    res = client.infer(
        "g2p",
        [text_input(["attention", "cat"])],
        outputs=[g.InferRequestedOutput("PHONEMES"), g.InferRequestedOutput("ATTENTION")],
        parameters={"lexicon": False},  # the model decodes both (the lexicon's words have no attention)
    )
    att = res.as_numpy("ATTENTION")
    phonemes = [p.decode().split() for p in res.as_numpy("PHONEMES")]
    assert att.dtype == np.float32 and att.shape == (2, max(map(len, phonemes)), len("attention"))
    for i, (word, ph) in enumerate(zip(["attention", "cat"], phonemes, strict=True)):
        rows = att[i, : len(ph), : len(word)]
        assert np.allclose(rows.sum(-1), 1.0, atol=1e-4)
        assert np.all(att[i, :, len(word) :] == 0)


def test_only_requested_outputs_come_back(client: g.InferenceServerClient) -> None:
    res = client.infer("g2p", [text_input(["cat"])], outputs=[g.InferRequestedOutput("PHONEMES")])
    assert [o.name for o in res.get_response().outputs] == ["PHONEMES"]


def test_encoder_tensor_model(client: g.InferenceServerClient) -> None:
    ids = np.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    out = client.infer("g2p_encoder", encoder_inputs(ids, mask)).as_numpy("last_hidden_state")
    assert out.shape == (2, 5, 192) and np.isfinite(out).all()
    alone = client.infer("g2p_encoder", encoder_inputs(ids[:1, :3])).as_numpy("last_hidden_state")
    assert np.allclose(alone[0], out[0, :3], atol=1e-5)  # padding does not change the real positions


def test_aio_client(server: RunningServer) -> None:
    async def run() -> list[str]:
        c = ga.InferenceServerClient(server.url)
        try:
            assert await c.is_server_ready()
            results = await asyncio.gather(*(c.infer("g2p", [text_input([w])]) for w in ["one", "two", "three"]))
            return [r.as_numpy("PHONEMES")[0].decode() for r in results]
        finally:
            await c.close()

    out = asyncio.run(run())
    assert len(out) == 3 and all(out)


def test_health_overall_and_per_model_and_reflection(server: RunningServer) -> None:
    with grpc.insecure_channel(server.url) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "g2p", "g2p_encoder"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == 1
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        names = {
            s.name for r in refl.ServerReflectionInfo(iter([req]), timeout=5) for s in r.list_services_response.service
        }
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")
        files = [r.file_descriptor_response for r in refl.ServerReflectionInfo(iter([req]), timeout=5)]
        assert files and files[0].file_descriptor_proto


ERRORS = [
    ("unknown model", lambda c: c.infer("nope", [text_input(["a"])]), "NOT_FOUND", "Request for unknown model: 'nope'"),
    ("unknown version", lambda c: c.infer("g2p", [text_input(["a"])], model_version="7"), "NOT_FOUND", "version '7'"),
    ("wrong dtype", lambda c: c.infer("g2p", [_fp32("TEXT")]), "INVALID_ARGUMENT", "TEXT"),
    ("empty text", lambda c: c.infer("g2p", [text_input(["  ,  "])]), "INVALID_ARGUMENT", "empty"),
    ("control character", lambda c: c.infer("g2p", [text_input(["a\x07b"])]), "INVALID_ARGUMENT", "'\\x07'"),
    ("read out too long", lambda c: c.infer("g2p", [text_input(["1" * 300])]), "INVALID_ARGUMENT", "limit is 256"),
    (
        "unknown output",
        lambda c: c.infer("g2p", [text_input(["a"])], outputs=[g.InferRequestedOutput("X")]),
        "INVALID_ARGUMENT",
        "no output 'X'",
    ),
    (
        "missing input",
        lambda c: c.infer("g2p_encoder", encoder_inputs(np.ones((1, 3), np.int64))[:1]),
        "INVALID_ARGUMENT",
        "missing input 'attention_mask'",
    ),
    (
        "shape mismatch",
        lambda c: c.infer("g2p_encoder", encoder_inputs(np.ones((1, 3), np.int64), np.ones((1, 4), np.int64))),
        "INVALID_ARGUMENT",
        "sequence length",
    ),
    (
        "rank",
        lambda c: c.infer("g2p_encoder", encoder_inputs(np.ones((3,), np.int64))),
        "INVALID_ARGUMENT",
        "dimensions",
    ),
    (
        "encoder dtype",
        lambda c: c.infer("g2p_encoder", [_fp32("input_ids", (1, 3)), _fp32("attention_mask", (1, 3))]),
        "INVALID_ARGUMENT",
        "expects INT64",
    ),
    (
        "beam",
        lambda c: c.infer("g2p", [text_input(["a"])], parameters={"beam_size": 99}),
        "INVALID_ARGUMENT",
        "beam_size",
    ),
]


def _fp32(name: str, shape: tuple[int, ...] = (1,)) -> g.InferInput:
    x = g.InferInput(name, list(shape), "FP32")
    x.set_data_from_numpy(np.ones(shape, np.float32))
    return x


@pytest.mark.parametrize(("case", "call", "code", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_have_the_designed_status_and_a_precise_message(client, case, call, code, message) -> None:  # type: ignore[no-untyped-def]
    got, text = status_of(lambda: call(client))
    assert got == code, text
    assert message in text
    assert client.infer("g2p", [text_input(["still", "fine"])]).as_numpy("PHONEMES").shape == (2,)


def test_raw_contents_of_the_wrong_size(server: RunningServer) -> None:
    from service import protocol

    req = protocol.ModelInferRequest(model_name="g2p_encoder")
    for name in ("input_ids", "attention_mask"):
        req.inputs.add(name=name, datatype="INT64", shape=[1, 4])
    req.raw_input_contents.extend([b"\x00" * 32, b"\x00" * 31])
    with grpc.insecure_channel(server.url) as ch, pytest.raises(grpc.RpcError) as e:
        protocol.Stub(ch).ModelInfer(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "attention_mask" in e.value.details() and "31 bytes" in e.value.details()


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "ServerLive"])
def test_a_body_that_is_not_the_request_message_is_invalid_argument(server: RunningServer, method: str) -> None:
    with grpc.insecure_channel(server.url) as ch:
        raw = ch.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\xff\xff not a protobuf message", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"not a valid {method}Request" in e.value.details()


def test_text_normalisation() -> None:
    from service.models.g2p.model import normalize_word

    assert normalize_word("Hello,") == "hello"
    assert normalize_word("(world)!") == "world"
    assert normalize_word("James'") == "james'"
    assert normalize_word("c.o.d.") == "c.o.d."
    assert normalize_word("end.") == "end"
    assert normalize_word("--") == ""


def test_too_many_bytes_elements_are_refused_before_decoding(server: RunningServer) -> None:
    from service import protocol

    req = protocol.ModelInferRequest(model_name="g2p")
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[1 << 20])
    req.raw_input_contents.append(b"\x00\x00\x00\x00" * (1 << 20))
    with grpc.insecure_channel(server.url) as ch, pytest.raises(grpc.RpcError) as e:
        protocol.Stub(ch).ModelInfer(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "BYTES elements" in e.value.details()
