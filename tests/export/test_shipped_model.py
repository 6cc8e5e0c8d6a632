"""The shipped model repository: files match the model card, and it speaks English."""

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from export import data
from export.evaluate import predict
from export.storage import MIN_ELEMENTS
from service.repository.layout import available_versions, model_cards
from service.seq2seq.graphs import OnnxSeq2Seq
from service.seq2seq.vocab import Vocabulary
from tests.conftest import MODELS

COMMON = ["hello", "world", "water", "house", "music", "people", "little", "morning", "garden", "table"]


def test_g2p_ships_two_versions_and_the_encoder_one() -> None:
    assert available_versions(MODELS / "g2p") == [1, 2] and available_versions(MODELS / "g2p_encoder") == [1]
    config = json.loads((MODELS / "g2p" / "config.json").read_text())
    assert config["version_policy"] == {"all": {}}  # both served; a request without a version gets 2


def test_files_match_the_hashes_in_the_model_cards() -> None:
    for model in ("g2p", "g2p_encoder"):
        for version, card in model_cards(MODELS / model).items():
            hashes = card["sha256"]
            assert set(hashes) == {p.name for p in (MODELS / model / version).iterdir()}, (model, version)
            for name, digest in hashes.items():
                assert hashlib.sha256((MODELS / model / version / name).read_bytes()).hexdigest() == digest, name


def test_the_shipped_graphs_store_their_weights_as_fp16() -> None:
    """Half the size of fp32 (models/ stays small enough to clone), and the card says what it changed."""
    graphs = sorted(MODELS.rglob("*.onnx"))
    assert len(graphs) == 5
    for path in graphs:
        weights = [t for t in onnx.load(str(path)).graph.initializer if np.prod(t.dims) >= MIN_ELEMENTS]
        assert weights and {t.data_type for t in weights} == {onnx.TensorProto.FLOAT16}, path
    for card in model_cards(MODELS / "g2p").values():
        assert card["weights"]["greedy_identical"] >= 0.99 * card["weights"]["greedy_words"] >= 1000
    assert sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file()) < 30e6


@pytest.mark.parametrize("version", ["1", "2"])
def test_the_card_carries_the_measured_test_figures(version: str) -> None:
    card = model_cards(MODELS / "g2p")[version]
    test = card["test"]
    assert test["split"] == "test" and test["words"] == len(data.read_split("test"))
    for key in ("wer", "per", "wer_stress_free", "per_stress_free"):
        assert 0 < test[key] < 1
    assert test["wer_stress_free"] <= test["wer"]
    assert card["parity"]["greedy_identical"] == card["parity"]["greedy_words"] >= 1000
    assert card["parameters"] > 1e6 and card["onnx_opset"] >= 17


def test_version_2_is_larger_more_accurate_and_its_card_says_how_it_was_made() -> None:
    cards = model_cards(MODELS / "g2p")
    one, two = cards["1"], cards["2"]
    assert two["parameters"] > 2 * one["parameters"]
    for key in ("wer", "per", "wer_stress_free", "per_stress_free"):
        assert two["test"][key] < one["test"][key], key
    assert two["test_beam"]["beam_size"] > 1 and two["test_beam"]["words"] == two["test"]["words"]
    training = two["training"]
    assert training["hardware"] and [run["hardware"] for run in training["continues"]]
    assert training["total_hours"] > training["hours"]


@pytest.mark.parametrize("version", ["1", "2"])
def test_common_words_come_out_right_through_onnxruntime(version: str) -> None:
    directory = MODELS / "g2p" / version
    model = OnnxSeq2Seq(directory)
    out = predict(
        model, Vocabulary.load(directory / "graphemes.json"), Vocabulary.load(directory / "phonemes.json"), COMMON
    )
    lexicon = data.load_lexicon()
    right = [w for w, p in zip(COMMON, out, strict=True) if p in lexicon[w]]
    assert len(right) >= 9, list(zip(COMMON, out, strict=True))


def _runs(card: dict[str, Any]) -> list[dict[str, Any]]:
    training = card["training"]
    return [
        training,
        training["recipe"],
        *training.get("continues", []),
        *(r["recipe"] for r in training.get("continues", [])),
    ]


@pytest.mark.parametrize("version", ["1", "2"])
def test_the_card_names_runs_and_not_the_paths_they_were_written_to(version: str) -> None:
    card = model_cards(MODELS / "g2p")[version]
    for run in _runs(card):
        for key in ("run", "out", "init"):
            name = run.get(key, "")
            assert not name.startswith(("/", ".", "checkpoints/", "runs/")) and name.count("/") <= 1, (key, name)


def test_the_lexicon_is_written_into_a_version_as_shipped(tmp_path: Path) -> None:
    """`python -m export.lexicon` on a copy of version 1: the same bytes as shipped, recorded in the card."""
    from export.lexicon import main

    shutil.copy(MODELS / "g2p" / "config.json", tmp_path / "config.json")
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    assert main([str(tmp_path / "1")]) == 0
    written = (tmp_path / "1" / "lexicon.txt.gz").read_bytes()
    assert written == (MODELS / "g2p" / "1" / "lexicon.txt.gz").read_bytes()
    card = json.loads((tmp_path / "config.json").read_text())["model_card"]["versions"]["1"]
    assert card["lexicon"]["sha256"] == card["sha256"]["lexicon.txt.gz"] == hashlib.sha256(written).hexdigest()
