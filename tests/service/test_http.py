"""The v2 REST protocol on a real server: tritonclient.http (sync and aio, binary and JSON) unchanged,
answers equal gRPC's, the generate extension with plain HTTP, one data plane, and every bad request
a 4xx with a clear message (never a 5xx or a hang) while good ones go on."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.grpc.aio as ga
import tritonclient.http as h
import tritonclient.http.aio as ha
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from service.repository.layout import available_versions
from service.tools.bench.servers import scrape, variant
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.figures import FIGURES
from tests.service.queue_helpers import until, until_computing

# The g2p version a request that names none reaches: the newest shipped.
G2P_DEFAULT = str(available_versions(MODELS / "g2p")[-1])

MAX_BYTES = 1 << 20  # the fixture's --max-message-bytes
# The fixture's --http-timeout: far longer than any answer takes, so that a good request is seen answered
# while slow clients are still being waited for.
HTTP_TIMEOUT = 10
UNKNOWN = "Request for unknown model: '{}' is not found"  # Triton's words, which its clients test for
HANG = 60.0  # a client that has no answer after this long counts the server as hung
WORDS = [b"attention", b"transformer", b"hello"]
FUZZ: Counter[str] = Counter()  # cases sent, by kind: printed with the run's figures
ANSWERS: Counter[int] = Counter()  # the random cases' answers, by HTTP status
# One encoder instance, FIFO batches padded to their longest request, which wait for company while it runs.
ONE_INSTANCE = {
    "g2p_encoder": {
        "instances": 1,
        # no queueing-time objective: requests held behind a blocker are admitted whatever rate was measured
        "batching": {"length_aware": False, "inline_max_tokens": 0, "token_budget": 8192, "max_queue_wait_ms": 600000},
    }
}


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    d = tmp_path_factory.mktemp("http")
    repo = variant(MODELS, d / "models", ONE_INSTANCE)
    args = ["--model-repository", str(repo), "--http-timeout", str(HTTP_TIMEOUT), "--max-message-bytes", str(MAX_BYTES)]
    s = start_server(args, d / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in Path(s.log).read_text()  # whatever the tests sent, nothing failed inside


def count(kind: str, cases: int = 1, status: int | None = None) -> None:
    """Counts what the fuzz and limit tests sent, into the run's figures as they go (in any test order)."""
    FUZZ[kind] += cases
    if status is not None:
        ANSWERS[status] += 1
    figures = {kind: f"{n} cases, each a 4xx with a message or an answer" for kind, n in FUZZ.items()}
    figures["total"] = f"{sum(FUZZ.values())} cases, no 5xx, no hang"
    figures["random cases by status"] = str(dict(sorted(ANSWERS.items())))
    FIGURES["HTTP fuzz and limits"] = figures


