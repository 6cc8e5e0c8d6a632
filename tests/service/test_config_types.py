"""config.json values are checked against their types at load, 64-bit integers also as protobuf-JSON decimal
strings (as Triton writes its configs); a request that no queue state could admit is refused as invalid.

The parser is checked on its own, for every section; then a real server: a request over max_queue_tokens is
INVALID_ARGUMENT on an idle server every time, a load RPC whose config has a value of the wrong type is
refused naming the key while the model keeps serving, a config written the Triton way loads and serves, and
a bad config.json stops the start in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as g
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from service.errors import ConfigError, InvalidArgument, ResourceExhausted
from service.models.catalog import BUILT_IN, check, find_kind
from service.repository.layout import _TOP_LEVEL, RepositoryError, as_integer, load_model_config
from service.scheduling.admission import Admission
from service.scheduling.config import BatchingConfig
from tests.conftest import ROOT, RunningServer, start_server

WIDE = 20_000  # a row of the `big` model this long is 20,000 tokens; two are over the default max_queue_tokens 32,768


def _config(tmp_path: Path, raw: dict[str, Any]) -> Any:
    """load_model_config of a model directory with one version, configured by `raw`."""
    (tmp_path / "m" / "1").mkdir(parents=True, exist_ok=True)
    return load_model_config(tmp_path / "m", raw=raw)


def _refused(tmp_path: Path, raw: dict[str, Any]) -> str:
    with pytest.raises(RepositoryError) as e:
        _config(tmp_path, raw)
    return str(e.value)


# Parser: each case is (config, what the message must say).
WRONG_TYPES = [
    ({"batching": {"max_queue_tokens": "lots"}}, 'batching.max_queue_tokens must be an integer, got "lots"'),
    ({"batching": {"max_queue_tokens": "8.5"}}, 'batching.max_queue_tokens must be an integer, got "8.5"'),
    ({"batching": {"max_batch_size": 8.5}}, "batching.max_batch_size must be an integer, got 8.5"),
    ({"batching": {"max_batch_size": 8.0}}, "batching.max_batch_size must be an integer, got 8.0"),
    ({"batching": {"max_batch_size": True}}, "batching.max_batch_size must be an integer, got true"),
    ({"batching": {"token_budget": "1e4"}}, 'batching.token_budget must be an integer, got "1e4"'),
    ({"batching": {"token_budget": " 8"}}, 'batching.token_budget must be an integer, got " 8"'),
    ({"batching": {"token_budget": [8]}}, "batching.token_budget must be an integer, got [8]"),
    ({"batching": {"max_queue_delay_ms": "2"}}, 'batching.max_queue_delay_ms must be a number, got "2"'),
    ({"batching": {"max_padding": float("nan")}}, "batching.max_padding must be a number, got NaN"),
    ({"batching": {"max_queue_wait_ms": float("inf")}}, "batching.max_queue_wait_ms must be a number, got Infinity"),
    ({"batching": {"max_queue_wait_ms": False}}, "batching.max_queue_wait_ms must be a number, got false"),
    ({"batching": {"enabled": "true"}}, 'batching.enabled must be true or false, got "true"'),
    ({"batching": {"length_aware": 1}}, "batching.length_aware must be true or false, got 1"),
    ({"batching": []}, "batching must be a JSON object, got []"),
    ({"max_batch_size": "eight"}, 'config.json: max_batch_size must be an integer, got "eight"'),
    ({"max_batch_size": "99999999999999999999"}, "max_batch_size must be an integer"),  # past 64 bits
    ({"instances": False}, "instances must be an integer, got false"),
    ({"instances": "2.0"}, 'instances must be an integer, got "2.0"'),
    ({"intra_op_threads": None}, "intra_op_threads must be an integer, got null"),
    ({"inter_op_threads": {"n": 1}}, 'inter_op_threads must be an integer, got {"n": 1}'),
    ({"optimization": 3}, "optimization must be a string, got 3"),
    ({"optimization": "fastest"}, "unknown optimization 'fastest'"),
    ({"precision": ["int8"]}, 'precision must be a string, got ["int8"]'),
    ({"sequence_axis": "1.5"}, 'sequence_axis must be an integer or null, got "1.5"'),
    ({"kind": 1}, "kind must be a string, got 1"),
    ({"name": ["m"]}, 'name must be a string, got ["m"]'),
    ({"limits": []}, "limits must be a JSON object, got []"),
    ({"limits": {"max_sequence_length": "long"}}, 'limits.max_sequence_length must be an integer, got "long"'),
    ({"limits": {"vocab_size": {"ids": 1.5}}}, "limits.vocab_size.ids must be an integer, got 1.5"),
    ({"limits": {"vocab_size": 100}}, "limits.vocab_size must be a JSON object"),
    ({"model_card": "a card"}, 'model_card must be a JSON object, got "a card"'),
    ({"version_policy": {"latest": {"num_versions": "two"}}}, 'version_policy.latest.num_versions must be an'),
    ({"version_policy": {"latest": {"num_versions": True}}}, "version_policy.latest.num_versions must be an"),
    ({"version_policy": {"specific": {"versions": ["1", "x"]}}}, 'version_policy.specific.versions must be a list'),
    ({"version_policy": {"specific": {"versions": [1.5]}}}, "version_policy.specific.versions must be a list"),
    ({"inputs": {"name": "x"}}, 'inputs must be a list [{"name": ..., "datatype": ..., "shape": [...]}]'),
    ({"inputs": ["x"]}, 'inputs[0] must be a JSON object {"name": ..., "datatype": ..., "shape": [...]}, got "x"'),
    ({"inputs": [{"name": 1, "datatype": "FP32", "shape": [-1]}]}, "inputs[0].name must be a string, got 1"),
    ({"outputs": [{"name": "y", "datatype": "FP32", "shape": ["-1", "three"]}]},
     'outputs[0].shape[1] must be an integer, got "three"'),
    ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, True]}]}, "outputs[0].shape[1] must be an integer"),
    ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [-2]}]}, "outputs[0].shape[0] must be -1 (dynamic) or"),
    ({"outputs": [{"name": "y", "datatype": "FP32", "shape": 3}]}, "outputs[0].shape must be a list of integers"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "says"), WRONG_TYPES, ids=[json.dumps(r)[:50] for r, _ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key_value_and_type(
    tmp_path: Path, raw: dict[str, Any], says: str
) -> None:
    message = _refused(tmp_path, raw)
    assert says in message, message
    assert message.startswith("model 'm': config.json: "), message


MISSPELT = [
    ({"max_batch_sise": 8}, "'max_batch_sise' (did you mean 'max_batch_size'?)"),
    ({"batching": {"max_queue_token": 8}}, "unknown setting(s) ['max_queue_token'] in batching"),
    ({"version_policy": {"latest": {"num_version": 2}}}, "unknown setting(s) ['num_version'] in version_policy.latest"),
    ({"version_policy": {"all": {"versions": [1]}}}, "unknown setting(s) ['versions'] in version_policy.all"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}]}, "missing ['shape']; unknown setting(s) ['dims']"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "says"), MISSPELT, ids=[json.dumps(r)[:50] for r, _ in MISSPELT])
def test_a_misspelt_key_is_refused_naming_it(tmp_path: Path, raw: dict[str, Any], says: str) -> None:
    message = _refused(tmp_path, raw)
    assert says in message, message


KIND_SCHEMA = [
    ({"limits": {"max_sequence_lenght": 8}}, "limits.max_sequence_lenght",
     "unknown limit(s) ['max_sequence_lenght'] for a tensor model"),
    ({"kind": "g2p", "limits": {"max_sequence_length": 8}}, "limits.max_sequence_length",
     "unknown limit(s) ['max_sequence_length'] for a g2p"),
    ({"kind": "tensor", "text": {"pooling": "mean"}}, "text", "text is a section of the text kind's config"),
    ({"kind": "nope"}, "kind", "kind 'nope': no such kind (built in: tensor, g2p, ensemble, text, generation"),
    ({"kind": "no_such_module:Kind"}, "kind", "cannot import 'no_such_module'"),
    ({"kind": "service.models.catalog:Nothing"}, "kind", "module 'service.models.catalog' has no 'Nothing'"),
    ({"kind": "service.models.catalog:BUILT_IN"}, "kind", "service.models.catalog:BUILT_IN is not a kind"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "key", "says"), KIND_SCHEMA, ids=[json.dumps(r)[:50] for r, _, _ in KIND_SCHEMA])
def test_what_a_kind_reads_is_checked_against_its_kind_naming_the_file_and_key(
    tmp_path: Path, raw: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as e:
        check(_config(tmp_path, raw))
    assert e.value.key == key and e.value.file == tmp_path / "m" / "config.json", (e.value.key, e.value.file)
    assert says in str(e.value) and str(e.value).startswith(str(tmp_path / "m" / "config.json")), str(e.value)


def test_64_bit_integers_may_be_decimal_strings(tmp_path: Path) -> None:
    assert [as_integer(v) for v in (8, "8", "-1", "0", "9223372036854775807")] == [8, 8, -1, 0, 2**63 - 1]
    for bad in ("8.5", "abc", "", " 8", "+8", "0x10", "1e3", "9223372036854775808", True, False, 8.0, None, [8]):
        assert as_integer(bad) is None, bad
    c = _config(tmp_path, {
        "max_batch_size": "8",
        "instances": "1",
        "sequence_axis": "1",
        "batching": {"max_queue_tokens": "65536", "token_budget": "4096", "max_queue_delay_ms": 3},
        "limits": {"max_sequence_length": "128", "vocab_size": {"ids": "1000"}},
        "version_policy": {"specific": {"versions": ["1"]}},
        "inputs": [{"name": "ids", "datatype": "INT64", "shape": ["-1", "-1"]}],
    })  # fmt: skip
    assert c.batching.max_batch_size == 8 and c.instances == 1 and c.sequence_axis == 1
    assert (c.batching.max_queue_tokens, c.batching.token_budget) == (65536, 4096)
    assert c.limits == {"max_sequence_length": 128, "vocab_size": {"ids": 1000}}
    assert c.version_policy.versions == (1,)
    assert c.inputs == ({"name": "ids", "datatype": "INT64", "shape": [-1, -1]},)
    assert "max_batch_size" in c.batching_given and "token_budget" in c.batching_given
    # batching wins over the top-level max_batch_size, both checked
    assert _config(tmp_path, {"max_batch_size": "8", "batching": {"max_batch_size": 4}}).batching.max_batch_size == 4


def test_a_config_in_tritons_json_form_is_read_and_one_mixed_with_qkvs_logs_tritons_fields(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    triton = {
        "name": "m", "platform": "onnxruntime_onnx", "max_batch_size": "4",
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["3"]}],
        "instance_group": [{"count": "1", "kind": "KIND_CPU"}],
    }  # fmt: skip
    c = _config(tmp_path, triton)
    assert c.batching.max_batch_size == 4 and c.instances == 1
    assert c.inputs == ({"name": "x", "datatype": "FP32", "shape": [-1, 3]},)
    c = _config(tmp_path, {**triton, "instances": 2})  # qkv's form: Triton's fields are not read, and it says so
    assert c.inputs == () and c.instances == 2
    assert "['input', 'instance_group', 'platform'] are not read by qkv" in caplog.text


def test_the_keys_checked_are_those_the_loader_and_the_models_read() -> None:
    from tests.test_docs import limit_reads, loader_keys

    assert set(_TOP_LEVEL) == loader_keys()

    read: dict[str, set[str]] = {}
    for key, kind in limit_reads():
        read.setdefault(kind, set()).add(key)
    limits = {name: find_kind(name).limits for name in BUILT_IN}
    assert {kind: set(keys) for kind, keys in limits.items() if keys} == read  # an ensemble, a text model: none


def test_a_request_that_can_never_fit_is_invalid_not_overload() -> None:
    for kinds in (("",), ("greedy", "beam")):
        admission = Admission("dense", BatchingConfig(max_queue_tokens=32_768, max_queue_requests=4), 1, kinds)
        for _ in range(3):  # on an idle queue, every time
            with pytest.raises(InvalidArgument) as e:
                admission.admit(50_176, None, kinds[0])
            assert str(e.value) == (
                "model 'dense': one request of 50,176 tokens can never fit max_queue_tokens 32,768 "
                '(config.json "batching": {"max_queue_tokens": ...} raises it)'
            )
        assert admission.queued_requests == 0 and admission.queued_tokens == 0
        admission.admit(32_768, None, kinds[0])  # the whole bound fits
        with pytest.raises(ResourceExhausted):  # while it is queued, the next waits its turn: retryable
            admission.admit(1, None, kinds[0])
        with pytest.raises(InvalidArgument, match="max_queue_tokens"):  # and this one still never fits
            admission.admit(32_769, None, kinds[-1])


def test_a_queue_that_admits_nothing_says_which_setting() -> None:
    admission = Admission("m", BatchingConfig(max_queue_requests=0), 1)
    with pytest.raises(InvalidArgument, match=r"max_queue_requests 0 \(config.json"):
        admission.admit(1, None)


# A real server.


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _doubler(model_dir: Path, width: int | str, config: dict[str, Any] | str | None) -> None:
    """y = 2 x, x and y FP32 [batch, width]; `config` written as its config.json (a string as it is)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    _save(helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "doubler", [x], [y], [two]),
          model_dir / "1" / "model.onnx")  # fmt: skip
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (model_dir / "config.json").write_text(text)


