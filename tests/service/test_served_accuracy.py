"""Serving loses no accuracy: the served g2p answers equal offline decoding of the same graphs."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from export import data
from export.evaluate import predict
from export.quantize import quantize_graphs
from export.scoring import score
from service.models.g2p.model import normalize_word
from service.seq2seq.graphs import OnnxSeq2Seq, session_options
from service.seq2seq.vocab import Vocabulary
from service.tools.bench import variant
from service.tools.client import Client
from tests.conftest import MODELS, RunningServer, start_server, stop_server


@pytest.mark.parametrize(("version", "sample"), [("1", 2000), ("2", None)])
def test_served_predictions_equal_offline_evaluation(server: RunningServer, version: str, sample: int | None) -> None:
    """Version 2 (the default) on the whole test split, version 1 on 2,000 of its words."""
    # Words the server's text normalisation leaves alone (all but a single-letter abbreviation or two).
    words = [w for w in data.read_split("test") if normalize_word(w) == w]
    words = random.Random(7).sample(words, sample) if sample else words
    directory = MODELS / "g2p" / version
    offline = predict(
        OnnxSeq2Seq(directory, session_options(2)),
        Vocabulary.load(directory / "graphemes.json"),
        Vocabulary.load(directory / "phonemes.json"),
        words,
    )
    client = Client(server.url, timeout=60)  # retries a refusal after the server's pushback hint

    def call(chunk: list[str]) -> list[str]:
        return client.g2p(chunk, version=version, lexicon=False)  # the model alone, as offline

    # Requests of 1 to 16 words, 8 in flight: they share continuous batches on the server.
    rng = random.Random(1)
    chunks, i = [], 0
    while i < len(words):
        n = rng.randint(1, 16)
        chunks.append(words[i : i + n])
        i += n
    with ThreadPoolExecutor(8) as pool:
        served = [p for part in pool.map(call, chunks) for p in part]
    mismatches = [(w, s, " ".join(o)) for w, s, o in zip(words, served, offline, strict=True) if s != " ".join(o)]
    assert not mismatches, mismatches[:5]
    assert len(words) >= (sample or len(data.read_split("test")) - 20)
    if version == "2":  # the model alone on the test split, stress-free, as its card says
        lexicon = data.load_lexicon()
        wer = score([s.split() for s in served], [lexicon[w] for w in words])["wer_stress_free"]
        assert wer <= 0.247, wer


def test_the_int8_graphs_are_served_when_asked_for_and_answer_as_offline(tmp_path: Path) -> None:
    """int8 copies are not shipped (they would double models/): written here as a user writes them."""
    words = random.Random(3).sample([w for w in data.read_split("test") if normalize_word(w) == w], 300)
    only_1 = {"specific": {"versions": [1]}}
    repo = variant(MODELS, tmp_path / "models", {"g2p": {"precision": "int8", "version_policy": only_1}})
    version = repo / "g2p" / "1"
    quantize_graphs(version)
    graphemes, phonemes = Vocabulary.load(version / "graphemes.json"), Vocabulary.load(version / "phonemes.json")
    int8, fp32 = (
        [
            " ".join(p)
            for p in predict(OnnxSeq2Seq(version, session_options(2), precision=x), graphemes, phonemes, words)
        ]
        for x in ("int8", "fp32")
    )
    assert int8 != fp32, "the int8 graphs decode exactly as the fp32 ones: are they the same graphs?"
    assert sum(a == b for a, b in zip(int8, fp32, strict=True)) > 0.9 * len(words)  # and nearly always agree
    s = start_server(["--model-repository", str(repo)], tmp_path / "server.log")
    try:
        client = Client(s.url, timeout=60)
        served = [
            p for i in range(0, len(words), 10) for p in client.g2p(words[i : i + 10], version="1", lexicon=False)
        ]
    finally:
        stop_server(s)
    assert served == int8
