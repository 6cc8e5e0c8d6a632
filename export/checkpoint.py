"""Checkpoints: the model, its vocabularies and the training state in one file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.model import DecoderStep, EncoderGraph, Transformer, TransformerConfig, make_model
from service.errors import UsageError, readable_file
from service.seq2seq.graphs import Layers, step_arrays
from service.seq2seq.vocab import Vocabulary

__all__ = [
    "Loaded",
    "TorchStepModel",
    "checkpoint_name",
    "load_checkpoint",
    "named_recipe",
    "read_checkpoint",
    "run_name",
]

SAVED = ("config", "model", "graphemes", "phonemes")  # what every checkpoint of `qkv train` holds


@dataclass
class Loaded:
    model: Transformer
    graphemes: Vocabulary
    phonemes: Vocabulary
    state: dict[str, Any]  # the whole checkpoint


def read_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state saved in `path`; a UsageError naming the file when it is missing, not a file, or not a
    checkpoint of `qkv train` (a damaged or foreign file)."""
    readable_file(Path(path), "checkpoint")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # torch reports a damaged file as any of several exceptions (pickle, zip, EOF)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"checkpoint {path} is not a qkv checkpoint: {why}") from e
    if not isinstance(state, dict) or not all(key in state for key in SAVED):
        raise UsageError(f"checkpoint {path} is not a qkv checkpoint: it lacks the model or its vocabularies")
    return state


def load_checkpoint(path: Path, max_len: int | None = None) -> Loaded:
    """`max_len` extends the (computed, not learned) positional table, e.g. for longer exports."""
    state = read_checkpoint(path)
    config = TransformerConfig(**state["config"])
    if max_len:
        config = TransformerConfig(**{**state["config"], "max_len": max_len})
    model = make_model(config)
    model.load_state_dict(state["model"])
    model.eval()
    return Loaded(model, Vocabulary(state["graphemes"]), Vocabulary(state["phonemes"]), state)


def average_checkpoints(paths: list[Path], max_len: int | None = None) -> Loaded:
    """The mean of several checkpoints' weights (same run, nearby steps): usually a little better than any.

    Training state (steps, time, history) is the newest checkpoint's; `state["averaged"]` names them all.
    """
    loaded = [load_checkpoint(p, max_len) for p in paths]
    newest = max(loaded, key=lambda x: x.state["step"])
    params = {k: torch.stack([x.model.state_dict()[k].float() for x in loaded]).mean(0)
              for k in newest.model.state_dict()}  # fmt: skip
    newest.model.load_state_dict(params)
    newest.state = {**newest.state, "averaged": [str(p) for p in paths],
                    "averaged_steps": [x.state["step"] for x in loaded]}  # fmt: skip
    return newest


class TorchStepModel:
    """The `service.seq2seq.generation.StepModel` interface over a PyTorch model (no grad, float32)."""

    def __init__(self, model: Transformer) -> None:
        self.encoder = EncoderGraph(model).eval()
        self.decoder = DecoderStep(model).eval()

    @torch.inference_mode()
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _, ck, cv = self.encoder(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        return ck.numpy(), cv.numpy()

    @torch.inference_mode()
    def step(self, *arrays: Layers) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        outs = self.decoder(*(torch.from_numpy(np.ascontiguousarray(a)) for a in step_arrays(*arrays)))
        return tuple(o.numpy() for o in outs)


def run_name(path: str) -> str:
    """A training run by its name (its folder's), not by where the machine that ran it wrote it."""
    return Path(path).name if path else path


def checkpoint_name(path: str) -> str:
    """A checkpoint by its run's name and its file's (g2p-v2-cpu/last.pt), not by its path."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if path and p.parent.name else p.name if path else path


def named_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """A run's recipe (`qkv train`'s settings) as a model card records it: its output folder, the
    checkpoint it started from and its teachers by name."""
    named = dict(recipe)
    if "out" in named:
        named["out"] = run_name(named["out"])
    if named.get("init"):
        named["init"] = checkpoint_name(named["init"])
    if named.get("teachers"):
        named["teachers"] = ",".join(checkpoint_name(t) for t in named["teachers"].split(","))
    return named
