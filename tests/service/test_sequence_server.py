"""Stateful models on a real server, through tritonclient as Triton's sequence examples use it: ONNX stand-ins
for Triton's simple_sequence (direct), simple_dyna_sequence (oldest, END and CORRID) and
simple_string_dyna_sequence (a running sum in implicit state, a string correlation id).
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, start_server, stop_server

VALUES = [11, 7, 5, 3, 2, 0, 1]  # what Triton's examples send after a first value


def _control(name: str, kind: str) -> dict[str, Any]:
    return {"name": name, "control": [{"kind": f"CONTROL_SEQUENCE_{kind}", "int32_false_true": [0, 1]}]}


def _corrid(data_type: str) -> dict[str, Any]:
    return {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": data_type}]}


def _save(directory: Path, nodes: list[Any], inputs: list[Any], outputs: list[Any], config: dict[str, Any]) -> None:
    graph = helper.make_graph(nodes, directory.name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "config.json").write_text(json.dumps(config))


def _row(name: str, kind: int = TensorProto.INT32) -> Any:
    return helper.make_tensor_value_info(name, kind, ["batch", 1])


def sequence_models(root: Path) -> None:
    """The three models Triton's sequence examples call, as ONNX graphs."""
    # OUTPUT = READY * (INPUT + START): Triton's own ONNX simple_sequence; the default strategy (direct).
    _save(
        root / "simple_sequence",
        [helper.make_node("Add", ["INPUT", "START"], ["sum"]), helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"])],
        [_row("INPUT"), _row("START"), _row("READY")],
        [_row("OUTPUT")],
        {"max_batch_size": 8, "sequence_batching": {"control_input": [_control("START", "START"),
                                                                      _control("READY", "READY")]}},
    )  # fmt: skip
    # ... + END * CORRID: Triton's simple_dyna_sequence, the oldest strategy.
    _save(
        root / "simple_dyna_sequence",
        [
            helper.make_node("Cast", ["CORRID"], ["id"], to=TensorProto.INT32),
            helper.make_node("Add", ["INPUT", "START"], ["sum"]),
            helper.make_node("Mul", ["END", "id"], ["last"]),
            helper.make_node("Add", ["sum", "last"], ["total"]),
            helper.make_node("Mul", ["READY", "total"], ["OUTPUT"]),
        ],
        [_row("INPUT"), _row("START"), _row("END"), _row("READY"), _row("CORRID", TensorProto.UINT64)],
        [_row("OUTPUT")],
        {
            "max_batch_size": 8,
            "sequence_batching": {
                "max_sequence_idle_microseconds": "10000000",
                "oldest": {"max_candidate_sequences": 1024, "max_queue_delay_microseconds": "10000"},
                "control_input": [_control("START", "START"), _control("END", "END"), _control("READY", "READY"),
                                  _corrid("TYPE_UINT64")],
            },
        },
    )  # fmt: skip
    # A running sum kept as implicit state: STATE_OUT = STATE_IN + INPUT, OUTPUT the same plus END * CORRID
    # (a string correlation id, parsed by the graph).
    _save(
        root / "simple_string_dyna_sequence",
        [
            helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
            helper.make_node("Cast", ["CORRID"], ["id"], to=TensorProto.INT32),
            helper.make_node("Mul", ["END", "id"], ["last"]),
            helper.make_node("Add", ["STATE_OUT", "last"], ["OUTPUT"]),
        ],
        [_row("INPUT"), _row("END"), _row("CORRID", TensorProto.STRING), _row("STATE_IN")],
        [_row("OUTPUT"), _row("STATE_OUT")],
        {
            "max_batch_size": 8,
            "sequence_batching": {
                "oldest": {},
                "control_input": [_control("END", "END"), _corrid("TYPE_STRING")],
                "state": [{"input_name": "STATE_IN", "output_name": "STATE_OUT", "data_type": "TYPE_INT32",
                           "dims": [1], "initial_state": [{"data_type": "TYPE_INT32", "dims": [1],
                                                           "zero_data": True, "name": "zeros"}]}],
            },
        },
    )  # fmt: skip


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "workers-2"])
def served(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """One server, and one of two worker processes (a sequence's requests reach the worker holding it)."""
    root = tmp_path_factory.mktemp("sequences") / "models"
    sequence_models(root)
    s = start_server(["--model-repository", str(root), "--workers", request.param], root.parent / "server.log")
    yield s
    stop_server(s)
    assert "Traceback" not in s.output()


def _inputs(value: int, module: Any = grpcclient) -> list[Any]:
    data = np.full((1, 1), value, dtype=np.int32)
    x = module.InferInput("INPUT", [1, 1], "INT32")
    x.set_data_from_numpy(data)
    return [x]


def _expected(dyna: bool, sid0: int, sid1: int, sid2: str) -> list[list[int]]:
    """What Triton's examples check, row by row: the two integer sequences and the string one."""
    rows = []
    previous = 0
    for i in range(len(VALUES) + 1):
        a = 1 if i == 0 else VALUES[i - 1]
        b = 101 if i == 0 else -VALUES[i - 1]
        if dyna:
            c = 20 if i == 0 else previous - VALUES[i - 1]
            previous = c
        else:
            c = 21 if i == 0 else -VALUES[i - 1]
        if dyna and i == len(VALUES):
            a, b, c = a + sid0, b + sid1, c + int(sid2)
        rows.append([a, b, c])
    return rows


@pytest.mark.parametrize("dyna", [False, True])
def test_tritons_sync_sequence_example_gets_its_answers(served: RunningServer, dyna: bool) -> None:
    client = grpcclient.InferenceServerClient(served.url)
    models = ("simple_dyna_sequence", "simple_string_dyna_sequence") if dyna else ("simple_sequence",) * 2
    sid2 = "1002" if dyna else "3f2a-uuid"
    sequences = [(1000, [0, *VALUES], models[0]), (1001, [100] + [-v for v in VALUES], models[0]),
                 (sid2, [20] + [-v for v in VALUES], models[1])]  # fmt: skip
    got = []
    for sid, values, model in sequences:
        out = []
        for i, v in enumerate(values):
            r = client.infer(
                model, _inputs(v), sequence_id=sid, sequence_start=i == 0, sequence_end=i == len(values) - 1
            )
            out.append(int(r.as_numpy("OUTPUT")[0, 0]))
        got.append(out)
    expected = _expected(dyna, 1000, 1001, sid2 if dyna else "0")
    assert [list(row) for row in zip(*got, strict=True)] == expected


def test_tritons_stream_sequence_example_gets_its_answers(served: RunningServer) -> None:
    """Three sequences interleaved on one stream, as the streaming example sends them (all at once)."""
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(served.url)
    client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), answers))
    negative = [-v for v in VALUES]
    sequences = [(1000, [0, *VALUES], "simple_dyna_sequence"), (1001, [100, *negative], "simple_dyna_sequence"),
                 ("1002", [20, *negative], "simple_string_dyna_sequence")]  # fmt: skip
    for sid, values, model in sequences:
        for i, v in enumerate(values):
            client.async_stream_infer(
                model, _inputs(v), request_id=f"{sid}_{i}", sequence_id=sid, sequence_start=i == 0,
                sequence_end=i == len(values) - 1,
            )  # fmt: skip
    got: dict[str, dict[int, int]] = {}
    for _ in range(3 * (len(VALUES) + 1)):
        r = answers.get(timeout=60)
        assert not isinstance(r, InferenceServerException), r
        sid, i = r.get_response().id.split("_")
        got.setdefault(sid, {})[int(i)] = int(r.as_numpy("OUTPUT")[0, 0])
    client.stop_stream()
    columns = [[got[str(sid)][i] for i in range(len(VALUES) + 1)] for sid, _, _ in sequences]
    assert [list(row) for row in zip(*columns, strict=True)] == _expected(True, 1000, 1001, "1002")


