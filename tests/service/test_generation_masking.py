"""The self-attention mask masking.py gives an exported T5 decoder (tests/service/generation_models.py): a row
whose cache is left-padded, its pads masked, gets the logits it gets alone; the graph's other fields come back
as they were; a graph without the pattern is refused with the reason. Needs the hf extra (skipped without it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from service.models.generation.graphs import Seq2SeqGraphs
from service.models.generation.masking import MASK, Unmasked, _messages, with_self_attention_mask
from tests.service.generation_models import seq2seq_folder


@pytest.fixture(scope="module")
def folder() -> Path:
    pytest.importorskip("optimum.exporters.onnx", reason="needs the hf extra")
    return seq2seq_folder() / "onnx"


@pytest.mark.parametrize(
    "files", [("decoder_model_merged.onnx",), ("decoder_model.onnx", "decoder_with_past_model.onnx")]
)
def test_a_left_padded_row_gets_the_logits_it_gets_alone(folder: Path, files: tuple[str, ...]) -> None:
    graphs = Seq2SeqGraphs(folder, ("encoder_model.onnx", *files), ort.SessionOptions(), ["CPUExecutionProvider"], "t5")
    assert graphs.masked
    ids = np.array([[11, 42, 7, 99, 3, 1]], dtype=np.int64)
    mask = np.ones_like(ids)
    _, cache = graphs.start(np.zeros((1, 1), dtype=np.int64), graphs.encode(ids, mask), mask)
    for token in (5, 17, 23):  # a cache of 4 decoder positions
        _, cache = graphs.step(np.array([[token]]), mask, cache)
    alone, _ = graphs.step(np.array([[31]]), mask, cache)

    pad = 3
    own = graphs.past.self_attention
    padded = [np.pad(c, ((0, 0), (0, 0), (pad, 0), (0, 0))) if o else c for c, o in zip(cache, own, strict=True)]
    self_mask = np.array([[0] * pad + [1] * (cache[0].shape[2] + 1)], dtype=np.int64)
    masked, present = graphs.step(np.array([[31]]), mask, padded, self_mask)
    np.testing.assert_allclose(masked, alone, rtol=1e-5, atol=1e-5)
    assert present[0].shape[2] == pad + cache[0].shape[2] + 1
    unmasked, _ = graphs.step(np.array([[31]]), mask, padded)  # the pads attended to: another answer
    assert np.abs(unmasked - alone).max() > 1e-3


def test_the_rewrite_keeps_every_field_it_does_not_touch(folder: Path) -> None:
    onnx = pytest.importorskip("onnx")
    data = (folder / "decoder_model_merged.onnx").read_bytes()
    assert onnx.load_from_string(
        _messages()["ModelProto"].FromString(data).SerializeToString()
    ) == onnx.load_from_string(data)
    rewritten, external = with_self_attention_mask(data)
    model = onnx.load_from_string(rewritten)
    onnx.checker.check_model(model)
    assert not external
    assert [i.name for i in model.graph.input][-1] == MASK
    [branch] = [a.g for a in model.graph.node[0].attribute if a.name == "then_branch"]  # the cache branch
    softmaxes = [n for n in branch.node if n.op_type == "Softmax"]
    masked = [n for n in softmaxes if n.input[0].endswith("/qkv_masked")]
    assert len(masked) == 2 and all("SelfAttention" in n.name for n in masked)  # the 2 layers', not the cross


def test_a_graph_without_the_pattern_is_refused_saying_why(folder: Path) -> None:
    with pytest.raises(Unmasked, match=r"no self-attention past key"):
        with_self_attention_mask((folder / "decoder_model.onnx").read_bytes())
    twice, _ = with_self_attention_mask((folder / "decoder_with_past_model.onnx").read_bytes())
    with pytest.raises(Unmasked, match=f"already has an input named {MASK}"):
        with_self_attention_mask(twice)


def test_a_decoder_whose_self_attention_bias_is_not_relative_is_refused(folder: Path) -> None:
    """BART and Marian add only the causal mask to their scores and take their positions from the cache's
    length: a left pad would move them. Made here from T5's decoder by adding the causal mask alone."""
    onnx = pytest.importorskip("onnx")
    model = onnx.load(folder / "decoder_with_past_model.onnx")
    producers = {o: n for n in model.graph.node for o in n.output}
    changed = 0
    for node in model.graph.node:
        if node.op_type == "Softmax" and "SelfAttention" in node.name:
            scores = producers[producers[node.input[0]].input[0]]  # Softmax <- Cast <- Add(q x k^T, bias)
            position_bias_plus_mask = producers[scores.input[1]]  # Add(relative bias, causal mask)
            scores.input[1] = position_bias_plus_mask.input[1]
            changed += 1
    assert changed == 2
    with pytest.raises(Unmasked, match="not a relative position bias"):
        with_self_attention_mask(model.SerializeToString())


def test_a_decoder_whose_weights_lie_beside_it_is_masked_too(folder: Path, tmp_path: Path) -> None:
    """A graph read from memory finds its external data (the weights in a file of their own) in its folder."""
    onnx = pytest.importorskip("onnx")
    shutil.copy(folder / "encoder_model.onnx", tmp_path)
    model = onnx.load(folder / "decoder_model_merged.onnx")
    onnx.save(model, tmp_path / "decoder_model_merged.onnx", save_as_external_data=True, size_threshold=0,
              location="decoder_model_merged.onnx_data")  # fmt: skip
    files = ("encoder_model.onnx", "decoder_model_merged.onnx")
    answers = []
    for where in (folder, tmp_path):
        graphs = Seq2SeqGraphs(where, files, ort.SessionOptions(), ["CPUExecutionProvider"], "t5")
        assert graphs.masked
        ids = np.array([[11, 42, 7]], dtype=np.int64)
        mask = np.ones_like(ids)
        _, cache = graphs.start(np.zeros((1, 1), dtype=np.int64), graphs.encode(ids, mask), mask)
        answers.append(graphs.step(np.array([[5]]), mask, cache)[0])
    np.testing.assert_array_equal(answers[0], answers[1])
