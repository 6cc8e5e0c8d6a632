"""The text kind's pure parts: what a folder's files say (detection and config.json's overrides), the long-input
policy on token rows, and pooling. No server, no model: files written here, arrays built here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.errors import ConfigError, InvalidArgument
from service.models.catalog import check, load_checked, recognised
from service.models.text.pooling import activate, pool, pool_windows, truncated_dimensions
from service.models.text.settings import read_settings
from service.models.text.tokens import fit
from service.repository.layout import RepositoryError, load_model_config


def folder(tmp_path: Path, files: dict[str, object]) -> Path:
    for name, value in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    return tmp_path


def test_a_sentence_transformers_folder_says_its_pooling_normalization_and_length(tmp_path: Path) -> None:
    d = folder(tmp_path, {
        "config.json": {"architectures": ["BertModel"], "max_position_embeddings": 512},
        "tokenizer_config.json": {"model_max_length": 512},
        "modules.json": [{"path": "", "type": "sentence_transformers.models.Transformer"},
                         {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                         {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
        "1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
        "sentence_bert_config.json": {"max_seq_length": 256},
        "config_sentence_transformers.json": {"prompts": {"query": "query: "}, "default_prompt_name": "query"},
    })  # fmt: skip
    s = read_settings(d, {}, "m")
    assert (s.task, s.pooling, s.normalize, s.max_length) == ("embed", "cls", True, 256)
    assert s.prompts == {"query": "query: "} and s.default_prompt == "query"
    over = read_settings(d, {"pooling": "last", "normalize": False, "max_length": 64}, "m")
    assert (over.pooling, over.normalize, over.max_length) == ("last", False, 64)


def test_a_sequence_classifier_is_a_classifier_or_with_one_label_a_reranker(tmp_path: Path) -> None:
    arch = ["BertForSequenceClassification"]
    labels = {"0": "neg", "1": "pos"}
    c = read_settings(folder(tmp_path / "c", {"config.json": {"architectures": arch, "id2label": labels}}), {}, "m")
    assert (c.task, c.labels, c.activation) == ("classify", ("neg", "pos"), "softmax")
    multi = {"architectures": arch, "id2label": labels, "problem_type": "multi_label_classification"}
    assert read_settings(folder(tmp_path / "ml", {"config.json": multi}), {}, "m").activation == "sigmoid"
    one = {"architectures": arch, "id2label": {"0": "LABEL_0"}}
    r = read_settings(folder(tmp_path / "r", {"config.json": one}), {}, "m")
    assert (r.task, r.activation) == ("rerank", "sigmoid")


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"pooling": "median"}, "text.pooling"),
        ({"max_length": "256"}, "text.max_length"),
        ({"normalise": True}, "normalise"),
        ({"long_inputs": "chunk", "task": "classify"}, "text.long_inputs"),
        ({"default_prompt": "doc"}, "text.default_prompt"),
        ({"chunk_overlap": 300}, "text.chunk_overlap"),
    ],
)
def test_a_wrong_override_is_refused_naming_it(tmp_path: Path, overrides: dict[str, object], named: str) -> None:
    with pytest.raises(RepositoryError, match=named.replace(".", r"\.")):
        read_settings(tmp_path, overrides, "m")


def test_the_kind_is_text_when_the_folder_has_a_tokenizer_and_a_text_section_is_for_it_alone(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"")
    assert recognised(load_model_config(tmp_path / "m")).kind == "tensor"
    (tmp_path / "m" / "1" / "tokenizer.json").write_text("{}")
    config = recognised(load_model_config(tmp_path / "m"))
    assert config.kind == "text" and config.text == {}
    assert load_model_config(tmp_path / "m", raw={"text": {"pooling": "cls"}}).text == {"pooling": "cls"}
    with pytest.raises(ConfigError, match="text is a section of the text kind's config, not of a tensor model"):
        check(load_model_config(tmp_path / "m", raw={"kind": "tensor", "text": {"pooling": "cls"}}))


def row(n: int, pair_at: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[CLS] 1..n [SEP] (or a pair: [CLS] a [SEP] b [SEP] split at `pair_at`): ids, types, sequence ids."""
    if pair_at is None:
        ids = np.array([101, *range(1, n + 1), 102])
        seq = np.array([-1, *([0] * n), -1])
    else:
        ids = np.array([101, *range(1, pair_at + 1), 102, *range(pair_at + 1, n + 1), 102])
        seq = np.array([-1, *([0] * pair_at), -1, *([1] * (n - pair_at)), -1])
    types = (
        np.zeros(len(ids), dtype=np.int64)
        if pair_at is None
        else np.array([0] * (pair_at + 2) + [1] * (n - pair_at + 1))
    )
    return ids, types, seq


