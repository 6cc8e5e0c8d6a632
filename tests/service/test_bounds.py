"""Nothing a client sends grows the server without bound (docs/security.md, "What a client can reach").

Model names, versions, request ids, parameter names and values, input, output and datatype names are
a client's strings. Whatever they hold (newlines, escape sequences, 200,000 characters, a 1 MB id),
they must not become metric series, must not make an error outgrow gRPC's metadata limit, must not
break a log line in two or make it long, and must not grow the server's memory. A property test sends
random ones, unary and on streams, and checks those bounds after every example; a flood of 10,000
hostile requests gives the figures before and after.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service import protocol
from service.datatypes import encode_bytes
from service.errors import MAX_MESSAGE_BYTES, QUOTE_CHARS, InvalidArgument, clip, quote
from service.observability.logs import UnsentAnswer
from service.observability.metrics import UNKNOWN_MODEL
from service.tools.bench import scrape
from service.tools.client import g2p_request
from tests.conftest import RunningServer, start_server, stop_server
from tests.figures import FIGURES

DESIGNED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}
SERVED = {"g2p", "g2p_encoder"}
METRICS_GROWTH_BYTES = 16_384  # /metrics may grow this much over a run: new (model, status) pairs only
RSS_GROWTH_BYTES = 48 << 20
ACCESS_LINE_CHARS = 2048  # one access-log line, whatever the client's strings (JSON escapes are 6-12 a character)


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(["--access-log"], tmp_path_factory.mktemp("bounds") / "server.log")
    yield s
    stop_server(s)


# --- the helpers that bound what is quoted -------------------------------------------------------


def test_quote_keeps_a_short_escaped_prefix_and_says_how_long_the_whole_was() -> None:
    assert quote("g2q") == "'g2q'"
    assert quote("a\nb\x1b[31m\u2028") == "'a\\nb\\x1b[31m\\u2028'"
    long = quote("x" * 100_000)
    assert long == f"'{'x' * QUOTE_CHARS}…' (100,000 characters)"
    assert clip("line\nbreak") == "line\\nbreak" and clip("y" * 500, 10) == "yyyyyyyyyy… (500 characters)"


def test_no_message_outgrows_the_bound_whatever_it_holds() -> None:
    for text in ("é" * 10_000, "\U0001f600" * 5_000, "a" * 1_000_000):
        message = InvalidArgument(text).message
        assert len(message.encode()) <= MAX_MESSAGE_BYTES and message.endswith("…")


# --- a server under hostile strings ---------------------------------------------------------------


def _series(server: RunningServer) -> tuple[int, int, set[str]]:
    """(sample lines, bytes of /metrics, every value of a `model` label)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    models = set(re.findall(r'\bmodel="((?:[^"\\]|\\.)*)"', text))
    return len(samples), len(text.encode()), models


def _rss(server: RunningServer) -> int:
    with open(f"/proc/{server.process.pid}/status") as f:
        status = f.read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def _log_lines(server: RunningServer) -> tuple[list[str], list[str]]:
    """(access-log lines, other lines) of the server's output so far."""
    lines = server.output().splitlines()
    return [x for x in lines if x.startswith("{")], [x for x in lines if not x.startswith("{")]


def _g2p(model: str = "g2p") -> Any:
    return g2p_request(["hello"], model)


# Client strings: anything a proto3 string can hold (valid UTF-8), short, long and very long.
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
PIECES = st.sampled_from(["x", "\n", "\r\n", "\x1b[31m", "é", "\u2028", "\U0001f600", '"', "\\", "\x00", "%"])
LONG = st.builds(lambda piece, n: piece * n, PIECES, st.integers(65, 200_000))
HOSTILE = st.one_of(TEXT, LONG)
HUGE_ID = st.builds(lambda piece, n: piece * n, PIECES, st.sampled_from([1_000, 100_000, 1 << 20]))


