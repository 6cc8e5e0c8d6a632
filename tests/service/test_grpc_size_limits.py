"""gRPC size limits by direction: the server sends answers up to Triton's limit (INT32_MAX) whatever it takes
in, and a refusal names the flag that raises it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.config import ServerSettings
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.onnx_models import widener

MIB = 1 << 20
RECEIVE = 4 * MIB  # the server's --max-message-bytes in these tests: far below what it answers


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("limits") / "models"
    widener(root / "widener")
    (root / "widener" / "config.json").write_text('{"max_batch_size": 0}')
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    s = start_server(["--model-repository", str(repo), "--max-message-bytes", str(RECEIVE)], repo.parent / "a.log")
    yield s
    stop_server(s)


def _widened(url: str, floats: int) -> np.ndarray:
    """The widener's answer of `floats` FP32 values, a request of a few bytes."""
    x, n = g.InferInput("x", [1, 1], "FP32"), g.InferInput("n", [1, 1], "INT64")
    x.set_data_from_numpy(np.full((1, 1), 0.5, dtype=np.float32))
    n.set_data_from_numpy(np.full((1, 1), floats, dtype=np.int64))
    with g.InferenceServerClient(url) as client:  # tritonclient receives up to 2 GiB - 1
        return client.infer("widener", [x, n]).as_numpy("y")  # type: ignore[no-any-return]


def test_the_send_limit_defaults_to_tritons() -> None:
    assert ServerSettings().max_send_message_bytes == 2**31 - 1
    assert ServerSettings().max_message_bytes == 64 * MIB


def test_an_answer_larger_than_the_receive_limit_is_sent(served: RunningServer) -> None:
    y = _widened(served.url, 3 * MIB)  # 12 MiB of FP32: over the receive limit and gRPC's 4 MiB default
    assert y.shape == (1, 3 * MIB) and (y == 0.5).all()


def test_an_answer_over_the_send_limit_is_refused_naming_the_flag(repo: Path, tmp_path: Path) -> None:
    args = ["--model-repository", str(repo), "--max-send-message-bytes", str(MIB)]
    with start_server(args, tmp_path / "small.log") as s:
        with pytest.raises(InferenceServerException) as e:
            _widened(s.url, MIB // 2)  # 2 MiB of FP32
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        message = str(e.value.message())
        assert "over the server's --max-send-message-bytes 1,048,576" in message, message
        assert _widened(s.url, 1000).shape == (1, 1000)  # a small answer still goes


def test_a_request_over_the_receive_limit_is_refused_with_the_limit(served: RunningServer) -> None:
    big = np.zeros((1, RECEIVE // 4 + 1024), dtype=np.float32)
    x = g.InferInput("x", list(big.shape), "FP32")
    x.set_data_from_numpy(big)
    with g.InferenceServerClient(served.url) as client, pytest.raises(InferenceServerException) as e:
        client.infer("widener", [x])
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert f"vs. {RECEIVE})" in str(e.value.message())  # gRPC's own words, with the limit --max-message-bytes sets