def test_truncation_keeps_the_special_tokens_and_cuts_the_side_asked() -> None:
    right = fit(0, *row(10), max_length=6, policy="truncate")
    assert right.rows[0].ids.tolist() == [101, 1, 2, 3, 4, 102] and right.cut == 6 and right.tokens == 6
    left = fit(0, *row(10), max_length=6, policy="truncate", side="left")
    assert left.rows[0].ids.tolist() == [101, 7, 8, 9, 10, 102]
    # a pair: the longer text loses tokens first (3 of query, 9 of document -> 3 and 4 kept in 10)
    pair = fit(0, *row(12, pair_at=3), max_length=10, policy="truncate")
    assert pair.rows[0].ids.tolist() == [101, 1, 2, 3, 102, 4, 5, 6, 7, 102]
    assert pair.rows[0].types.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert fit(0, *row(4), max_length=6, policy="refuse").cut == 0  # within the limit: as it is


def test_refuse_names_the_limit_and_chunk_makes_overlapping_windows() -> None:
    with pytest.raises(InvalidArgument, match="element 3: 12 tokens, over the model's max_length of 6"):
        fit(3, *row(10), max_length=6, policy="refuse")
    chunked = fit(0, *row(10), max_length=6, policy="chunk", overlap=1, max_chunks=8)
    windows = [r.ids.tolist() for r in chunked.rows]
    assert windows == [[101, 1, 2, 3, 4, 102], [101, 4, 5, 6, 7, 102], [101, 7, 8, 9, 10, 102]]
    assert chunked.tokens == 18 and chunked.cut == 0
    with pytest.raises(InvalidArgument, match="max_chunks 2"):
        fit(0, *row(10), max_length=6, policy="chunk", overlap=1, max_chunks=2)


def test_pooling_modes_skip_the_padding() -> None:
    tokens = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # (B, S, D)
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    assert pool(tokens, mask, "mean").tolist() == [[1.0, 2.0], [8.0, 9.0]]
    assert pool(tokens, mask, "cls").tolist() == [[0.0, 1.0], [6.0, 7.0]]
    assert pool(tokens, mask, "last").tolist() == [[2.0, 3.0], [10.0, 11.0]]
    assert pool(tokens, mask, "max").tolist() == [[2.0, 3.0], [10.0, 11.0]]


def test_dimensions_windows_and_scores() -> None:
    x = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    assert np.allclose(truncated_dimensions(x, 2, normalize=True), [[0.6, 0.8]])
    assert np.allclose(truncated_dimensions(x, 2, normalize=False), [[3.0, 4.0]])
    windows = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    assert np.allclose(pool_windows(windows, np.array([3, 1]), normalize=False), [0.75, 0.25])
    assert np.allclose(np.linalg.norm(pool_windows(windows, np.array([3, 1]), normalize=True)), 1.0)
    assert np.allclose(activate(np.array([[0.0, np.log(3.0)]]), "softmax"), [[0.25, 0.75]])
    assert np.allclose(activate(np.array([[0.0]]), "sigmoid"), [[0.5]])


def test_every_version_served_takes_the_kind_the_newest_versions_files_say(tmp_path: Path) -> None:
    for version in ("1", "2"):
        (tmp_path / "m" / version).mkdir(parents=True)
        (tmp_path / "m" / version / "model.onnx").write_bytes(b"")
    (tmp_path / "m" / "2" / "tokenizer.json").write_text("{}")  # the newest is an exported text model
    configs = load_checked(tmp_path / "m", raw={"version_policy": {"all": {}}})
    assert [(c.version, c.kind) for c in configs] == [("1", "text"), ("2", "text")]
