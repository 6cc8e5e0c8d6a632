"""The exported encoder and one-step decoder graphs on onnxruntime, as a `StepModel`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

__all__ = [
    "DECODER_FILE",
    "ENCODER_FILE",
    "GRAPHEMES_FILE",
    "GRAPH_POSITIONS",
    "PHONEMES_FILE",
    "Layers",
    "OnnxSeq2Seq",
    "graph_file",
    "session_options",
    "step_arrays",
    "step_input_names",
]

ENCODER_FILE, DECODER_FILE = "encoder.onnx", "decoder.onnx"
GRAPHEMES_FILE, PHONEMES_FILE = "graphemes.json", "phonemes.json"
GRAPH_POSITIONS = 512  # positions the exported graphs cover: their positional encoding's rows


def graph_file(name: str, precision: str = "fp32") -> str:
    """The file of graph `name` ("encoder.onnx") at `precision`: "encoder.int8.onnx" for int8."""
    return name if precision == "fp32" else name.replace(".onnx", f".{precision}.onnx")


Layers = np.ndarray | Sequence[np.ndarray]  # a per-layer input: (L, B, ...), or each layer's (B, ...)

STEP_INPUTS = ("tokens", "positions", "cache_mask", "memory_mask")  # then PER_LAYER_INPUTS for each layer
PER_LAYER_INPUTS = ("cache_keys", "cache_values", "cross_keys", "cross_values")
STEP_OUTPUTS = ("log_probs", "new_keys", "new_values", "cross_attention")


def step_input_names(layers: int) -> list[str]:
    """The decoder graph's inputs: STEP_INPUTS, then cache_keys_0, cache_values_0, cross_keys_0, ..."""
    return [*STEP_INPUTS, *(f"{name}_{i}" for i in range(layers) for name in PER_LAYER_INPUTS)]


def step_arrays(*args: Any) -> list[Any]:
    """A `StepModel.step`'s arguments in the decoder graph's input order: numpy arrays, or torch's tensors
    when exporting (no torch import here); a per-layer one as an (L, ...) array, whose each layer's slice is a
    contiguous view (nothing is copied), or as a list of each layer's."""
    tokens, positions, cache_keys, cache_values, cache_mask, cross_keys, cross_values, memory_mask = args
    per_layer = (cache_keys, cache_values, cross_keys, cross_values)
    return [tokens, positions, cache_mask, memory_mask, *(a[i] for i in range(len(cache_keys)) for a in per_layer)]


def session_options(
    intra_op_threads: int = 1, inter_op_threads: int = 1, optimization: str = "all"
) -> ort.SessionOptions:
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = inter_op_threads
    opts.graph_optimization_level = levels[optimization]
    opts.log_severity_level = 3
    return opts


class OnnxSeq2Seq:
    """encoder.onnx + decoder.onnx of a model version directory."""

    def __init__(
        self,
        directory: Path,
        options: ort.SessionOptions | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        precision: str = "fp32",
    ) -> None:
        options = options or session_options()
        d = Path(directory)
        self.encoder = ort.InferenceSession(
            str(d / graph_file(ENCODER_FILE, precision)), options, providers=list(providers)
        )
        self.decoder = ort.InferenceSession(
            str(d / graph_file(DECODER_FILE, precision)), options, providers=list(providers)
        )
        self.providers = self.encoder.get_providers()
        layers = (len(self.decoder.get_inputs()) - len(STEP_INPUTS)) // len(PER_LAYER_INPUTS)
        self._step_inputs = step_input_names(layers)
        _, heads, _, head_dim = self.decoder.get_inputs()[len(STEP_INPUTS)].shape  # cache_keys_0 (B, H, C, K)
        self.cache_shape = (layers, int(heads), int(head_dim))  # the decoder's cache: layers, heads, a head's size

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ck, cv = self.encoder.run(
            ["cross_keys", "cross_values"], {"input_ids": input_ids, "attention_mask": attention_mask}
        )
        return ck, cv

    def step(self, *arrays: Layers) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lp, k, v, att = self.decoder.run(list(STEP_OUTPUTS), self.step_feeds(*arrays))
        return lp, k, v, att

    def step_feeds(self, *arrays: Layers) -> dict[str, np.ndarray]:
        """`StepModel.step`'s arguments as the decoder graph's feeds."""
        return dict(zip(self._step_inputs, step_arrays(*arrays), strict=True))
