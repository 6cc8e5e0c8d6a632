"""`qkv evaluate`: WER/PER on a split, for a PyTorch checkpoint or the exported ONNX graphs.

Both go through the same decoding code (`service.seq2seq.generation`) and the same scoring
(`export.scoring`); only the `StepModel` underneath differs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from export import data
from export.scoring import score
from service.decoding.words import greedy_decode
from service.errors import UsageError, in_range
from service.repository.layout import RepositoryError, load_model_config
from service.seq2seq.generation import StepModel, beam_search
from service.seq2seq.graphs import GRAPHEMES_FILE, PHONEMES_FILE, OnnxSeq2Seq, session_options
from service.seq2seq.vocab import Vocabulary

__all__ = ["evaluate", "evaluate_checkpoint", "evaluate_repository", "main", "predict", "record_in_card"]

MAX_OUTPUT_LENGTH = 40


def predict(
    model: StepModel,
    graphemes: Vocabulary,
    phonemes: Vocabulary,
    words: list[str],
    beam_size: int = 1,
    batch_size: int = 256,
) -> list[list[str]]:
    """Phoneme sequences for `words`, greedy (beam_size 1) or by beam search."""
    sources = [graphemes.encode(w) for w in words]
    if beam_size == 1:
        hyps = greedy_decode(model, sources, MAX_OUTPUT_LENGTH, batch_size=batch_size)
    else:
        hyps = []
        for start in range(0, len(sources), batch_size // beam_size or 1):
            hyps += beam_search(
                model, sources[start : start + batch_size // beam_size or 1], beam_size, MAX_OUTPUT_LENGTH
            )
    return [phonemes.decode(h.output) for h in hyps]


def evaluate(
    model: StepModel,
    graphemes: Vocabulary,
    phonemes: Vocabulary,
    split: str = "test",
    limit: int = 0,
    beam_size: int = 1,
) -> dict[str, Any]:
    lexicon = data.load_lexicon()
    words = data.read_split(split)
    if limit:
        words = words[:limit]
    t0 = time.perf_counter()
    preds = predict(model, graphemes, phonemes, words, beam_size)
    result: dict[str, Any] = score(preds, [lexicon[w] for w in words])
    result.update(split=split, beam_size=beam_size, seconds=round(time.perf_counter() - t0, 2))
    return result


def evaluate_repository(g2p_dir: Path, precision: str = "fp32", **kwargs: Any) -> dict[str, Any]:
    """The exported graphs of models/g2p/<latest version>/ on onnxruntime (2 threads)."""
    version = load_model_config(Path(g2p_dir)).directory
    model = OnnxSeq2Seq(version, session_options(intra_op_threads=2), precision=precision)
    return evaluate(
        model, Vocabulary.load(version / GRAPHEMES_FILE), Vocabulary.load(version / PHONEMES_FILE), **kwargs
    )


def evaluate_checkpoint(path: Path, **kwargs: Any) -> dict[str, Any]:
    from export.checkpoint import TorchStepModel, load_checkpoint

    loaded = load_checkpoint(path)
    return evaluate(TorchStepModel(loaded.model), loaded.graphemes, loaded.phonemes, **kwargs)


def record_in_card(repository: Path, result: dict[str, Any]) -> None:
    """Write the test figures into models/g2p/config.json's model card (that of the newest version):
    greedy decoding's as "test", beam search's as "test_beam"."""
    path = Path(repository) / "g2p" / "config.json"
    config = json.loads(path.read_text())
    key = "test" if result.get("beam_size", 1) == 1 else "test_beam"
    config["model_card"][key] = {k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkv evaluate", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="a PyTorch checkpoint (needs the export extra)")
    source.add_argument("--model-repository", type=Path, default=Path("models"), help="evaluate its g2p ONNX graphs")
    parser.add_argument("--split", choices=data.SPLITS, default="test")
    parser.add_argument("--limit", type=int, default=0, help="only the first N words of the split")
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--record", action="store_true", help="store the figures in the model card")
    args = parser.parse_args(argv)
    in_range("--limit", args.limit, 0)
    in_range("--beam-size", args.beam_size, 1)
    if args.checkpoint and args.record:
        raise UsageError("--record writes an exported model's card: give --model-repository, not --checkpoint")
    kwargs = {"split": args.split, "limit": args.limit, "beam_size": args.beam_size}
    if args.checkpoint:
        result = evaluate_checkpoint(args.checkpoint, **kwargs)  # a missing or damaged file: a UsageError
    else:
        g2p = args.model_repository / "g2p"
        if not g2p.is_dir():
            raise UsageError(f"model repository {args.model_repository} has no g2p model: {g2p} is not a directory")
        try:
            result = evaluate_repository(g2p, **kwargs)
        except RepositoryError as e:
            raise UsageError(str(e)) from e
        if args.record:
            record_in_card(args.model_repository, result)
    print(
        f"{result['split']} ({result['words']} words, beam {result['beam_size']}): "
        f"WER {result['wer_stress_free']:.2%} PER {result['per_stress_free']:.2%} stress-free; "
        f"WER {result['wer']:.2%} PER {result['per']:.2%} with stress"
    )
    print(json.dumps(result))
    return 0