# config.json as Triton writes it in JSON (64-bit integers as strings), with qkv's own batching beside it.
TRITON_STYLE = {
    "name": "triton",
    "platform": "onnxruntime_onnx",
    "max_batch_size": "8",
    "version_policy": {"specific": {"versions": ["1"]}},
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["3"]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": ["3"]}],
    "instance_group": [{"count": "1", "kind": "KIND_CPU"}],
    "dynamic_batching": {"max_queue_delay_microseconds": "100"},
    "instances": "1",
    "batching": {"max_queue_tokens": "4096"},
    "inputs": [{"name": "x", "datatype": "FP32", "shape": ["-1", "3"]}],
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, g.InferenceServerClient]]:
    """An explicit-mode server: `big` (rows x length tokens, max_batch_size 8), `scale` and `triton`."""
    tmp = tmp_path_factory.mktemp("config_types")
    repo = tmp / "repo"
    _doubler(repo / "big", "length", {"max_batch_size": 8, "sequence_axis": 1, "instances": 1})
    _doubler(repo / "scale", 3, {"instances": 1})
    _doubler(repo / "triton", 3, TRITON_STYLE)
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model", "big"]
    with start_server(args, tmp / "log") as server, g.InferenceServerClient(server.url) as client:
        yield server, client


def _infer(client: g.InferenceServerClient, model: str, rows: int, width: int) -> np.ndarray:
    x = g.InferInput("x", [rows, width], "FP32")
    x.set_data_from_numpy(np.ones((rows, width), np.float32))
    return client.infer(model, [x]).as_numpy("y")  # type: ignore[no-any-return]