def post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=HANG)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def get(url: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{url}{path}", timeout=HANG) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def raw(url: str, data: bytes, wait: float = HANG) -> bytes:
    """Bytes sent as they are on a fresh connection; what comes back until the server closes or `wait`."""
    host, port = url.split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        return read_until_closed(s)[0]


def read_until_closed(s: socket.socket) -> tuple[bytes, bool]:
    """What comes back on `s`, and whether the server closed it (rather than the socket's timeout passing)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        return out, False
    return out, True


def encoder_inputs(module: Any, binary: bool, rows: int = 2, seq: int = 7) -> list[Any]:
    ids = np.random.default_rng(rows * seq).integers(4, 30, size=(rows, seq), dtype=np.int64)
    tensors = []
    for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
        t = module.InferInput(name, list(array.shape), "INT64")
        if module is g:
            t.set_data_from_numpy(array)
        else:
            t.set_data_from_numpy(array, binary_data=binary)
        tensors.append(t)
    return tensors


def text_input(module: Any, binary: bool) -> Any:
    t = module.InferInput("TEXT", [len(WORDS)], "BYTES")
    if module is g:
        t.set_data_from_numpy(np.array(WORDS, dtype=object))
    else:
        t.set_data_from_numpy(np.array(WORDS, dtype=object), binary_data=binary)
    return t


# --- tritonclient.http, unchanged, against gRPC's answers ----------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_answers_equal_grpc(web: RunningServer, binary: bool) -> None:
    grpc_client, client = g.InferenceServerClient(web.url), h.InferenceServerClient(web.http_url)
    want = grpc_client.infer("g2p", [text_input(g, binary)]).as_numpy("PHONEMES")
    out = [h.InferRequestedOutput("PHONEMES", binary_data=binary)]
    got = client.infer("g2p", [text_input(h, binary)], outputs=out).as_numpy("PHONEMES")
    assert [x if isinstance(x, bytes) else x.encode() for x in got] == list(want)
    # beam search, and ATTENTION (FP32) as well
    params = {"beam_size": 3}
    outputs = [h.InferRequestedOutput(n, binary_data=binary) for n in ("PHONEMES", "ATTENTION")]
    got_r = client.infer("g2p", [text_input(h, binary)], outputs=outputs, parameters=params)
    want_r = grpc_client.infer(
        "g2p", [text_input(g, binary)], outputs=[g.InferRequestedOutput(n) for n in ("PHONEMES", "ATTENTION")],
        parameters=params,
    )  # fmt: skip
    np.testing.assert_array_equal(got_r.as_numpy("ATTENTION"), want_r.as_numpy("ATTENTION"))
    want_e = grpc_client.infer("g2p_encoder", encoder_inputs(g, binary)).as_numpy("last_hidden_state")
    out_e = [h.InferRequestedOutput("last_hidden_state", binary_data=binary)]
    got_e = client.infer("g2p_encoder", encoder_inputs(h, binary), outputs=out_e).as_numpy("last_hidden_state")
    assert got_e.dtype == np.float32 and got_e.shape == want_e.shape == (2, 7, 192)
    np.testing.assert_array_equal(got_e, want_e)  # the same batch path: equal to the bit


def test_tritonclient_http_metadata_config_stats_and_index(web: RunningServer) -> None:
    grpc_client, client = g.InferenceServerClient(web.url), h.InferenceServerClient(web.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("g2p") and client.is_model_ready("g2p_encoder", "1")
    assert not client.is_model_ready("no-such-model") and not client.is_model_ready("g2p", "7")
    assert client.get_server_metadata() == grpc_client.get_server_metadata(as_json=True)
    for model in ("g2p", "g2p_encoder"):
        meta, want = client.get_model_metadata(model), grpc_client.get_model_metadata(model, as_json=True)
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
            (t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in want["inputs"]
        ]
        config = client.get_model_config(model)
        assert config["max_batch_size"] == grpc_client.get_model_config(model).config.max_batch_size > 0
    before = client.get_inference_statistics("g2p", G2P_DEFAULT)["model_stats"][0]["inference_stats"]["success"]
    client.infer("g2p", [text_input(h, True)])
    grpc_client.infer("g2p", [text_input(g, True)])
    stats = client.get_inference_statistics("g2p", G2P_DEFAULT)["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == before["count"] + 2  # both protocols, one set of statistics
    assert isinstance(stats["inference_count"], int)  # numbers, as Triton writes them (perf_analyzer reads them so)
    assert {m["name"] for m in client.get_inference_statistics()["model_stats"]} == {"g2p", "g2p_encoder"}
    index = client.get_model_repository_index()
    assert {(m["name"], m["state"]) for m in index} == {("g2p", "READY"), ("g2p_encoder", "READY")}
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("no-such-model")
    assert e.value.status() == "404" and e.value.message().startswith(UNKNOWN.format("no-such-model"))


def test_tritonclient_http_aio(web: RunningServer) -> None:
    async def run() -> list[Any]:
        client = ha.InferenceServerClient(web.http_url)
        try:
            assert await client.is_server_ready()
            calls = [client.infer("g2p", [text_input(ha, binary)]) for binary in (True, False) for _ in range(4)]
            return [r.as_numpy("PHONEMES") for r in await asyncio.gather(*calls)]
        finally:
            await client.close()

    answers = asyncio.run(run())
    want = g.InferenceServerClient(web.url).infer("g2p", [text_input(g, True)]).as_numpy("PHONEMES")
    assert all(list(a) == list(want) for a in answers)


def test_errors_have_grpc_messages_and_an_http_status(web: RunningServer) -> None:
    grpc_client, client = g.InferenceServerClient(web.url), h.InferenceServerClient(web.http_url)
    bad = h.InferInput("TEXT", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"h\x07llo"], dtype=object))
    bad_g = g.InferInput("TEXT", [1], "BYTES")
    bad_g.set_data_from_numpy(np.array([b"h\x07llo"], dtype=object))
    for model, tensor, tensor_g, status in (("g2p", bad, bad_g, "400"), ("nope", bad, bad_g, "404")):
        with pytest.raises(InferenceServerException) as over_http:
            client.infer(model, [tensor])
        with pytest.raises(InferenceServerException) as over_grpc:
            grpc_client.infer(model, [tensor_g])
        assert over_http.value.status() == status
        assert over_http.value.message() == over_grpc.value.message()


# --- generate, with plain HTTP ---------------------------------------------------------------------------


def test_generate_answers_text_and_each_words_phonemes(web: RunningServer) -> None:
    status, _, body = post(web.http_url, "/v2/models/g2p/generate", b'{"text_input": "Hello, world!"}')
    assert status == 200
    doc = json.loads(body)
    assert doc["text_output"] == "HH AH0 L OW1 | W ER1 L D"  # both words from the lexicon (CMUdict)
    assert doc["words"] == [
        {"word": "hello", "phonemes": "HH AH0 L OW1", "source": "lexicon"},
        {"word": "world", "phonemes": "W ER1 L D", "source": "lexicon"},
    ]
    # each word as the model reads it: "$5" is two, and a word it cannot spell is answered with why
    status, _, body = post(web.http_url, "/v2/models/g2p/generate", "Paid $5 for \u263a tea".encode())
    assert status == 400  # not JSON
    text = json.dumps({"text_input": "Paid $5 for \u263a tea"}).encode()
    status, _, body = post(web.http_url, "/v2/models/g2p/generate", text)
    assert status == 200
    words = json.loads(body)["words"]
    assert [w["word"] for w in words] == ["paid", "five", "dollars", "for", "\u263a", "tea"]
    assert all(w["phonemes"] for i, w in enumerate(words) if i != 4) and words[4]["phonemes"] == ""
    assert words[4]["reason"] and all("reason" not in w for i, w in enumerate(words) if i != 4)
    status, _, body = post(web.http_url, "/v2/models/g2p/generate", b'{"text_input": "h\\u0007llo"}')
    assert status == 400 and "cannot spell character" in json.loads(body)["error"]
    status, _, body = post(web.http_url, "/v2/models/g2p_encoder/generate", b'{"text_input": "hello"}')
    assert status == 400 and "'g2p_encoder' takes no text (its kind: tensor)" in json.loads(body)["error"]


def test_generate_stream_sends_an_event_per_word_then_the_whole(web: RunningServer) -> None:
    text = "the transformer attends to every word"
    status, headers, body = post(
        web.http_url, "/v2/models/g2p/generate_stream", json.dumps({"text_input": text}).encode()
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(e.removeprefix("data: ")) for e in body.decode().split("\n\n") if e]
    words = text.split()
    assert [e["word"] for e in events[:-1]] == words and [e["index"] for e in events[:-1]] == list(range(len(words)))
    assert events[-1]["final"] and events[-1]["text_output"] == " | ".join(e["text_output"] for e in events[:-1])
    status, _, whole = post(web.http_url, "/v2/models/g2p/generate", json.dumps({"text_input": text}).encode())
    assert json.loads(whole)["text_output"] == events[-1]["text_output"]  # alone or beside each other, the same
    # an error before the first word is a status; one after it, an error event
    status, _, body = post(web.http_url, "/v2/models/nope/generate_stream", b'{"text_input": "hi"}')
    assert status == 404
    status, _, body = post(web.http_url, "/v2/models/g2p/generate_stream", b'{"text_input": "hello w\\u0007rld"}')
    assert status == 200 and body.decode().split("\n\n")[1].startswith("event: error\ndata: ")


# --- one data plane ----------------------------------------------------------------------------------------


def test_http_and_grpc_share_the_metrics_and_http_is_told_apart(web: RunningServer) -> None:
    before = scrape(web.metrics_url)
    client, grpc_client = h.InferenceServerClient(web.http_url), g.InferenceServerClient(web.url)
    for _ in range(3):
        client.infer("g2p_encoder", encoder_inputs(h, True))
        grpc_client.infer("g2p_encoder", encoder_inputs(g, True))
    after = scrape(web.metrics_url)

    def grew(series: str) -> float:
        return after.get(series, 0.0) - before.get(series, 0.0)

    assert grew('qkv_requests_total{code="OK",model="g2p_encoder",version="1"}') == 6  # both protocols, as before
    assert grew('qkv_http_requests_total{code="200",endpoint="infer",model="g2p_encoder"}') == 3


def test_http_and_grpc_requests_batch_together(web: RunningServer) -> None:
    """HTTP clients send the encoder rows of 8 tokens, gRPC clients rows of 16. A batch of one protocol's
    requests needs no padding; one that holds requests of both pads the 8s to 16. A blocker holds the one
    instance while all 16 queue, so the next batch (FIFO, room for all) holds both."""
    padding = 'qkv_batch_tokens_total{kind="padding",model="g2p_encoder",version="1"}'
    queued = 'qkv_queue_depth{model="g2p_encoder",version="1"}'

    async def held_burst(blocker_rows: int) -> bool:
        """Whether the 16 requests were all seen queued behind the blocker (else it finished first)."""
        web_client, grpc_client = ha.InferenceServerClient(web.http_url), ga.InferenceServerClient(web.url)
        try:
            # over HTTP, whose answers (megabytes of hidden states) are not bound by --max-message-bytes
            blocker = asyncio.ensure_future(
                web_client.infer("g2p_encoder", encoder_inputs(h, True, rows=blocker_rows, seq=512))
            )
            await until_computing(web, blocker)
            calls = [web_client.infer("g2p_encoder", encoder_inputs(h, True, rows=1, seq=8)) for _ in range(8)]
            calls += [grpc_client.infer("g2p_encoder", encoder_inputs(g, True, rows=1, seq=16)) for _ in range(8)]
            burst = asyncio.gather(*calls)
            await until(lambda: blocker.done() or scrape(web.metrics_url).get(queued, 0) == 16, "16 queued")
            held = not blocker.done()
            await asyncio.gather(blocker, burst)
            return held
        finally:
            await web_client.close()
            await grpc_client.close()

    before = scrape(web.metrics_url).get(padding, 0.0)
    held = False
    for rows in (4, 8, 16):  # a longer blocker while the machine queues the burst more slowly than it computes
        held = asyncio.run(held_burst(rows))
        if held:
            break
    assert held, "a blocker of 16 x 512 tokens finished before 16 small requests were queued"
    assert scrape(web.metrics_url).get(padding, 0.0) - before >= 8 * (16 - 8)  # one batch of both: the 8s padded


# --- bad requests: each a 4xx with a clear message; the server goes on -----------------------------------

GOOD = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["cat"]}]}).encode()
ENCODER = "/v2/models/g2p_encoder/infer"


def _binary(header: dict[str, Any], *parts: bytes, declared: int | None = None) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + b"".join(parts), {"Inference-Header-Content-Length": str(len(head) if declared is None else declared)}


def _encoder(data: Any, datatype: str = "INT64", shape: list[int] | None = None) -> bytes:
    t = {"name": "input_ids", "datatype": datatype, "shape": shape or [1, 3], "data": data}
    m = {"name": "attention_mask", "datatype": "INT64", "shape": [1, 3], "data": [1, 1, 1]}
    return json.dumps({"inputs": [t, m]}).encode()


def bad_requests() -> list[tuple[str, str, bytes, dict[str, str], int, str]]:
    """(what, path, body, headers, status, a part of the message)."""
    g2p = "/v2/models/g2p/infer"
    two = struct.pack("<I", 3) + b"cat"
    return [
        ("not JSON", g2p, b"{inputs:", {}, 400, "not valid JSON"),
        ("JSON not an object", g2p, b"[1, 2]", {}, 400, "must be a JSON object"),
        ("empty body", g2p, b"", {}, 400, "not valid JSON"),
        ("invalid UTF-8", g2p, b'{"id": "\xff\xfe"}', {}, 400, "not valid JSON"),
        ("nested too deep", g2p, b"[" * 100_000, {}, 400, "nested too deeply"),
        ("no inputs", g2p, b"{}", {}, 400, "must have 'inputs'"),
        ("inputs not a list", g2p, b'{"inputs": {}}', {}, 400, "must have 'inputs'"),
        ("input not an object", g2p, b'{"inputs": [3]}', {}, 400, "inputs[0] must be a JSON object"),
        ("no name", g2p, b'{"inputs": [{"datatype": "BYTES", "shape": [1], "data": ["a"]}]}', {}, 400, "name must be"),
        (
            "shape not ints",
            g2p,
            b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": ["1"], "data": ["a"]}]}',
            {},
            400,
            "shape must be a list of integers",
        ),
        (
            "shape too big",
            g2p,
            b'{"inputs":[{"name":"TEXT","datatype":"BYTES","shape":[99999999999999999999],"data":[]}]}',
            {},
            400,
            "does not fit in 64 bits",
        ),
        (
            "unknown datatype",
            g2p,
            b'{"inputs":[{"name":"TEXT","datatype":"STR","shape":[1],"data":["a"]}]}',
            {},
            400,
            "unknown datatype 'STR'",
        ),
        ("no data", g2p, b'{"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}]}', {}, 400, "neither data"),
        (
            "count off",
            g2p,
            b'{"inputs":[{"name":"TEXT","datatype":"BYTES","shape":[2],"data":["a"]}]}',
            {},
            400,
            "1 values in data, shape [2] needs 2",
        ),
        ("ragged", ENCODER, _encoder([[1, 2], [3]], shape=[1, 3]), {}, 400, "not a regular array"),
        ("strings for INT64", ENCODER, _encoder(["a", "b", "c"]), {}, 400, "INT64 data cannot hold strings"),
        ("floats for INT64", ENCODER, _encoder([1.5, 2, 3]), {}, 400, "INT64 data cannot hold numbers with a fraction"),
        ("int over INT64", ENCODER, _encoder([2**70, 1, 1]), {}, 400, f"value {2**70} is outside INT64"),
        ("null in data", ENCODER, _encoder([None, 1, 1]), {}, 400, "INT64 data cannot hold"),
        ("wrong datatype", ENCODER, _encoder([1, 2, 3], "INT32"), {}, 400, "expects INT64"),
        ("token id out of range", ENCODER, _encoder([1, 2, 10**6]), {}, 400, "outside the vocabulary"),
        ("bad parameter", g2p, b'{"parameters": {"beam_size": [1]}, "inputs": []}', {}, 400, "must be a boolean"),
        ("beam out of range", g2p, b'{"parameters": {"beam_size": 99}, ' + GOOD[1:], {}, 400, "beam_size"),
        ("bad timeout", g2p, b'{"parameters": {"timeout": -1}, ' + GOOD[1:], {}, 400, "'timeout' must be"),
        ("unknown model", "/v2/models/nope/infer", GOOD, {}, 404, "Request for unknown model: 'nope' is not found"),
        (
            "unknown version",
            "/v2/models/g2p/versions/9/infer",
            GOOD,
            {},
            404,
            "Request for unknown model: 'g2p' version '9'",
        ),
        ("unknown endpoint", "/v2/models/g2p/explode", GOOD, {}, 404, "no endpoint"),
        ("not v2", "/v1/models/g2p:predict", GOOD, {}, 404, "no endpoint"),
        ("POST to a GET", "/v2/health/ready", b"", {}, 405, "GET is the method"),
        ("multipart", g2p, GOOD, {"Content-Type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
        ("XML", g2p, GOOD, {"Content-Type": "application/xml"}, 415, "Content-Type"),
        # refused by aiohttp's parser before any handler: a 400 whose body is text, not JSON
        ("unknown encoding", g2p, GOOD, {"Content-Encoding": "zstd"}, 400, "content-encoding"),
        ("broken gzip", g2p, b"not gzip at all", {"Content-Encoding": "gzip"}, 400, "cannot be read"),
        ("gzip bomb", g2p, gzip.compress(b" " * (MAX_BYTES + 1)), {"Content-Encoding": "gzip"}, 413, "over the limit"),
        ("header length not a number", g2p, GOOD, {"Inference-Header-Content-Length": "ten"}, 400, "is not a number"),
        (
            "header length past the body",
            g2p,
            GOOD,
            {"Inference-Header-Content-Length": "99999"},
            400,
            "it must lie between",
        ),
        ("header length negative", g2p, GOOD, {"Inference-Header-Content-Length": "-4"}, 400, "must lie between"),
        ("header length short", g2p, GOOD, {"Inference-Header-Content-Length": "10"}, 400, "not valid JSON"),
        (
            "binary size past the body",
            g2p,
            *_binary(
                {
                    "inputs": [
                        {"name": "TEXT", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 99}}
                    ]
                },
                two,
            ),
            400,
            "99 binary bytes declared, 7 left",
        ),
        (
            "bytes after the binary",
            g2p,
            *_binary(
                {
                    "inputs": [
                        {"name": "TEXT", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 7}}
                    ]
                },
                two,
                b"extra",
            ),
            400,
            "5 bytes after",
        ),
        (
            "binary BYTES cut short",
            g2p,
            *_binary(
                {
                    "inputs": [
                        {"name": "TEXT", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 7}}
                    ]
                },
                two,
            ),
            400,
            "raw BYTES contents end",
        ),
        (
            "binary and data",
            g2p,
            *_binary(
                {
                    "inputs": [
                        {
                            "name": "TEXT",
                            "datatype": "BYTES",
                            "shape": [1],
                            "data": ["a"],
                            "parameters": {"binary_data_size": 7},
                        }
                    ]
                },
                two,
            ),
            400,
            "both data and",
        ),
        (
            "binary of the wrong size",
            ENCODER,
            *_binary(
                {
                    "inputs": [
                        {"name": n, "datatype": "INT64", "shape": [1, 3], "parameters": {"binary_data_size": 16}}
                        for n in ("input_ids", "attention_mask")
                    ]
                },
                bytes(32),
            ),
            400,
            "raw contents are 16 bytes",
        ),
        ("over --max-message-bytes", g2p, b" " * (MAX_BYTES + 1), {}, 413, "1,048,576 (--max-message-bytes)"),
        ("generate without text", "/v2/models/g2p/generate", b'{"text": "hi"}', {}, 400, '"text_input"'),
        (
            "generate_stream too long",
            "/v2/models/g2p/generate_stream",
            json.dumps({"text_input": "a " * 65}).encode(),
            {},
            400,
            "65 words, the limit is 64",
        ),
        ("index not JSON", "/v2/repository/index", b"{", {}, 400, "not valid JSON"),
    ]


def _check(status: int, body: bytes, want_status: int | None = None, want: str = "") -> None:
    try:
        message = json.loads(body)["error"]
    except ValueError:  # aiohttp's own refusals (the HTTP framing) are text
        message = body.decode()
    # A request that asked for a deadline (Triton's `timeout` parameter) too short to meet is not malformed:
    # it is answered as gRPC answers it, DEADLINE_EXCEEDED (504).
    assert 400 <= status < 500 or (status == 504 and "deadline" in message), (status, body[:300])
    assert isinstance(message, str) and message and "\n" not in message
    assert want_status is None or status == want_status, (status, message)
    assert want in message, (want, message)


def test_each_bad_request_gets_its_4xx_and_message(web: RunningServer) -> None:
    cases = bad_requests()
    for what, path, body, headers, status, want in cases:
        got, _, answer = post(web.http_url, path, body, headers)
        try:
            _check(got, answer, status, want)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    count("table of bad requests", len(cases))
    assert client_ok(web)


def client_ok(web: RunningServer) -> bool:
    phonemes = h.InferenceServerClient(web.http_url).infer("g2p", [text_input(h, True)]).as_numpy("PHONEMES")
    return list(phonemes) == [b"AH0 T EH1 N SH AH0 N", b"T R AE0 N S F AO1 R M ER0", b"HH AH0 L OW1"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
tensors = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["TEXT", "input_ids", "attention_mask", "x"]) | json_values,
        "datatype": st.sampled_from(["BYTES", "INT64", "FP32", "BOOL", "INT8", "FP16"]) | json_values,
        "shape": st.lists(st.integers(-2, 4), max_size=3) | json_values,
        "data": st.lists(st.integers(-(2**65), 2**65) | st.text(max_size=5) | st.booleans(), max_size=6) | json_values,
        "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-2, 20)}) | json_values,
    },
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=10) | json_values,
        "inputs": st.lists(tensors, max_size=3) | json_values,
        "outputs": st.lists(st.fixed_dictionaries({"name": st.text(max_size=12) | json_values}), max_size=2)
        | json_values,
        "parameters": st.dictionaries(
            st.sampled_from(["beam_size", "timeout", "x", "binary_data_output"]), json_values
        ),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(doc=requests, model=st.sampled_from(["g2p", "g2p_encoder"]), tail=st.binary(max_size=24), binary=st.booleans())
def test_random_requests_get_a_4xx_or_an_answer(
    web: RunningServer, doc: Any, model: str, tail: bytes, binary: bool
) -> None:
    body, headers = (json.dumps(doc).encode(), {})
    if binary:
        body, headers = _binary(doc, tail)
    try:
        status, _, answer = post(web.http_url, f"/v2/models/{model}/infer", body, headers)
    except TimeoutError:
        raise AssertionError(f"no answer within {HANG:g} s: the server hung on {body[:300]!r}") from None
    count("random JSON and binary requests", status=status)
    if status != 200:
        _check(status, answer)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_get_a_5xx(web: RunningServer, data: bytes) -> None:
    status, _, answer = post(web.http_url, "/v2/models/g2p/infer", data, {"Content-Type": "application/octet-stream"})
    count("random bytes bodies", status=status)
    _check(status, answer)


def test_lying_lengths_and_slow_clients_time_out_while_others_are_served(web: RunningServer) -> None:
    """A Content-Length over what is sent and headers that never end: each is answered 408 or closed by the
    server after --http-timeout, and a good request sent meanwhile is answered while both are still held."""
    host, port = web.http_url.split(":")
    short = b"POST /v2/models/g2p/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + GOOD
    slow_headers = b"POST /v2/models/g2p/infer HTTP/1.1\r\nHost: x\r\nX-Slow: "
    results: dict[str, tuple[bytes, bool, float]] = {}  # what came back, closed by the server, when it ended
    # Both connections are open, their bytes sent, before the good request is.
    slow = {name: socket.create_connection((host, int(port)), timeout=HANG) for name in ("lying", "loris")}
    slow["lying"].sendall(short)
    slow["loris"].sendall(slow_headers)

    def wait(name: str, s: socket.socket) -> None:
        with s:
            results[name] = (*read_until_closed(s), time.monotonic())

    threads = [threading.Thread(target=wait, args=item) for item in slow.items()]
    for t in threads:
        t.start()
    assert client_ok(web)
    answered = time.monotonic()
    for t in threads:
        t.join(HANG + 5)
    answer, closed, ended = results["lying"]
    assert closed and answer.startswith(b"HTTP/1.1 408"), answer
    assert f"did not arrive within {HTTP_TIMEOUT} s".encode() in answer, answer
    assert answered < ended, "the good request was answered only after the lying client was timed out"
    answer, closed, ended = results["loris"]
    assert closed, f"headers that never end: the connection was still open after {HANG:g} s"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer  # closed, never answered 5xx
    assert answered < ended, "the good request was answered only after the slow headers were timed out"
    # a Content-Length under what is sent: the rest is a broken next request, refused by the HTTP parser
    under = b"POST /v2/models/g2p/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + GOOD
    answer = raw(web.http_url, under)
    assert answer[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400") and b" 500 " not in answer, answer
    # headers over aiohttp's limits (8 KiB a line)
    answer = raw(web.http_url, b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
    assert answer[:10] in (b"HTTP/1.1 4", b"HTTP/1.0 4"), answer[:200]
    count("slow clients and lying lengths", 4)
    count("oversized headers")
    assert client_ok(web)


def test_a_client_that_leaves_is_counted_cancelled_and_nothing_is_held(web: RunningServer) -> None:
    cancelled = f'qkv_requests_total{{code="CANCELLED",model="g2p",version="{G2P_DEFAULT}"}}'
    before = scrape(web.metrics_url)
    # decoded, not looked up (lexicon false): a request that takes a while
    body = json.dumps({"text_input": " ".join(["supercalifragilistic"] * 45), "parameters": {"lexicon": False}})
    body = body.encode()
    request = f"POST /v2/models/g2p/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    host, port = web.http_url.split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(request + body)
        time.sleep(0.01)
    deadline = time.monotonic() + HANG
    while time.monotonic() < deadline:
        after = scrape(web.metrics_url)
        if after.get(cancelled, 0) > before.get(cancelled, 0):
            break
        time.sleep(0.1)
    inflight = f'qkv_inflight_requests{{model="g2p",version="{G2P_DEFAULT}"}}'
    assert after.get(inflight, 0) == 0, f"a request still in flight {HANG:g} s after its client left"
    # the handler was cancelled, as on gRPC
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1, f"no CANCELLED counted within {HANG:g} s"
    assert client_ok(web)
