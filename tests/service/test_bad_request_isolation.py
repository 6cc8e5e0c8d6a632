"""A failing request fails alone: one request that passes every declared limit but fails in onnxruntime (an id
out of a lookup table that declares no vocabulary) among many good ones; limits checked before batching; and
a g2p word whose decoding fails ends its own request only."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.decoding.words import greedy_decode
from service.models.catalog import Context, build
from service.observability.metrics import Metrics
from service.repository.layout import RepositoryError, load_model_config
from service.scheduling.admission import WorkItem
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.seq2seq.generation import beam_search
from service.seq2seq.graphs import OnnxSeq2Seq, session_options
from service.seq2seq.vocab import Vocabulary
from tests.conftest import MODELS, RunningServer
from tests.figures import FIGURES
from tests.service.onnx_models import VOCAB, lookup, metric, serving
from tests.service.queue_helpers import Recorder

GOOD = 360
BAD_ID = 1000  # past the table's VOCAB rows


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("isolation") / "models"
    lookup(root / "lookup", {"sequence_axis": 1})
    lookup(root / "ranged", {"sequence_axis": 1, "limits": {"value_range": {"ids": [0, VOCAB - 1]}}})
    return root


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


def _input(ids: np.ndarray) -> list[g.InferInput]:
    t = g.InferInput("ids", list(ids.shape), "INT64")
    t.set_data_from_numpy(ids)
    return [t]


def test_one_bad_request_among_many_fails_alone(served: RunningServer, repo: Path) -> None:
    rng = np.random.default_rng(360)
    good = [rng.integers(0, VOCAB, size=(1, int(rng.integers(4, 9)))).astype(np.int64) for _ in range(GOOD)]
    bad = np.array([[1, 2, BAD_ID, 3, 4, 5]], dtype=np.int64)
    requests = [*good[: GOOD // 2], bad, *good[GOOD // 2 :]]
    session = ort.InferenceSession(str(repo / "lookup" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])

    def call(ids: np.ndarray) -> np.ndarray | InferenceServerException:
        try:
            return client.infer("lookup", _input(ids)).as_numpy("y")  # type: ignore[no-any-return]
        except InferenceServerException as e:
            return e

    with g.InferenceServerClient(served.url) as client, ThreadPoolExecutor(48) as pool:
        answers = list(pool.map(call, requests))
    failed_good = 0
    for ids, answer in zip(requests, answers, strict=True):
        if ids is bad:
            continue
        failed_good += not isinstance(answer, np.ndarray) or not np.array_equal(
            answer, session.run(["y"], {"ids": ids})[0]
        )
    error = answers[GOOD // 2]
    FIGURES.setdefault("isolation", {})[f"1 bad request among {GOOD} good"] = f"{failed_good} good failed"
    assert failed_good == 0
    assert isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert "model 'lookup' cannot run on this request's inputs:" in str(error.message())
    assert "Gather" in str(error.message())  # onnxruntime's own words
    text = urllib.request.urlopen(served.metrics_url, timeout=30).read().decode()
    assert metric(text, "qkv_failed_computations_total", model="lookup", scope="request") >= 1
    assert metric(text, "qkv_requests_total", model="lookup", code="OK") == GOOD


def test_a_batch_that_fails_is_retried_in_halves_down_to_the_bad_request(repo: Path) -> None:
    """The batch step on the real graph, with one bad row among eight: only it fails, after 2 log2(8) runs."""
    model: Any = build(
        load_model_config(repo / "lookup"), Context(["CPUExecutionProvider"], Metrics().observer("lookup", "1"))
    )
    seen = Recorder()
    model.observer = seen
    rows = [np.full((1, 5), i, dtype=np.int64) for i in range(8)]
    rows[5] = np.array([[0, 1, BAD_ID, 2, 3]], dtype=np.int64)
    items = [WorkItem(1, 5, ({"ids": r}, ["y"], model._group({"ids": r})), None) for r in rows]  # type: ignore[arg-type]
    results = model._run_batch(items, 0)
    for i, r in enumerate(results):
        if i == 5:
            assert r.code == "INVALID_ARGUMENT" and "cannot run on this request's inputs" in r.message
        else:
            assert isinstance(r, dict) and r["y"].shape == (1, 5, 4)
    # 8 -> 4 + 4 -> (4 good) 2 + 2 -> (2 good) 1 + 1: three failed batches, and the request alone
    assert seen.failures == ["batch", "batch", "batch", "request"]
    model.release()


def test_a_value_outside_a_declared_range_is_refused_before_batching(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException) as e:
            client.infer("ranged", _input(np.array([[1, VOCAB]], dtype=np.int64)))
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"input 'ids': value {VOCAB} outside the range [0, {VOCAB - 1}] of limits.value_range" in str(
            e.value.message()
        )
        assert client.infer("ranged", _input(np.array([[1, VOCAB - 1]], dtype=np.int64))).as_numpy("y") is not None
    text = urllib.request.urlopen(served.metrics_url, timeout=30).read().decode()
    assert metric(text, "qkv_failed_computations_total", model="ranged") == 0, "refused before any run"


@pytest.mark.parametrize("bounds", [[1], [3, 2], ["0", 1], [0, float("inf")]])
def test_a_value_range_that_is_not_two_numbers_in_order_is_refused_at_load(tmp_path: Path, bounds: list[Any]) -> None:
    lookup(tmp_path / "m", {"limits": {"value_range": {"ids": bounds}}})
    with pytest.raises(RepositoryError, match=r"limits\.value_range\.ids must be \[lowest, highest\]"):
        load_model_config(tmp_path / "m")


class FailsOn:
    """The shipped g2p graphs, failing at the encoder on any batch holding the word `word` (a fault injected
    into the model; the scheduler under test is the real one)."""

    def __init__(self, model: OnnxSeq2Seq, word: list[int]) -> None:
        self.model, self.word = model, word

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        for row, mask in zip(input_ids, attention_mask, strict=True):
            if list(row[mask.astype(bool)]) == self.word:
                raise RuntimeError("injected fault: this word cannot be encoded")
        return self.model.encode(input_ids, attention_mask)

    def step(self, *args: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.model.step(*args)


@pytest.mark.parametrize("beam", [1, 2])
def test_a_word_that_fails_in_continuous_batching_ends_its_own_request_only(beam: int) -> None:
    """Greedy words in the continuous batch, or beam requests searched together: the others are answered."""
    version = MODELS / "g2p" / "1"
    model, graphemes = OnnxSeq2Seq(version, session_options(1)), Vocabulary.load(version / "graphemes.json")
    words = ["cat", "internationalization", "dog", "poison", "mat", "sun", "electroencephalograph", "on"]
    if beam == 1:
        alone = {w: greedy_decode(model, [graphemes.encode(w)], 40)[0].output for w in words}
    else:
        alone = {w: beam_search(model, [graphemes.encode(w)], beam, 40)[0].output for w in words}
    faulty = FailsOn(model, graphemes.encode("poison"))

    async def run() -> tuple[list[Any], Recorder]:
        seen = Recorder()
        scheduler = GenerationScheduler("g2p", BatchingConfig(min_join_rows=8, max_queue_delay_ms=50), [faulty],
                                        observer=seen)  # fmt: skip
        scheduler.start()
        loop = asyncio.get_running_loop()

        async def convert(word: str) -> Any:
            sources = [graphemes.encode(word)]
            item = WorkItem(beam, len(sources[0]) + 1, WordsRequest(sources, 40, beam), loop.create_future())
            try:
                return (await scheduler.submit(item))[0].output
            except Exception as e:
                return e

        answers = await asyncio.gather(*[convert(w) for w in words])
        await scheduler.close()
        return answers, seen

    answers, seen = asyncio.run(run())
    for word, answer in zip(words, answers, strict=True):
        if word == "poison":
            assert getattr(answer, "code", "") == "INTERNAL" and "injected fault" in answer.message
        else:
            assert answer == alone[word], word
    assert seen.failures.count("request") == 1