def test_http_clients_send_sequences_too(served: RunningServer) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    out = []
    for i, v in enumerate([4, 5, 6]):
        r = client.infer("simple_string_dyna_sequence", _inputs(v, httpclient), sequence_id="7", sequence_start=i == 0,
                         sequence_end=i == 2)  # fmt: skip
        out.append(int(r.as_numpy("OUTPUT")[0, 0]))
    assert out == [4, 9, 15 + 7]


def test_the_server_filled_inputs_are_hidden_and_refused(served: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(served.url)
    meta = client.get_model_metadata("simple_string_dyna_sequence")
    assert [t.name for t in meta.inputs] == ["INPUT"]
    assert [t.name for t in meta.outputs] == ["OUTPUT", "STATE_OUT"]
    state = grpcclient.InferInput("STATE_IN", [1, 1], "INT32")
    state.set_data_from_numpy(np.zeros((1, 1), np.int32))
    with pytest.raises(InferenceServerException, match=r"has no input 'STATE_IN' \(inputs: INPUT\)") as e:
        client.infer("simple_string_dyna_sequence", [*_inputs(1), state], sequence_id=5, sequence_start=True)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "non-zero, non-empty 'sequence_id'"),
        ({"sequence_id": 4242}, "sequence 4242 is not live .* must set sequence_start"),
        (
            {"sequence_id": "abc", "sequence_start": True},
            "sequence_id 'abc' is a string, and the model's correlation id",
        ),
    ],
)
def test_requests_outside_a_sequence_are_refused_naming_why(
    served: RunningServer, params: dict[str, Any], message: str
) -> None:
    client = grpcclient.InferenceServerClient(served.url)
    with pytest.raises(InferenceServerException, match=message) as e:
        client.infer("simple_dyna_sequence", _inputs(1), **params)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_the_state_output_comes_back_when_asked_for(served: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(served.url)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT"), grpcclient.InferRequestedOutput("STATE_OUT")]
    client.infer("simple_string_dyna_sequence", _inputs(3), sequence_id="99", sequence_start=True)
    r = client.infer("simple_string_dyna_sequence", _inputs(4), outputs=outputs, sequence_id="99", sequence_end=True)
    assert int(r.as_numpy("STATE_OUT")[0, 0]) == 7 and int(r.as_numpy("OUTPUT")[0, 0]) == 7 + 99
