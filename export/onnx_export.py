"""`qkv export`: a checkpoint -> ONNX graphs + model repository entries, with a parity check.

Writes two entries (docs/design.md, "Model repository"):
    models/g2p/          encoder.onnx (+ cross-attention keys/values), decoder.onnx (one cached step),
                         graphemes.json, phonemes.json, lexicon.txt.gz (CMUdict: export/lexicon.py) under
                         1/, and config.json with the model card
                         (`--int8`: the graphs' int8 copies beside them, export/quantize.py)
    models/g2p_encoder/  the same encoder as a plain tensor model: input_ids, attention_mask -> last_hidden_state
The graphs store their weights as fp16 and compute in fp32 (export/storage.py). The export refuses to write
a repository whose graphs disagree with PyTorch running the same fp16-rounded weights, and records how
often the rounding changes a word's greedy answer.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from export import data
from export.checkpoint import Loaded, TorchStepModel, average_checkpoints, load_checkpoint, named_recipe, run_name
from export.lexicon import build_lines, card_entry, write_lexicon
from export.model import DecoderStep, EncoderGraph, Transformer
from export.quantize import file_hashes, quantize_repository
from export.storage import round_weights_fp16, store_weights_fp16
from service.decoding.words import greedy_decode
from service.errors import UsageError, in_range, readable_file
from service.models.g2p.lexicon import LEXICON_FILE
from service.models.g2p.text import RULES as TEXT_RULES
from service.repository.layout import available_versions, model_cards
from service.seq2seq.generation import StepModel, pad_ids
from service.seq2seq.graphs import (
    DECODER_FILE,
    ENCODER_FILE,
    GRAPH_POSITIONS,
    GRAPHEMES_FILE,
    PHONEMES_FILE,
    STEP_INPUTS,
    STEP_OUTPUTS,
    OnnxSeq2Seq,
    session_options,
    step_arrays,
    step_input_names,
)

__all__ = ["export_graphs", "main", "parity_check", "write_repository"]

OPSET = 18
LOGIT_TOLERANCE = 1e-4
MIN_ROUNDING_AGREEMENT = 0.99  # of parity words whose greedy answer fp16 weights leave as it was
MAX_WORD_LENGTH = 32  # graphemes; CMUdict's longest word has 28
MAX_OUTPUT_LENGTH = 40  # phonemes; CMUdict's longest pronunciation has 28
MAX_SEQUENCE_LENGTH = GRAPH_POSITIONS  # positions the exported graphs cover (the tensor model takes long inputs)


class _EncoderOnly(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.graph = EncoderGraph(model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.graph(input_ids, attention_mask)[0]


def _export(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    axes: dict[str, dict[int, str]],
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer notes on constant shapes (d_k), expected here
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )


def export_graphs(model: Transformer, directory: Path) -> dict[str, Path]:
    """Write encoder.onnx, decoder.onnx and the plain encoder model.onnx into `directory`."""
    model.eval()
    c = model.config
    b, s, t = 2, 5, 3
    ids = torch.randint(4, c.src_vocab, (b, s))
    mask = torch.ones(b, s, dtype=torch.int64)
    with torch.no_grad():
        _, ck, cv = EncoderGraph(model)(ids, mask)
    enc_axes = {"input_ids": {0: "batch", 1: "source"}, "attention_mask": {0: "batch", 1: "source"}}
    kv_axes = {1: "batch", 3: "source"}
    paths = {
        "encoder": directory / ENCODER_FILE,
        "decoder": directory / DECODER_FILE,
        "plain": directory / "model.onnx",
    }
    _export(
        EncoderGraph(model),
        (ids, mask),
        paths["encoder"],
        ["input_ids", "attention_mask"],
        ["memory", "cross_keys", "cross_values"],
        {**enc_axes, "memory": {0: "batch", 1: "source"}, "cross_keys": kv_axes, "cross_values": kv_axes},
    )
    _export(
        _EncoderOnly(model),
        (ids, mask),
        paths["plain"],
        ["input_ids", "attention_mask"],
        ["last_hidden_state"],
        {**enc_axes, "last_hidden_state": {0: "batch", 1: "source"}},
    )
    layers, heads, d_k = c.n_decoder, c.h, c.d_k
    capacity = 4  # cache slots in the example; t of them real
    cache = torch.randn(layers, b, heads, capacity, d_k)
    cache_mask = (torch.arange(capacity) < t).long().expand(b, capacity).contiguous()
    step_args = step_arrays(
        torch.randint(4, c.tgt_vocab, (b,)), torch.full((b,), t), cache, cache.clone(), cache_mask, ck, cv, mask
    )
    names = step_input_names(layers)
    per_layer_axes = {"cache": {0: "batch", 2: "cache"}, "cross": {0: "batch", 2: "source"}}
    step_axes = {
        "tokens": {0: "batch"},
        "positions": {0: "batch"},
        "cache_mask": {0: "batch", 1: "cache"},
        "memory_mask": {0: "batch", 1: "source"},
        **{n: per_layer_axes[n.split("_")[0]] for n in names[len(STEP_INPUTS) :]},
        "log_probs": {0: "batch"},
        "new_keys": {1: "batch"},
        "new_values": {1: "batch"},
        "cross_attention": {0: "batch", 1: "source"},
    }
    _export(DecoderStep(model), tuple(step_args), paths["decoder"], names, list(STEP_OUTPUTS), step_axes)
    return paths


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) if a.size else 0.0


def parity_check(
    loaded: Loaded, directory: Path, words: list[str], reference: list[list[int]] | None = None
) -> dict[str, Any]:
    """PyTorch vs onnxruntime: logits of a teacher-forced pass, then greedy outputs on `words`
    (`reference`: PyTorch's, when already decoded)."""
    torch_model: StepModel = TorchStepModel(loaded.model)
    onnx_model: StepModel = OnnxSeq2Seq(directory, session_options(2))
    rng = np.random.default_rng(0)
    worst = 0.0
    sources = [loaded.graphemes.encode(w) for w in words[:64]]
    random_sources = [list(rng.integers(4, len(loaded.graphemes), size=int(rng.integers(1, 20)))) for _ in range(16)]
    for batch in (sources, random_sources):
        ids, mask = pad_ids(batch)
        states = [m.encode(ids, mask) for m in (torch_model, onnx_model)]
        worst = max(worst, *(_max_diff(x, y) for x, y in zip(*states, strict=True)))
        # Decode a few steps with teacher-forced random tokens, comparing every output; each model
        # keeps its own cache, as a caller does.
        ck, cv = states[0]
        layers, n, heads, _, d_k = ck.shape
        caches = [[np.zeros((layers, n, heads, 8, d_k), np.float32) for _ in range(2)] for _ in range(2)]
        for step in range(6):
            tokens = rng.integers(4, len(loaded.phonemes), size=(n,)).astype(np.int64)
            cache_mask = (np.arange(8) < step).astype(np.int64)[None].repeat(n, axis=0)
            outs = []
            for m, (keys, values) in zip((torch_model, onnx_model), caches, strict=True):
                out = m.step(tokens, np.full(n, step, np.int64), keys, values, cache_mask, ck, cv, mask)
                keys[:, :, :, step], values[:, :, :, step] = out[1], out[2]
                outs.append(out)
            worst = max(worst, *(_max_diff(x, y) for x, y in zip(*outs, strict=True)))
    sources = [loaded.graphemes.encode(w) for w in words]
    expected = reference if reference is not None else greedy_outputs(torch_model, sources)
    same = _agreeing(expected, greedy_outputs(onnx_model, sources))
    return {"max_abs_diff": worst, "greedy_identical": same, "greedy_words": len(words)}


def greedy_outputs(model: StepModel, sources: list[list[int]]) -> list[list[int]]:
    return [h.output for h in greedy_decode(model, sources, MAX_OUTPUT_LENGTH)]


def _agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def rounding_check(loaded: Loaded, rounded_outputs: list[list[int]], sources: list[list[int]]) -> dict[str, Any]:
    """What storing the weights as fp16 changes: greedy outputs of `sources` with the full weights (in
    PyTorch) against `rounded_outputs`, those of the rounded ones."""
    same = _agreeing(greedy_outputs(TorchStepModel(loaded.model), sources), rounded_outputs)
    return {"stored_as": "fp16, computed in fp32", "greedy_identical": same, "greedy_words": len(sources)}


def write_repository(
    loaded: Loaded,
    repository: Path,
    parity_words: list[str],
    metrics: dict[str, Any] | None = None,
    version: str = "1",
    beside: bool = False,
    encoder_model: bool = True,
) -> dict[str, Any]:
    """Export, check parity, then write models/g2p and models/g2p_encoder: replacing them, or with `beside`,
    as `version` next to the versions already there, all served (version_policy "all"). The model card
    describes the newest version; the cards of the others move under its "versions". Without
    `encoder_model`, models/g2p_encoder is left as it is."""
    rounded = Loaded(round_weights_fp16(copy.deepcopy(loaded.model)), loaded.graphemes, loaded.phonemes, loaded.state)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        paths = export_graphs(rounded.model, staging)
        for path in paths.values():
            store_weights_fp16(path)  # exact: the weights are fp16 values already
        loaded.graphemes.save(staging / GRAPHEMES_FILE)
        loaded.phonemes.save(staging / PHONEMES_FILE)
        sources = [loaded.graphemes.encode(w) for w in parity_words]
        rounded_outputs = greedy_outputs(TorchStepModel(rounded.model), sources)  # decoded once, used twice
        parity = parity_check(rounded, staging, parity_words, rounded_outputs)
        if parity["max_abs_diff"] > LOGIT_TOLERANCE or parity["greedy_identical"] != parity["greedy_words"]:
            raise RuntimeError(f"ONNX graphs disagree with PyTorch: {parity}")
        weights = rounding_check(loaded, rounded_outputs, sources)
        if weights["greedy_identical"] < MIN_ROUNDING_AGREEMENT * weights["greedy_words"]:
            raise RuntimeError(f"fp16 weights change too many answers: {weights}")
        g2p, enc = repository / "g2p", repository / "g2p_encoder"
        written = (g2p, enc) if encoder_model else (g2p,)
        earlier = {d: _earlier_cards(d, version) if beside else {} for d in written}
        for d in written:
            shutil.rmtree(d / version if beside else d, ignore_errors=True)
            (d / version).mkdir(parents=True)
        for name in (ENCODER_FILE, DECODER_FILE, GRAPHEMES_FILE, PHONEMES_FILE):
            shutil.copy(staging / name, g2p / version / name)
        lexicon_lines = build_lines()  # the pronouncing lexicon the version answers known words from
        lexicon = card_entry(lexicon_lines, write_lexicon(g2p / version / LEXICON_FILE, lexicon_lines))
        if encoder_model:
            shutil.copy(paths["plain"], enc / version / "model.onnx")
    state = loaded.state
    card = {
        "architecture": "Transformer encoder-decoder (Vaswani et al., 2017), pre-norm, tied target embeddings",
        "task": "English grapheme-to-phoneme, CMU Pronouncing Dictionary (ARPAbet with stress digits)",
        "text_normalization": TEXT_RULES,  # how the server reads text into words for it
        "config": state["config"],
        "parameters": state["parameters"],
        "averaged_checkpoint_steps": state.get("averaged_steps"),
        "training": {
            "hours": round(state["elapsed_s"] / 3600, 3),
            "epochs": state["epoch"],
            "steps": state["step"],
            "hardware": state.get("hardware"),
            "best_dev_wer": state["best_dev_wer"],
            "recipe": named_recipe(state["train"]),  # runs by name: not the paths they were written to
            **_earlier_runs(state),
        },
        "test": metrics or {},
        "lexicon": lexicon,
        "onnx_opset": OPSET,
        "parity": parity,
        "weights": weights,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    g2p_config: dict[str, Any] = {
        "name": "g2p",
        "kind": "g2p",
        "max_batch_size": 64,
        "limits": {
            "max_word_length": MAX_WORD_LENGTH,
            "max_output_length": MAX_OUTPUT_LENGTH,
            "max_words": 64,
            "max_element_bytes": 1024,
        },
        "model_card": {
            **card,
            "sha256": file_hashes(g2p / version),
        },
    }
    configs = {g2p: g2p_config}
    if encoder_model:
        configs[enc] = {
            "name": "g2p_encoder",
            "kind": "tensor",
            "max_batch_size": 64,
            "sequence_axis": 1,
            "limits": {
                "max_sequence_length": loaded.model.config.max_len,
                "vocab_size": {"input_ids": len(loaded.graphemes)},
            },
            "model_card": {
                "description": "the g2p model's encoder as a plain tensor model: grapheme ids -> states",
                "vocabulary": "graphemes.json of models/g2p",
                "config": state["config"],
                "onnx_opset": OPSET,
                "sha256": file_hashes(enc / version),
            },
        }
    for d, config in configs.items():
        if beside:
            config["version_policy"] = {"all": {}}
            if earlier[d]:
                config["model_card"]["versions"] = earlier[d]
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return g2p_config


def _earlier_runs(state: dict[str, Any]) -> dict[str, Any]:
    """For weights that continued other runs (`qkv train --init`): those runs, and the hours of all of them."""
    lineage = [
        run | {"run": run_name(run["run"]), "recipe": named_recipe(run["recipe"])} for run in state.get("lineage") or []
    ]
    if not lineage:
        return {}
    total = state["elapsed_s"] / 3600 + sum(run["hours"] for run in lineage)
    return {"continues": lineage, "total_hours": round(total, 3)}


def _earlier_cards(model_dir: Path, version: str) -> dict[str, Any]:
    """The model cards of a model's other versions on disk, by version."""
    on_disk = {str(v) for v in available_versions(model_dir)} if model_dir.is_dir() else set()
    return {v: card for v, card in model_cards(model_dir).items() if v != version and v in on_disk}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qkv export", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        nargs="*",
        default=[Path("checkpoints/g2p/best.pt")],
        help="a checkpoint, or several of one run to export their averaged weights",
    )
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--parity-words", type=int, default=1000, help="test words decoded by both runtimes")
    parser.add_argument("--no-evaluate", action="store_true", help="skip the test-split WER/PER of the export")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam-size", type=int, default=4, help="the card's test figures: greedy, and with this beam")
    parser.add_argument(
        "--no-encoder-model",
        action="store_true",
        help="write models/g2p only; models/g2p_encoder (the encoder as a tensor model) stays as it is",
    )
    parser.add_argument("--int8", action="store_true", help="also write the graphs' int8 copies (export/quantize.py)")
    parser.add_argument(
        "--version",
        help="write this version beside the versions already in the repository, all of them served "
        "(default: replace the models with version 1)",
    )
    parser.add_argument(
        "--lexicon-only",
        action="store_true",
        help="write the pronouncing lexicon into every version of models/g2p and their cards, nothing else",
    )
    args = parser.parse_args(argv)
    if args.lexicon_only:
        from export.lexicon import main as lexicon_main

        g2p = args.model_repository / "g2p"
        versions = [g2p / str(v) for v in available_versions(g2p)] if g2p.is_dir() else []
        if not versions:
            raise UsageError(f"no version of g2p in {args.model_repository} to write the lexicon into")
        return lexicon_main([str(v) for v in versions])
    # Everything the flags say is checked before the checkpoints load (seconds) and the export runs (minutes).
    test_words = data.read_split("test")
    in_range("--parity-words", args.parity_words, 1, len(test_words))
    in_range("--threads", args.threads, 1)
    in_range("--beam-size", args.beam_size, 1)
    if args.version is not None and not args.version.isdigit():
        raise UsageError(f"--version {args.version}: must be a number")
    if args.model_repository.exists() and not args.model_repository.is_dir():
        raise UsageError(f"model repository is not a directory: {args.model_repository}")
    for path in args.checkpoint:
        readable_file(path, "checkpoint")
    torch.set_num_threads(args.threads)
    if len(args.checkpoint) > 1:
        loaded = average_checkpoints(args.checkpoint, max_len=MAX_SEQUENCE_LENGTH)
    else:
        loaded = load_checkpoint(args.checkpoint[0], max_len=MAX_SEQUENCE_LENGTH)
    words = random.Random(0).sample(test_words, args.parity_words)
    config = write_repository(loaded, args.model_repository, words, version=args.version or "1",
                              beside=args.version is not None, encoder_model=not args.no_encoder_model)  # fmt: skip
    print(f"parity: {config['model_card']['parity']}")
    if not args.no_evaluate:
        from export.evaluate import evaluate_repository, record_in_card

        for beam_size in (1, args.beam_size):
            result = evaluate_repository(args.model_repository / "g2p", beam_size=beam_size)
            record_in_card(args.model_repository, result)
            print(json.dumps(result, indent=2))
    int8 = quantize_repository(args.model_repository, evaluate=not args.no_evaluate) if args.int8 else None
    if int8:
        print(f"int8 graphs: test WER {int8['wer']:.2%} PER {int8['per']:.2%}")
    written = "g2p" if args.no_encoder_model else "g2p and g2p_encoder"
    print(f"wrote {written} in {args.model_repository}", file=sys.stderr)
    return 0
