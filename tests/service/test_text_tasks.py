"""A classifier and a cross-encoder, built from transformers configs with fixed random weights and exported
with optimum, dropped in with no config: their scores held to transformers on the same folder
(probabilities within 1e-4, the reranker's order identical), over TEI's /predict and /rerank and v2
(Triton's classification extension names the labels)."""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.models.catalog import recognised
from service.models.text.batching import INLINE_SECONDS
from service.models.text.model import build_text_model
from service.observability.metrics import Metrics, ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import load_model
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.text_models import real_texts, repository, small_bert

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def classifier(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return small_bert(request.config.cache, "classifier", 3)


@pytest.fixture(scope="module")
def reranker(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return small_bert(request.config.cache, "reranker", 1)


@pytest.fixture(scope="module")
def server(
    classifier: tuple[Path, Path], reranker: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("tasks")
    repo = repository(tmp, {"classifier": classifier[1], "reranker": reranker[1]})
    s = start_server(["--model-repository", str(repo)], tmp / "server.log", timeout=180)
    yield s
    stop_server(s)


def post(server: RunningServer, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference(source: Path, first: list[str], second: list[str] | None = None) -> np.ndarray:
    """transformers on the source folder: the logits of each text (or pair)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    model = AutoModelForSequenceClassification.from_pretrained(str(source)).eval()
    batch = tokenizer(first, second, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.numpy()


def test_classifier_probabilities_match_transformers(server: RunningServer, classifier: tuple[Path, Path]) -> None:
    import tritonclient.grpc as g

    texts = real_texts(24)
    logits = reference(classifier[0], texts)
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    with g.InferenceServerClient(server.url) as c:
        text = g.InferInput("TEXT", [len(texts)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        scores = c.infer("classifier", [text]).as_numpy("SCORES")
        top = c.infer("classifier", [text], outputs=[g.InferRequestedOutput("SCORES", class_count=2)])
    assert scores.shape == (24, 3)
    assert np.abs(scores - expected).max() <= 1e-4
    # Triton's classification extension: "<score>:<index>:<label>", the labels from config.json's id2label
    first = top.as_numpy("SCORES")[0]
    best = int(np.argmax(expected[0]))
    assert first[0].decode().split(":")[1:] == [str(best), f"label_{'abc'[best]}"]
    # TEI's /predict: each text's labels, best first; top_k cuts them
    status, predicted = post(server, "/predict", {"model": "classifier", "inputs": texts[:2], "top_k": 2})
    assert status == 200 and [len(p) for p in predicted] == [2, 2]
    assert predicted[0][0]["label"] == f"label_{'abc'[best]}"
    assert abs(predicted[0][0]["score"] - float(expected[0, best])) <= 1e-4


def test_reranker_order_matches_transformers(server: RunningServer, reranker: tuple[Path, Path]) -> None:
    import tritonclient.http as h

    query = "how does the server batch requests of different lengths"
    documents = real_texts(16)
    logits = reference(reranker[0], [query] * len(documents), documents)[:, 0]
    expected = 1 / (1 + np.exp(-logits))
    status, ranked = post(server, "/rerank", {"query": query, "texts": documents, "return_text": True})
    assert status == 200
    assert [r["index"] for r in ranked] == list(np.argsort(-expected, kind="stable"))
    assert np.abs(np.array([r["score"] for r in ranked]) - np.sort(expected)[::-1]).max() <= 1e-4
    assert ranked[0]["text"] == documents[ranked[0]["index"]]
    c = h.InferenceServerClient(server.http_url)
    q = h.InferInput("QUERY", [1], "BYTES")
    q.set_data_from_numpy(np.array([query.encode()], dtype=object))
    t = h.InferInput("TEXT", [len(documents)], "BYTES")
    t.set_data_from_numpy(np.array([d.encode() for d in documents], dtype=object))
    scores = c.infer("reranker", [q, t]).as_numpy("SCORES")
    c.close()
    assert np.abs(scores - expected).max() <= 1e-4


def test_task_errors_name_the_field(server: RunningServer) -> None:
    status, answer = post(server, "/rerank", {"model": "reranker", "texts": ["a"]})
    assert status == 400 and "query" in answer["error"]
    status, answer = post(server, "/rerank", {"model": "classifier", "query": "q", "texts": ["a"]})
    assert status == 400 and "not a rerank model" in answer["error"]
    status, answer = post(server, "/predict", {"model": "classifier", "inputs": "x", "top_k": 0})
    assert status == 400 and "top_k" in answer["error"]
    status, answer = post(server, "/embed", {"inputs": "x"})
    assert status == 400 and "model" in answer["error"]
    status, answer = post(server, "/predict", {"model": "classifier", "inputs": "x", "long_inputs": "chunk"})
    assert status == 400 and "long_inputs" in answer["error"]


def test_warm_up_times_texts_alone_on_the_lone_session_for_the_loops_bound(
    classifier: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The text kind's inline bound for the lone session (service/models/text/batching.py): one request of
    each length run through the batch step on that session, in process, and the longest the loop computes
    chosen from those times (the lone session kept as warm-up keeps it where every core gains)."""
    repo = repository(tmp_path, {"classifier": classifier[1]})
    (config,) = load_model(repo / "classifier", kind_of=recognised)
    model = build_text_model(config, ["CPUExecutionProvider"], ModelObserver(Metrics(), "classifier", "1"),
                             ComputeThreads())  # fmt: skip
    encoder = model.encoder
    if encoder.runtime.lone is None:
        pytest.skip("one core: no lone session")
    encoder.batcher.lone, encoder.batcher.lone_min_tokens = True, 16
    with caplog.at_level(logging.INFO, "qkv.models"):
        encoder._choose_inline((16, 32, 64))
    (said,) = [r.getMessage() for r in caplog.records if "a text alone of up to" in r.getMessage()]
    times = [(int(t), float(ms) / 1e3) for t, ms in re.findall(r"(\d+): ([\d.]+) ms", said)]
    assert [t for t, _ in times] == [16, 32, 64][: len(times)] and all(s > 0 for _, s in times)
    chosen = encoder.batcher.lone_inline_max_tokens
    assert chosen == 0 if times[0][1] > INLINE_SECONDS else 16 <= chosen <= 64
    assert f"up to {chosen} tokens" in said
