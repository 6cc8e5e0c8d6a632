"""The shipped model repository: files match the model card, and it speaks English."""

import hashlib
import json

from export import data
from export.evaluate import predict
from service.seq2seq import OnnxSeq2Seq
from service.vocab import Vocabulary
from tests.conftest import MODELS

COMMON = ["hello", "world", "water", "house", "music", "people", "little", "morning", "garden", "table"]


def test_files_match_the_hashes_in_the_model_card() -> None:
    for model in ("g2p", "g2p_encoder"):
        config = json.loads((MODELS / model / "config.json").read_text())
        hashes = config["model_card"]["sha256"]
        files = {p.name for p in (MODELS / model / "1").iterdir()}
        assert set(hashes) == files
        for name, digest in hashes.items():
            assert hashlib.sha256((MODELS / model / "1" / name).read_bytes()).hexdigest() == digest, name


def test_the_card_carries_the_measured_test_figures() -> None:
    card = json.loads((MODELS / "g2p" / "config.json").read_text())["model_card"]
    test = card["test"]
    assert test["split"] == "test" and test["words"] == len(data.read_split("test"))
    for key in ("wer", "per", "wer_stress_free", "per_stress_free"):
        assert 0 < test[key] < 1
    assert test["wer_stress_free"] <= test["wer"]
    assert card["parity"]["greedy_identical"] == card["parity"]["greedy_words"] >= 1000
    assert card["parameters"] > 1e6 and card["onnx_opset"] >= 17


def test_common_words_come_out_right_through_onnxruntime() -> None:
    version = MODELS / "g2p" / "1"
    model = OnnxSeq2Seq(version)
    out = predict(
        model, Vocabulary.load(version / "graphemes.json"), Vocabulary.load(version / "phonemes.json"), COMMON
    )
    lexicon = data.load_lexicon()
    right = [w for w, p in zip(COMMON, out, strict=True) if p in lexicon[w]]
    assert len(right) >= 9, list(zip(COMMON, out, strict=True))
