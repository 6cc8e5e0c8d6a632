"""Padding proven safe per model at load: an encoder without a mask, served with a sequence axis, is batched
only with requests of equal length (and says so); one with a mask keeps padded batches. Every concurrent
answer is compared with onnxruntime in process on the same request alone."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as g

from service.repository.layout import RepositoryError, load_model_config
from tests.conftest import RunningServer
from tests.figures import FIGURES
from tests.service.onnx_models import VOCAB, masked_encoder, maskless_encoder, metric, serving

REQUESTS = 300
SEQUENCE = {"sequence_axis": 1}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("padding") / "models"
    maskless_encoder(root / "maskless", SEQUENCE)
    masked_encoder(root / "masked", SEQUENCE)
    maskless_encoder(root / "trusted", {**SEQUENCE, "batching": {"padding": "safe"}})
    maskless_encoder(root / "renamed", SEQUENCE, output_axis="positions")  # y's length axis not named "seq"
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


def _requests(masked: bool) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(47)
    out = []
    for _ in range(REQUESTS):
        n = int(rng.integers(1, 25))
        feeds = {"ids": rng.integers(0, VOCAB, size=(1, n)).astype(np.int64)}
        if masked:
            feeds["attention_mask"] = np.ones((1, n), dtype=np.int64)
        out.append(feeds)
    return out


def _wrong_answers(served: RunningServer, repo: Path, model: str, masked: bool) -> int:
    """How many of REQUESTS concurrent mixed-length requests differ from the same request run alone."""
    session = ort.InferenceSession(str(repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    requests = _requests(masked)

    def call(feeds: dict[str, np.ndarray]) -> np.ndarray:
        tensors = []
        for name, a in feeds.items():
            t = g.InferInput(name, list(a.shape), "INT64")
            t.set_data_from_numpy(a)
            tensors.append(t)
        answer = client.infer(model, tensors).as_numpy("y")
        assert answer is not None
        return answer

    with g.InferenceServerClient(served.url) as client, ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, requests))
    wrong = 0
    for feeds, answer in zip(requests, answers, strict=True):
        (alone,) = session.run(["y"], feeds)
        assert answer.shape == alone.shape, "an output along the sequence axis is cut back to the request's length"
        wrong += not np.allclose(answer, alone, rtol=1e-5, atol=1e-5)
    return wrong


def _parameters(served: RunningServer, model: str) -> dict[str, str]:
    with g.InferenceServerClient(served.url) as client:
        config = client.get_model_config(model).config
    return {k: v.string_value for k, v in config.parameters.items() if k.startswith("batching.padding")}


def test_an_encoder_without_a_mask_is_batched_only_with_equal_lengths_and_answers_as_alone(
    served: RunningServer, repo: Path
) -> None:
    wrong = _wrong_answers(served, repo, "maskless", masked=False)
    FIGURES.setdefault("padding", {})["maskless encoder, 300 concurrent mixed-length requests"] = f"{wrong} wrong"
    assert wrong == 0
    text = urllib.request.urlopen(served.metrics_url, timeout=30).read().decode()
    assert metric(text, "qkv_batch_tokens_total", model="maskless", kind="padding") == 0, "nothing was padded"
    assert metric(text, "qkv_batch_tokens_total", model="maskless", kind="real") > 0
    log = served.output()
    assert "model 'maskless': padding changes its outputs (output 'y' of a row of length" in log
    assert 'set "batching": {"padding": "safe"} in config.json' in log
    parameters = _parameters(served, "maskless")
    assert parameters["batching.padding"] == "unsafe"
    assert parameters["batching.padding.source"].startswith("checked at load: output 'y' of a row of length")


def test_an_encoder_with_a_mask_keeps_padded_batches_and_answers_as_alone(served: RunningServer, repo: Path) -> None:
    assert _wrong_answers(served, repo, "masked", masked=True) == 0
    assert _parameters(served, "masked") == {"batching.padding": "safe", "batching.padding.source": "checked at load"}
    assert "model 'masked': padding" not in served.output().replace("padding along", "")


def test_padding_trusted_by_config_is_not_checked(served: RunningServer, repo: Path) -> None:
    """The override: padded as config.json says, the answers of padded rows then differ from alone (counted,
    not asserted: how many batches mix lengths depends on the machine)."""
    assert _parameters(served, "trusted") == {"batching.padding": "safe", "batching.padding.source": "config.json"}
    assert "model 'trusted': padding changes" not in served.output()
    wrong = _wrong_answers(served, repo, "trusted", masked=False)
    FIGURES.setdefault("padding", {})["the same encoder, padding trusted (config.json)"] = f"{wrong} wrong"


def test_an_output_whose_length_follows_the_padding_under_another_name_fails_the_check(
    served: RunningServer, repo: Path
) -> None:
    parameters = _parameters(served, "renamed")
    assert parameters["batching.padding"] == "unsafe"
    assert "its length follows the padded length" in parameters["batching.padding.source"]
    assert _wrong_answers(served, repo, "renamed", masked=False) == 0


def test_an_unknown_padding_setting_is_refused_at_load(tmp_path: Path) -> None:
    maskless_encoder(tmp_path / "m", {**SEQUENCE, "batching": {"padding": "sometimes"}})
    with pytest.raises(RepositoryError, match=r"batching\.padding must be one of check, safe, unsafe"):
        load_model_config(tmp_path / "m")