def _status(call: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as e:
        call()
    return str(e.value.status()), e.value.message()


def test_a_request_over_max_queue_tokens_is_invalid_on_an_idle_server(
    served: tuple[RunningServer, g.InferenceServerClient],
) -> None:
    _, client = served
    assert (_infer(client, "big", 1, WIDE) == 2).all()  # 20,000 tokens: within 32,768
    for _ in range(3):  # 40,000 tokens, as two rows or one: the same answer every time, not a retryable one
        for rows, length in ((2, WIDE), (1, 2 * WIDE)):
            code, message = _status(lambda: _infer(client, "big", rows, length))  # noqa: B023
            assert code == "StatusCode.INVALID_ARGUMENT", (code, message)
            assert "40,000 tokens can never fit max_queue_tokens 32,768" in message, message
            assert '"batching": {"max_queue_tokens": ...} raises it' in message, message
    assert (_infer(client, "big", 1, WIDE) == 2).all()  # nothing was left queued


def test_a_load_with_a_value_of_the_wrong_type_is_refused_and_the_model_keeps_serving(
    served: tuple[RunningServer, g.InferenceServerClient],
) -> None:
    _, client = served
    client.load_model("scale")
    assert (_infer(client, "scale", 2, 3) == 2).all()
    for config, says in (
        ({"batching": {"max_queue_tokens": "lots"}}, 'batching.max_queue_tokens must be an integer, got "lots"'),
        ({"max_batch_size": 8.5}, "max_batch_size must be an integer, got 8.5"),
        ({"instances": True}, "instances must be an integer, got true"),
        ({"batching": {"enabled": "yes"}}, 'batching.enabled must be true or false, got "yes"'),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": ["-1", "3.0"]}]}, "inputs[0].shape[1]"),
        ({"max_batch_sise": 8}, "did you mean 'max_batch_size'?"),
    ):
        code, message = _status(lambda: client.load_model("scale", config=json.dumps(config)))  # noqa: B023
        assert code == "StatusCode.INVALID_ARGUMENT", (config, code, message)
        assert message.startswith("failed to load 'scale': model 'scale': config.json: "), message
        assert says in message, message
        assert (_infer(client, "scale", 2, 3) == 2).all(), "the serving version stopped serving"
    # Int64 values as strings in a load's config, too.
    client.load_model("scale", config=json.dumps({"max_batch_size": "4", "batching": {"token_budget": "64"}}))
    assert client.get_model_config("scale").config.max_batch_size == 4
    code, message = _status(lambda: _infer(client, "scale", 5, 3))
    assert code == "StatusCode.INVALID_ARGUMENT" and "max_batch_size 4" in message, message


def test_a_config_written_the_triton_way_loads_and_serves(
    served: tuple[RunningServer, g.InferenceServerClient],
) -> None:
    server, client = served
    client.load_model("triton")  # its config.json, as in TRITON_STYLE
    assert client.get_model_config("triton").config.max_batch_size == 8
    assert (_infer(client, "triton", 8, 3) == 2).all()
    assert "are not read by qkv" in server.log.read_text()


def test_a_bad_config_stops_the_start_in_one_line(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _doubler(repo / "scale", 3, '{"batching": {"max_queue_tokens": "lots"}}')
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
         "--metrics-port", "0", "--model-repository", str(repo)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (
        "qkv: model 'scale': config.json: batching.max_queue_tokens must be an integer, got \"lots\""
    ), done.stderr
    assert "Traceback" not in done.stderr
