"""`python -m export.quantize`: int8 copies of the g2p graphs, beside the fp32 ones.

Static quantization of every matrix product (MatMul, and Gemm: a linear layer with its bias): int8
weights, and activation ranges calibrated once, on dev words decoded by the fp32 graphs. Ranges fixed in
advance keep a word's answer independent of its batch-mates, which continuous batching promises. Dynamic
quantization computes each activation's range over the whole batch at run time: it was faster, but in
batches of 32 it decoded 1 of 300 test words differently than alone. The model card gets the new files'
hashes and the int8 graphs' own test figures ("test_int8"); a model serves them when its config.json
says "precision": "int8".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from export import data
from export.evaluate import MAX_OUTPUT_LENGTH, evaluate_repository
from export.storage import weights_fp32
from service.decoding.words import greedy_decode
from service.repository.layout import load_model_config
from service.seq2seq.graphs import (
    DECODER_FILE,
    ENCODER_FILE,
    GRAPHEMES_FILE,
    Layers,
    OnnxSeq2Seq,
    graph_file,
    session_options,
)
from service.seq2seq.vocab import Vocabulary

PRECISION = "int8"


def quantize_graphs(version: Path, calibration_words: int = 400) -> list[Path]:
    """Write encoder.int8.onnx and decoder.int8.onnx next to their fp32 graphs in `version`."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Feeds(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    encoder_feeds, decoder_feeds = _calibration_feeds(version, calibration_words)
    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process applies to convolutions
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, feeds in ((ENCODER_FILE, encoder_feeds), (DECODER_FILE, decoder_feeds)):
            source, target = Path(tmp) / name, version / graph_file(name, PRECISION)
            onnx.save(weights_fp32(onnx.load(str(version / name))), str(source))  # weights it can quantize
            quantize_static(source, target, Feeds(feeds), quant_format=QuantFormat.QOperator,
                            op_types_to_quantize=["MatMul", "Gemm"], weight_type=QuantType.QInt8,
                            activation_type=QuantType.QUInt8)  # fmt: skip
            written.append(target)
    return written


def _calibration_feeds(version: Path, words: int) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The inputs the fp32 graphs see while decoding `words` dev words, 16 at a time (every third
    decoder step)."""
    fp32 = OnnxSeq2Seq(version, session_options(2))
    graphemes = Vocabulary.load(version / GRAPHEMES_FILE)
    encoder_feeds: list[dict[str, np.ndarray]] = []
    decoder_feeds: list[dict[str, np.ndarray]] = []
    steps = [0]

    class Recorder:
        cache_shape = fp32.cache_shape

        def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            encoder_feeds.append({"input_ids": input_ids, "attention_mask": attention_mask})
            return fp32.encode(input_ids, attention_mask)

        def step(self, *arrays: Layers) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            if steps[0] % 3 == 0:
                feeds = fp32.step_feeds(*arrays)
                decoder_feeds.append({k: v.copy() for k, v in feeds.items()})  # the cache changes in place
            steps[0] += 1
            return fp32.step(*arrays)

    sources = [graphemes.encode(w) for w in data.read_split("dev")[:words]]
    greedy_decode(Recorder(), sources, MAX_OUTPUT_LENGTH, batch_size=16)
    return encoder_feeds, decoder_feeds


def file_hashes(version: Path) -> dict[str, str]:
    """The model card's "sha256": every file of a version directory."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(version.iterdir()) if p.is_file()}


def quantize_repository(repository: Path, evaluate: bool = True) -> dict[str, Any] | None:
    """int8 graphs for models/g2p's latest version, the card's hashes updated, and (unless not
    `evaluate`) their test figures recorded as "test_int8"; returns those figures."""
    g2p = Path(repository) / "g2p"
    path = g2p / "config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    version = load_model_config(g2p).directory
    quantize_graphs(version)
    card = config["model_card"]
    result = evaluate_repository(g2p, precision=PRECISION) if evaluate else None
    if result is not None:
        card["test_int8"] = {k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}
    card["sha256"] = file_hashes(version)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.quantize", description=__doc__)
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    result = quantize_repository(args.model_repository)
    assert result is not None
    print(f"int8 test: WER {result['wer']:.2%} PER {result['per']:.2%} (see the model card's test_int8)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
