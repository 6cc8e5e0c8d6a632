"""End to end on a tiny model: train a few steps, export, parity-check, evaluate both runtimes."""

import json
import random
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import tritonclient.grpc as g

from export import data
from export.checkpoint import TorchStepModel, load_checkpoint
from export.evaluate import evaluate, evaluate_repository
from export.onnx_export import write_repository
from export.storage import MIN_ELEMENTS, round_weights_fp16
from export.train import TrainConfig, train
from service.decoding.words import greedy_decode
from service.seq2seq.graphs import OnnxSeq2Seq
from tests.conftest import start_server

pytestmark = pytest.mark.slow  # trains and exports: `make test-slow`


def tiny(out: Path, epochs: int) -> TrainConfig:
    """A model small enough to train for a couple of epochs in seconds."""
    return TrainConfig(
        out=str(out),
        d_model=32,
        h=2,
        n_encoder=1,
        n_decoder=1,
        d_ff=64,
        max_tokens=2000,
        epochs=epochs,
        train_words=2000,
        dev_words=100,
        warmup=20,
        decay_start=40,
        lr=3e-3,
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tiny(tmp_path_factory.mktemp("tiny"), epochs=2))


def test_training_writes_resumable_checkpoints(tiny_checkpoint: Path) -> None:
    state = load_checkpoint(tiny_checkpoint.parent / "last.pt").state
    assert state["epoch"] == 2 and state["step"] > 0
    assert len(state["history"]) == 2
    assert state["history"][1]["loss"] < state["history"][0]["loss"]  # it learns
    more = tiny(tiny_checkpoint.parent, epochs=3)
    train(more, resume=True)
    resumed = load_checkpoint(tiny_checkpoint.parent / "last.pt").state
    assert resumed["epoch"] == 3 and resumed["step"] > state["step"]


def test_export_parity_and_same_figures_from_both_runtimes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    loaded = load_checkpoint(tiny_checkpoint, max_len=128)
    words = random.Random(0).sample(data.read_split("test"), 200)
    config = write_repository(loaded, tmp_path, words)
    parity, weights = config["model_card"]["parity"], config["model_card"]["weights"]
    assert parity["max_abs_diff"] <= 1e-4
    assert parity["greedy_identical"] == 200
    assert weights["greedy_words"] == 200 and weights["greedy_identical"] >= 198  # what fp16 weights changed
    card = json.loads((tmp_path / "g2p" / "config.json").read_text())["model_card"]
    assert set(card["sha256"]) == {"encoder.onnx", "decoder.onnx", "graphemes.json", "phonemes.json", "lexicon.txt.gz"}
    assert card["lexicon"]["sha256"] == card["sha256"]["lexicon.txt.gz"] and card["lexicon"]["words"] > 100_000
    assert card["training"]["recipe"]["out"] == tiny_checkpoint.parent.name  # the run by name, not its path
    assert (tmp_path / "g2p_encoder" / "1" / "model.onnx").exists()
    # Half the size: every weight matrix is stored as fp16, and onnxruntime computes in fp32.
    graph = onnx.load(str(tmp_path / "g2p" / "1" / "decoder.onnx")).graph
    stored = {t.data_type for t in graph.initializer if np.prod(t.dims) >= MIN_ELEMENTS}
    assert stored == {onnx.TensorProto.FLOAT16}
    onnx_ = evaluate_repository(tmp_path / "g2p", limit=150)
    rounded = round_weights_fp16(load_checkpoint(tiny_checkpoint).model)
    torch_ = evaluate(TorchStepModel(rounded), loaded.graphemes, loaded.phonemes, limit=150)
    for key in ("wer", "per", "wer_stress_free", "per_stress_free"):
        assert onnx_[key] == pytest.approx(torch_[key]), key
    assert onnx_["words"] == 150
    # The int8 copies: written beside the graphs, hashed in the card, a word's answer independent of its batch.
    from export.quantize import quantize_repository

    quantize_repository(tmp_path, evaluate=False)
    card = json.loads((tmp_path / "g2p" / "config.json").read_text())["model_card"]
    assert {"encoder.int8.onnx", "decoder.int8.onnx"} < set(card["sha256"])
    int8 = OnnxSeq2Seq(tmp_path / "g2p" / "1", precision="int8")
    sources = [loaded.graphemes.encode(w) for w in words[:40]]
    alone = [greedy_decode(int8, [s], 30)[0].output for s in sources]
    assert [h.output for h in greedy_decode(int8, sources, 30, batch_size=40)] == alone