@st.composite
def hostile_requests(draw: st.DrawFn) -> Any:
    """A request with one client string in one place: the model name, the version, the id, a
    parameter's name or value, an output's, an input's or a datatype's name."""
    where = draw(st.sampled_from(["model", "version", "id", "parameter", "beam", "output", "input", "datatype"]))
    text = draw(HOSTILE)
    if where == "model":
        request = _g2p(text if text not in SERVED else text + "?")
    elif where == "version":
        request = _g2p()
        request.model_version = text or "0"
    elif where == "id":
        request = _g2p()
        request.id = draw(st.one_of(TEXT, HUGE_ID))
    elif where == "parameter":
        request = _g2p()
        request.parameters[text or "p"].string_param = draw(HOSTILE)
    elif where == "beam":
        request = _g2p()
        request.parameters["beam_size"].string_param = text
    elif where == "output":
        request = _g2p()
        request.outputs.add(name=text if text not in ("PHONEMES", "ATTENTION") else text + "?")
    elif where == "input":
        request = protocol.ModelInferRequest(model_name="g2p")
        request.inputs.add(name=text if text != "TEXT" else "TEXT?", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(encode_bytes(np.array([b"hello"], dtype=object)))
    else:
        request = protocol.ModelInferRequest(model_name="g2p")
        request.inputs.add(name="TEXT", datatype=text if text != "BYTES" else "BYTES?", shape=[1])
        request.raw_input_contents.append(encode_bytes(np.array([b"hello"], dtype=object)))
    return request


def _check_message(code: str, details: str) -> None:
    assert code in DESIGNED, (code, details[:300])
    assert len(details.encode()) <= MAX_MESSAGE_BYTES, len(details)
    assert details.isprintable(), repr(details[:300])  # escaped: no newline or control character


class Bounds:
    """What the server holds at the start of a test, and the checks that it stays bounded."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.samples, self.size, _ = _series(server)
        self.rss = _rss(server)
        self.access, self.other = (len(x) for x in _log_lines(server))
        self.sent = 0

    def check(self) -> tuple[int, int]:
        samples, size, models = _series(self.server)
        assert models <= SERVED | {UNKNOWN_MODEL}, sorted(m[:80] for m in models - SERVED)
        assert size <= self.size + METRICS_GROWTH_BYTES, (self.size, size)
        access, other = _log_lines(self.server)
        assert len(access) == self.access + self.sent  # one line per request, never split
        assert len(other) == self.other, other[self.other :][:5]
        for line in access[self.access :]:
            assert len(line) <= ACCESS_LINE_CHARS, line[:300]
            json.loads(line)
        assert _rss(self.server) <= self.rss + RSS_GROWTH_BYTES, (self.rss, _rss(self.server))
        return samples, size


HOSTILE_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def test_unknown_model_names_add_no_series_and_get_a_short_not_found(hostile_server: RunningServer) -> None:
    bounds = Bounds(hostile_server)
    series = f'qkv_requests_total{{code="NOT_FOUND",model="{UNKNOWN_MODEL}",version=""}}'
    before = scrape(hostile_server.metrics_url).get(series, 0)  # other tests on this server count there too
    with grpc.insecure_channel(hostile_server.url, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        stub = protocol.Stub(channel)
        for i in range(200):
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(_g2p(f"junk{i}"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(_g2p("n" * 100_000), timeout=10)
        bounds.sent = 201
    # Its own status (not RESOURCE_EXHAUSTED from an oversized trailer), quoting a prefix and the length.
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert (
        e.value.details()
        == f"Request for unknown model: 'n{'n' * (QUOTE_CHARS - 1)}…' (100,000 characters) is not found "
        "(served: g2p, g2p_encoder)"
    )
    bounds.check()
    text = urllib.request.urlopen(hostile_server.metrics_url, timeout=10).read().decode()
    assert scrape(hostile_server.metrics_url)[series] - before == 201
    assert "junk" not in text and "nnnn" not in text


def test_hostile_strings_stay_bounded_in_metrics_messages_logs_and_memory(hostile_server: RunningServer) -> None:
    bounds = Bounds(hostile_server)
    codes: Counter[str] = Counter()
    options = [("grpc.max_send_message_length", 8 << 20)]
    with grpc.insecure_channel(hostile_server.url, options=options) as channel:
        stub = protocol.Stub(channel)

        @HOSTILE_SETTINGS
        @given(request=hostile_requests())
        def check(request: Any) -> None:
            try:
                stub.ModelInfer(request, timeout=10)
                code, details = "OK", ""
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
            bounds.sent += 1
            codes[code] += 1
            _check_message(code, details)
            if bounds.sent % 20 == 0:
                bounds.check()

        check()
    bounds.check()
    assert hostile_server.process.poll() is None
    assert codes["OK"] and codes["INVALID_ARGUMENT"] and codes["NOT_FOUND"], codes


def test_hostile_strings_on_streams_stay_bounded_too(hostile_server: RunningServer) -> None:
    bounds = Bounds(hostile_server)
    codes: Counter[str] = Counter()
    options = [("grpc.max_send_message_length", 8 << 20)]
    with grpc.insecure_channel(hostile_server.url, options=options) as channel:
        stub = protocol.Stub(channel)

        @settings(HOSTILE_SETTINGS, max_examples=100)
        @given(batch=st.lists(hostile_requests(), min_size=1, max_size=8))
        def check(batch: list[Any]) -> None:
            answers = list(stub.ModelStreamInfer(iter(batch), timeout=30))
            assert len(answers) == len(batch)
            for a in answers:
                code = a.error_message.partition(":")[0] if a.error_message else "OK"
                codes[code] += 1
                _check_message(code, a.error_message)
            bounds.sent += len(batch)
            bounds.check()

        check()
    assert hostile_server.process.poll() is None
    assert codes["OK"] and codes["INVALID_ARGUMENT"] and codes["NOT_FOUND"], codes


def _flood(i: int) -> Any:
    """The i-th of 10,000 hostile requests: each kind of client string, new every time."""
    junk = f"junk{i}\n" + "z" * (i % 7 * 1000)
    kind = i % 6
    if kind == 0:
        return _g2p(junk)
    request = _g2p()
    if kind == 1:
        request.model_version = junk
    elif kind == 2:
        request.id = junk * 20
    elif kind == 3:
        request.parameters[junk].string_param = junk
    elif kind == 4:
        request.outputs.add(name=junk)
    else:
        request.parameters["beam_size"].string_param = junk
    return request


def test_ten_thousand_hostile_requests_leave_the_series_and_metrics_size_alone(hostile_server: RunningServer) -> None:
    # Warm up the (model, status) pairs the flood will use, so that "before" already holds them.
    with grpc.insecure_channel(hostile_server.url) as channel:
        stub = protocol.Stub(channel)
        list(stub.ModelStreamInfer(iter([_flood(i) for i in range(12)]), timeout=30))
        bounds = Bounds(hostile_server)
        start = time.monotonic()
        codes: Counter[str] = Counter()
        for first in range(0, 10_000, 500):
            answers = stub.ModelStreamInfer(iter([_flood(i) for i in range(first, first + 500)]), timeout=60)
            for a in answers:
                codes[a.error_message.partition(":")[0] if a.error_message else "OK"] += 1
        bounds.sent = 10_000
    seconds = time.monotonic() - start
    samples, size = bounds.check()
    FIGURES["hostile requests"] = {
        "10,000 hostile requests": f"{seconds:.1f} s, {dict(codes)}",
        "metric samples before / after": f"{bounds.samples} / {samples}",
        "/metrics bytes before / after": f"{bounds.size:,} / {size:,}",
        "server RSS before / after": f"{bounds.rss / 2**20:.0f} / {_rss(hostile_server) / 2**20:.0f} MiB",
    }
    # A new series may appear only for a (model, status) pair of the fixed sets (here: RESOURCE_EXHAUSTED when
    # 500 requests at once fill g2p's queue), two samples each; nothing per name, id or parameter.
    assert samples - bounds.samples <= 4 and size - bounds.size < 1024, (bounds.samples, samples, bounds.size, size)
    assert {"NOT_FOUND", "INVALID_ARGUMENT", "OK"} <= set(codes) <= DESIGNED | {"RESOURCE_EXHAUSTED"}, codes


def test_grpcs_traceback_for_an_unsent_answer_becomes_one_line() -> None:
    """gRPC logs an eight-line traceback when an answer cannot be sent (its client reset the stream while
    it was being written); the server's log filter makes it one warning line naming the method."""
    from grpc._cython import cygrpc

    records: list[logging.LogRecord] = []
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    unsent = UnsentAnswer()
    grpc_log.addFilter(unsent)
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    grpc_log.addHandler(handler)
    try:
        try:
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (<SendMessageOperation>,)')
        except cygrpc.ExecuteBatchError:  # as grpc's aio server logs it
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/inference.X/ModelInfer")
    finally:
        grpc_log.removeHandler(handler)
        grpc_log.removeFilter(unsent)
    [record] = records
    line = logging.Formatter("%(levelname)s %(name)s: %(message)s").format(record)
    expected = "an answer on /inference.X/ModelInfer was not sent: its client left or refused it"
    assert line == f"WARNING grpc._cython.cygrpc: {expected}"
