"""The client tools on models qkv was not built around, against a real server: `qkv infer` with tensors
from JSON and .npy, checked against the metadata; `qkv bench` from a model's metadata; the address from
QKV_URL; a refused connection failing at once, naming the address; the seq_len label of a model without
a sequence axis."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from service import cli, protocol
from tests.conftest import MODELS, ROOT, RunningServer, start_server, stop_server

WIDTH = 4


def qkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)  # fmt: skip


def _double(directory: Path) -> None:
    """x FP32 [batch, 4] -> y = 2x, and n INT64 [batch] -> m = n + 1: a model with no sequence axis."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH]),
              helper.make_tensor_value_info("n", TensorProto.INT64, ["batch"])]  # fmt: skip
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH]),
               helper.make_tensor_value_info("m", TensorProto.INT64, ["batch"])]  # fmt: skip
    nodes = [helper.make_node("Add", ["x", "x"], ["y"]), helper.make_node("Add", ["n", "one"], ["m"])]
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    model = helper.make_model(helper.make_graph(nodes, "double", inputs, outputs, [one]),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    model.ir_version = 8
    (directory / "1").mkdir(parents=True)
    onnx.save(model, str(directory / "1" / "model.onnx"))
    (directory / "config.json").write_text(json.dumps({"instances": 1}))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shipped models and `double`, a model qkv knows nothing of."""
    repo = tmp_path_factory.mktemp("any_model") / "models"
    repo.mkdir()
    for name in ("g2p", "g2p_encoder"):
        (repo / name).symlink_to(MODELS / name, target_is_directory=True)
    _double(repo / "double")
    s = start_server(["--model-repository", str(repo)], tmp_path_factory.mktemp("log") / "server.log")
    yield s
    stop_server(s)


def refused_address() -> str:
    """An address nothing listens at: a port bound a moment ago, then let go."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


# --- qkv infer, tensors ------------------------------------------------------------------------------


def test_infer_sends_json_and_npy_tensors_and_prints_every_output(served: RunningServer, tmp_path: Path) -> None:
    url = ["--url", served.url]
    done = qkv("infer", *url, "--model", "double", "--input", "x=[[1, 2, 3, 4]]", "--input", "n=[7]", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["model_name"] == "double" and answer["model_version"] == "1"
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["y"] == {"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [2.0, 4.0, 6.0, 8.0]}
    assert outputs["m"] == {"name": "m", "datatype": "INT64", "shape": [1], "data": [8]}
    # .npy, @FILE of JSON one axis short (a batch axis added), --shape, --output: in text
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32).reshape(2, 4))
    (tmp_path / "n.json").write_text("[1, 2]")
    text = qkv("infer", *url, "--model", "double", "--input", f"x={tmp_path / 'x.npy'}", "--input",
               f"n=@{tmp_path / 'n.json'}", "--output", "y")  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == ["y FP32 [2, 4]", "[[ 0.  2.  4.  6.]", " [ 8. 10. 12. 14.]]"]
    shaped = qkv("infer", *url, "--model", "double", "--input", "x=[1, 2, 3, 4, 5, 6, 7, 8]", "--shape", "x=2,4",
                 "--input", "n=[1, 2]", "--datatype", "n=INT64", "--output", "m")  # fmt: skip
    assert shaped.returncode == 0 and shaped.stdout.splitlines() == ["m INT64 [2]", "[2 3]"], shaped
    # a sequence model and a text model, by tensors
    enc = qkv("infer", *url, "--model", "g2p_encoder", "--input", "input_ids=[[5, 6, 7]]", "--input",
              "attention_mask=[[1, 1, 1]]", "--json")  # fmt: skip
    assert enc.returncode == 0, enc.stderr
    assert all(o["shape"][:2] == [1, 3] for o in json.loads(enc.stdout)["outputs"]), enc.stdout
    g2p = qkv("infer", *url, "--model", "g2p", "--input", 'TEXT=["hello"]', "--output", "PHONEMES")
    assert g2p.returncode == 0 and g2p.stdout.splitlines() == ["PHONEMES BYTES [1]", "['HH AH0 L OW1']"], g2p


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "double", "--input", "z=[1]"], "input 'z': model 'double' has no such input (inputs: x, n)"),
        (["--model", "double", "--input", "x=[[1, 2, 3, 4]]"], "model 'double' needs input 'n' too"),
        (["--model", "double", "--input", "x=[[1, 2, 3]]", "--input", "n=[1]"],
         "input 'x': shape [1, 3] does not fit the model's [-1, 4]"),
        (["--model", "double", "--input", "x=[[1, 2, 3, 4]]", "--input", "n=[1]", "--datatype", "x=INT64"],
         "input 'x': --datatype INT64, the model takes FP32"),
        (["--model", "double", "--input", "x=[[1, 2, 3, 4]]", "--input", "n=[1.5]"],
         "input 'n': values of float64 do not fit the model's INT64 unchanged"),
        (["--model", "double", "--input", 'x=[["a", "b", "c", "d"]]', "--input", "n=[1]"],
         "input 'x': the model takes FP32, the value holds strings"),
        (["--model", "double", "--input", "x=[[1, 2], [3]]", "--input", "n=[1]"],
         "input 'x': the lists of its JSON are ragged"),
        (["--model", "double", "--input", "x={oops", "--input", "n=[1]"], "input 'x': not a .npy file, @FILE or JSON"),
        (["--model", "double", "--input", "x=missing.npy", "--input", "n=[1]"],
         "input 'x': file not found: missing.npy"),
        (["--model", "double", "--input", "x=[[1, 2, 3, 4]]", "--shape", "n=1"], "--shape n: no --input of that name"),
        (["--model", "double", "--input", "x=[1, 2, 3]", "--shape", "x=2,2", "--input", "n=[1]"],
         "input 'x': --shape [2, 2] holds 4 elements, the value has 3"),
        (["--model", "double", "--input", "x=[1]", "hello"], "give words (TEXT, for g2p) or --input"),
        (["--model", "double"], "nothing to send"),
    ],
)  # fmt: skip
def test_infer_refuses_tensors_the_metadata_rules_out(
    served: RunningServer, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (the same `main` the command runs): exit 2, one line naming the input."""
    assert cli.main(["infer", "--url", served.url, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("qkv infer: ") and message in err, err


def test_an_unknown_model_is_not_found(served: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["infer", "--url", served.url, "--model", "nope", "--input", "x=[1]"]) == 1
    assert "qkv infer: NOT_FOUND" in capsys.readouterr().err


# --- the address: QKV_URL, and a refused connection ----------------------------------------------------


def test_qkv_url_names_the_server_and_the_flag_wins(
    served: RunningServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QKV_URL", served.url)
    assert cli.main(["infer", "hello"]) == 0
    assert capsys.readouterr().out == "hello\tHH AH0 L OW1\n"  # CMUdict's, from the version's lexicon
    assert cli.main(["health"]) == 0 and capsys.readouterr().out == "SERVING\n"
    refused = refused_address()
    assert cli.main(["infer", "--url", refused, "hello"]) == 1  # the flag over the variable
    assert refused in capsys.readouterr().err
    monkeypatch.setenv("QKV_URL", refused)
    assert cli.main(["infer", "--url", served.url, "hello"]) == 0


@pytest.mark.parametrize(
    "command",
    [["infer", "hello"], ["infer", "--model", "double", "--input", "x=[1, 2, 3, 4]"], ["attention", "hello"],
     ["health"]],
)  # fmt: skip
def test_a_refused_connection_fails_at_once_naming_the_address(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens there: exit 1 with the address in the line, a refusal and not a deadline passed, long
    before the 60 s deadline the call was given (before: the client retried UNAVAILABLE until its deadline,
    10 s by default)."""
    address = refused_address()
    monkeypatch.setenv("QKV_URL", address)  # the address from the environment
    start = time.monotonic()
    code = cli.main([*command, "--timeout", "60"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1, err
    assert address in err and "UNAVAILABLE" in err and "connection refused" in err.lower(), err
    assert "DEADLINE_EXCEEDED" not in err
    assert elapsed < 5, f"{command}: {elapsed:.1f} s to fail"


def test_bench_on_a_refused_port_fails_at_once(tmp_path: Path) -> None:
    address = refused_address()
    start = time.monotonic()
    done = qkv("bench", "--url", address, "--model", "double", "--seconds", "1", "--out", str(tmp_path))
    assert done.returncode == 2 and done.stderr.startswith(f"qkv bench: cannot reach {address}: UNAVAILABLE")
    assert time.monotonic() - start < 60  # an interpreter's start included; no 5 s wait for the model


# --- qkv bench, any model ------------------------------------------------------------------------------


def test_bench_runs_any_model_from_its_metadata(served: RunningServer, tmp_path: Path) -> None:
    """`double` (no sequence axis, FP32 and INT64) and g2p_encoder with its lengths read from its configuration
    (1 to max_sequence_length 512, ids below vocab_size 33): every request answered OK."""
    with grpc.insecure_channel(served.url) as channel:
        params = protocol.Stub(channel).ModelConfig(protocol.ModelConfigRequest(name="g2p_encoder"), timeout=30)
    shown = {k: v.string_value for k, v in params.config.parameters.items()}
    assert {k: shown[k] for k in ("sequence_axis", "max_sequence_length", "vocab_size.input_ids")} == {
        "sequence_axis": "1", "max_sequence_length": "512", "vocab_size.input_ids": "33"}  # fmt: skip
    for model in ("double", "g2p_encoder"):
        out = tmp_path / model
        done = qkv("bench", "--url", served.url, "--model", model, "--concurrency", "2", "--seconds", "1",
                   "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr
        run = json.loads((out / "bench.json").read_text())["concurrency 2"]
        assert run["requests"] > 0 and run["codes"] == {"OK": run["requests"]}, run
        assert sorted(p.name for p in out.iterdir()) == ["bench.json"]  # what --help says a --url run writes
    from service.tools.bench.any_model import model_maker, model_shape

    shape = model_shape(served.url, "g2p_encoder")
    lengths = [model_maker(shape, None)(i)[1] for i in range(200)]
    assert min(lengths) >= 1 and max(lengths) <= 512 and max(lengths) > 64  # not the old constant 64


def test_bench_help_promises_only_what_a_url_run_writes() -> None:
    done = qkv("bench", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "It writes bench.json" in text and "No plot and no ceiling" in text, text
    assert "with the raw onnxruntime ceiling in the same run" not in text


# --- the seq_len label ---------------------------------------------------------------------------------


def test_a_model_without_a_sequence_axis_has_no_seq_len_label(served: RunningServer) -> None:
    assert cli.main(["infer", "--url", served.url, "--model", "double", "--input", "x=[1, 2, 3, 4]",
                     "--input", "n=[1]"]) == 0  # fmt: skip
    assert cli.main(["infer", "--url", served.url, "--model", "g2p_encoder", "--input", "input_ids=[5, 6, 7]",
                     "--input", "attention_mask=[1, 1, 1]"]) == 0  # fmt: skip
    text = urllib.request.urlopen(served.metrics_url, timeout=10).read().decode()
    counts = [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in
              re.findall(r"^qkv_request_duration_seconds_count\{([^}]*)\}", text, re.M)]  # fmt: skip
    double = [c for c in counts if c["model"] == "double"]
    assert double and all(c["seq_len"] == "" for c in double), double
    encoder = {c["seq_len"] for c in counts if c["model"] == "g2p_encoder"}
    assert "8" in encoder, encoder  # 3 tokens: the bucket up to 8