def test_beam_search_is_at_least_as_likely_as_greedy(tiny_checkpoint: Path) -> None:
    from export.checkpoint import TorchStepModel
    from service.decoding.words import greedy_decode
    from service.seq2seq.generation import beam_search

    loaded = load_checkpoint(tiny_checkpoint)
    model = TorchStepModel(loaded.model)
    sources = [loaded.graphemes.encode(w) for w in data.read_split("dev")[:40]]
    greedy = greedy_decode(model, sources, 30)
    beams = beam_search(model, sources, 4, 30)
    better = sum(b.score >= g.score / max(1, len(g.tokens) - 1) - 1e-6 for b, g in zip(beams, greedy, strict=True))
    assert better == len(sources)


def test_averaged_checkpoints_are_the_mean_of_their_weights(tiny_checkpoint: Path) -> None:
    import torch

    from export.checkpoint import average_checkpoints

    paths = [tiny_checkpoint, tiny_checkpoint.parent / "last.pt"]
    avg = average_checkpoints(paths)
    a, b = (load_checkpoint(p).model.state_dict() for p in paths)
    for key, value in avg.model.state_dict().items():
        assert torch.allclose(value, (a[key] + b[key]) / 2, atol=1e-6), key
    assert len(avg.state["averaged"]) == 2


def test_a_checkpoint_recovered_from_the_exported_graphs_has_the_trained_weights(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The repository ships graphs, not checkpoints: export, rebuild the model from the graphs, and
    every parameter is the trained one, as the graphs store it (rounded to fp16)."""
    from export.recover import recover

    loaded = load_checkpoint(tiny_checkpoint, max_len=128)
    write_repository(loaded, tmp_path, data.read_split("test")[:20])
    rebuilt = recover(tmp_path / "g2p" / "1", loaded.model.config)
    trained = round_weights_fp16(loaded.model).state_dict()
    for key, value in rebuilt.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_a_new_version_is_exported_beside_the_old_and_both_are_served(tiny_checkpoint: Path, tmp_path: Path) -> None:
    words = data.read_split("test")[:20]
    first = write_repository(load_checkpoint(tiny_checkpoint, max_len=128), tmp_path, words)
    second = write_repository(
        load_checkpoint(tiny_checkpoint.parent / "last.pt", max_len=128), tmp_path, words, version="2", beside=True
    )
    for model in ("g2p", "g2p_encoder"):
        config = json.loads((tmp_path / model / "config.json").read_text())
        assert config["version_policy"] == {"all": {}}
        assert sorted(p.name for p in (tmp_path / model).iterdir() if p.is_dir()) == ["1", "2"]
        assert config["model_card"]["versions"]["1"]["sha256"] != config["model_card"]["sha256"]
    assert second["model_card"]["versions"]["1"] == first["model_card"]
    assert second["model_card"]["training"]["steps"] > first["model_card"]["training"]["steps"] or (
        second["model_card"]["sha256"] != first["model_card"]["sha256"]
    )
    with (
        start_server(["--model-repository", str(tmp_path)], tmp_path / "server.log") as server,
        g.InferenceServerClient(server.url) as client,
    ):
        assert client.get_model_metadata("g2p").versions == ["1", "2"]
        text = g.InferInput("TEXT", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"cat"], dtype=object))
        answered = {v: client.infer("g2p", [text], model_version=v).get_response().model_version for v in "12"}
        assert answered == {"1": "1", "2": "2"}
        assert client.infer("g2p", [text]).get_response().model_version == "2"  # the newest by default


def test_a_version_of_g2p_alone_leaves_the_encoder_model_as_it_was(tiny_checkpoint: Path, tmp_path: Path) -> None:
    words = data.read_split("test")[:20]
    write_repository(load_checkpoint(tiny_checkpoint, max_len=128), tmp_path, words)
    encoder_before = (tmp_path / "g2p_encoder" / "config.json").read_text()
    second = write_repository(load_checkpoint(tiny_checkpoint.parent / "last.pt", max_len=128), tmp_path, words,
                              version="2", beside=True, encoder_model=False)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "g2p").iterdir() if p.is_dir()) == ["1", "2"]
    assert sorted(p.name for p in (tmp_path / "g2p_encoder").iterdir() if p.is_dir()) == ["1"]
    assert (tmp_path / "g2p_encoder" / "config.json").read_text() == encoder_before
    assert second["version_policy"] == {"all": {}} and set(second["model_card"]["versions"]) == {"1"}
