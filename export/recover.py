"""A checkpoint recovered from an exported model version: the weights are in its ONNX graphs.

The repository ships graphs, not training checkpoints. To export them again (a new graph layout,
a new opset) the PyTorch model is rebuilt from `encoder.onnx` and `decoder.onnx`: every named
initializer is a parameter under its own name, and every nameless weight matrix feeds a MatMul in
the order the exporter traced the modules, transposed (nn.Linear keeps (out, in)); weights stored as
fp16 (export/storage.py) come back as the same values in fp32. The rebuilt model must reproduce both
graphs' outputs, or nothing is written.

    python -m export.recover models/g2p --out checkpoints/g2p/recovered.pt
    qkv export checkpoints/g2p/recovered.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from export.checkpoint import TorchStepModel, load_checkpoint
from export.model import Transformer, TransformerConfig, make_model
from export.storage import weights_fp32
from service.repository.layout import load_model_config
from service.seq2seq.generation import pad_ids
from service.seq2seq.graphs import DECODER_FILE, ENCODER_FILE, GRAPHEMES_FILE, PHONEMES_FILE
from service.seq2seq.vocab import Vocabulary

__all__ = ["main", "recover"]

TOLERANCE = 1e-5


def _linear_order(config: TransformerConfig) -> tuple[list[str], list[str]]:
    """The nn.Linear modules whose weights each graph holds, in the order the exporter traced them."""
    encoder = [
        f"encoder.layers.{i}.{m}"
        for i in range(config.n_encoder)
        for m in ("self_attn.w_k", "self_attn.w_v", "self_attn.w_q", "self_attn.w_o",
                  "feed_forward.w_1", "feed_forward.w_2")
    ]  # fmt: skip
    encoder += [f"decoder.layers.{i}.src_attn.{w}" for i in range(config.n_decoder) for w in ("w_k", "w_v")]
    decoder = [
        f"decoder.layers.{i}.{m}"
        for i in range(config.n_decoder)
        for m in ("self_attn.w_k", "self_attn.w_v", "self_attn.w_q", "self_attn.w_o", "src_attn.w_q",
                  "src_attn.w_o", "feed_forward.w_1", "feed_forward.w_2")
    ]  # fmt: skip
    return encoder, [*decoder, "generator"]


def _graph_weights(path: Path, linears: list[str]) -> dict[str, np.ndarray]:
    """Parameters by name where the graph kept their names; the nameless weight matrices, in graph
    order, to the `linears` still missing, transposed back to nn.Linear's (out, in)."""
    graph = weights_fp32(onnx.load(str(path))).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    params = {name.removeprefix("model."): a for name, a in inits.items() if name.startswith("model.")}
    nameless = [(n.input[1], n) for n in graph.node if n.op_type in ("MatMul", "Gemm")
                and n.input[1] in inits and not n.input[1].startswith("model.")]  # fmt: skip
    missing = [m for m in linears if f"{m}.weight" not in params]
    if missing[-1:] == ["generator"] and len(nameless) == len(missing) - 1:
        missing.pop()  # tied to the target embedding, whose name the graph uses
    if len(nameless) != len(missing):
        raise ValueError(f"{path}: {len(nameless)} nameless weight matrices for {len(missing)} linear layers")
    for module, (name, node) in zip(missing, nameless, strict=True):
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        params[f"{module}.weight"] = inits[name] if trans_b else inits[name].T
    return params


def recover(version: Path, config: TransformerConfig) -> Transformer:
    """The PyTorch model whose export `version` (a directory with encoder.onnx, decoder.onnx) is."""
    enc_linears, dec_linears = _linear_order(config)
    params = _graph_weights(version / ENCODER_FILE, enc_linears)
    params.update(_graph_weights(version / DECODER_FILE, dec_linears))
    model = make_model(config)
    state = model.state_dict()
    params["generator.weight"] = params["tgt_embed.lut.weight"]  # tied: the graph keeps one copy
    missing = sorted(set(state) - set(params))
    if missing:
        raise ValueError(f"{version}: no weights for {missing}")
    model.load_state_dict({k: torch.from_numpy(np.array(params[k])) for k in state})
    return model.eval()


def check_encoder(model: Transformer, version: Path, sources: list[list[int]]) -> float:
    """Largest difference between the rebuilt model's and the shipped encoder's cross keys/values."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(version / ENCODER_FILE), providers=["CPUExecutionProvider"])
    ids, mask = pad_ids(sources)
    shipped = session.run(["cross_keys", "cross_values"], {"input_ids": ids, "attention_mask": mask})
    rebuilt = TorchStepModel(model).encode(ids, mask)
    return max(float(np.abs(a - b).max()) for a, b in zip(shipped, rebuilt, strict=True))


def checkpoint_state(
    model: Transformer, card: dict[str, Any], graphemes: Vocabulary, phonemes: Vocabulary
) -> dict[str, Any]:
    """What `qkv train` saves, with the training record taken from the model card."""
    training = card["training"]
    return {
        "config": card["config"],  # as trained (the rebuilt model's positional table may be longer)
        "train": training["recipe"],
        "model": model.state_dict(),
        "step": training["steps"],
        "epoch": training["epochs"],
        "elapsed_s": training["hours"] * 3600,
        "best_dev_wer": training["best_dev_wer"],
        "history": [],
        "parameters": card["parameters"],
        "graphemes": graphemes.symbols,
        "phonemes": phonemes.symbols,
        "recovered_from": card.get("sha256", {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.recover", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("model", type=Path, help="a g2p model directory (models/g2p)")
    parser.add_argument("--out", type=Path, default=Path("checkpoints/g2p/recovered.pt"))
    args = parser.parse_args(argv)
    model_config = load_model_config(args.model)
    card = json.loads((args.model / "config.json").read_text())["model_card"]
    version = model_config.directory
    graphemes, phonemes = Vocabulary.load(version / GRAPHEMES_FILE), Vocabulary.load(version / PHONEMES_FILE)
    from export.onnx_export import MAX_SEQUENCE_LENGTH

    config = TransformerConfig(**{**card["config"], "max_len": MAX_SEQUENCE_LENGTH})
    model = recover(version, config)
    rng = np.random.default_rng(0)
    sources = [list(rng.integers(4, len(graphemes), size=int(rng.integers(1, 20)))) for _ in range(32)]
    worst = check_encoder(model, version, sources)
    if worst > TOLERANCE:
        print(f"the rebuilt encoder differs from {version / ENCODER_FILE} by {worst:.2e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint_state(model, card, graphemes, phonemes), args.out)
    load_checkpoint(args.out)  # it loads as a trained checkpoint does
    print(f"recovered {version} -> {args.out} (encoder within {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
