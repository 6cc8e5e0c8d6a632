"""Hugging Face exports served as exported, with no config.json: GPT-2 with past (text-generation-with-past),
BERT (feature-extraction) and T5's encoder and decoders (text2text-generation-with-past), tiny models built
from transformers configs with fixed random weights and exported by optimum's own exporter (no model hub).
Each warms up on inputs read from its graph and serves; each answer equals onnxruntime's in process on the
same inputs. Needs the hf extra (skipped without it). Marked slow: importing torch, transformers and optimum
and exporting the three takes some 40 s on two busy cores."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as g

from service.datatypes import ONNX_DATATYPES
from service.models.runtime import TensorSpec
from service.models.warmup import graph_feeds
from tests.conftest import RunningServer
from tests.service.onnx_models import serving

pytestmark = pytest.mark.slow

# The served models: name -> (export, its file).
SERVED = {
    "gpt2": ("gpt2", "model.onnx"),
    "bert": ("bert", "model.onnx"),
    "t5_encoder": ("t5", "encoder_model.onnx"),
    "t5_decoder": ("t5", "decoder_model.onnx"),
    "t5_decoder_with_past": ("t5", "decoder_with_past_model.onnx"),
}
LENGTH = 5  # the requests' sequence length


def _export(name: str, config: Any, model_class: Any, task: str, root: Path) -> Path:
    """A tiny model of `config` with fixed random weights, saved and exported by optimum as `task`."""
    import torch
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    saved, out = root / f"{name}-torch", root / name
    with warnings.catch_warnings():  # the exporters' own deprecation notices, not the server's
        warnings.simplefilter("ignore")
        model_class(config).eval().save_pretrained(saved)
        main_export(str(saved), output=out, task=task, do_validation=False, no_post_process=True, device="cpu")
    return out


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("optimum.exporters.onnx", reason="needs the hf extra")
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("hf")
    exports = {
        "gpt2": _export("gpt2", GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64),
                        GPT2LMHeadModel, "text-generation-with-past", root),
        "bert": _export("bert", BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, vocab_size=100, max_position_embeddings=64),
                        BertModel, "feature-extraction", root),
        "t5": _export("t5", T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2,
                                     vocab_size=100, decoder_start_token_id=0),
                      T5ForConditionalGeneration, "text2text-generation-with-past", root),
    }  # fmt: skip
    models = root / "models"
    for name, (export, file) in SERVED.items():
        (models / name / "1").mkdir(parents=True)
        shutil.copy(exports[export] / file, models / name / "1" / "model.onnx")
    return models


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


def _request(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """One request of LENGTH tokens (the encoder's, for a decoder) and no past, built as warm-up builds its
    inputs: every dimension named for a sequence is LENGTH."""
    specs = []
    for a in session.get_inputs():
        names = tuple(d if isinstance(d, str) else None for d in a.shape)
        dims = tuple(d if isinstance(d, int) else -1 for d in a.shape)
        specs.append(TensorSpec(a.name, ONNX_DATATYPES[a.type], dims, names))
    sequence = {n for s in specs for n in s.axes if n and "sequence" in n and "past" not in n}
    return graph_feeds(specs, 1, LENGTH, True, sequence, {"input_ids": 100, "decoder_input_ids": 100}, seed=1)


@pytest.mark.parametrize("model", sorted(SERVED))
def test_an_export_warms_up_and_answers_as_onnxruntime(served: RunningServer, repo: Path, model: str) -> None:
    session = ort.InferenceSession(str(repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = _request(session)
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(names, feeds), strict=True))
    with g.InferenceServerClient(served.url) as client:
        assert client.is_model_ready(model)
        tensors = []
        for name, a in feeds.items():
            t = g.InferInput(name, list(a.shape), next(s for s in client.get_model_metadata(model).inputs
                                                       if s.name == name).datatype)  # fmt: skip
            t.set_data_from_numpy(a)
            tensors.append(t)
        answer = client.infer(model, tensors)
    for name in names:
        np.testing.assert_allclose(answer.as_numpy(name), expected[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert "warm-up failed" not in served.output()
