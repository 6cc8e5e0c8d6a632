"""`qkv attention WORD [--out FILE.png]`: the word's cross-attention map, asked of the server.

Rows are the phonemes the decoder produced, columns the graphemes it attended to: the alignment
picture of the paper's readers. With `--out`, a PNG (matplotlib, the `plot` extra, which `make serve`
installs); without it, the same matrix as a table in the terminal, which needs nothing more. The word
is asked with `lexicon` false: the model decodes it, whether or not its lexicon knows it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "render", "table"]

NEEDS_MATPLOTLIB = "the PNG needs matplotlib: pip install -e '.[plot]' in the repository (or no --out: a table)"


def table(word: str, phonemes: list[str], attention: np.ndarray) -> str:
    """The attention map as text: one row per phoneme, one column per letter, weights in percent."""
    width = max(3, *(len(p) for p in phonemes))
    lines = [" " * width + "".join(f"{c:>4}" for c in word)]
    for p, row in zip(phonemes, attention, strict=True):
        lines.append(f"{p:>{width}}" + "".join(f"{round(100 * w):>4}" for w in row))
    return "\n".join(lines)


def render(word: str, phonemes: list[str], attention: np.ndarray, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(word), 1 + 0.4 * len(phonemes)))
    ax.imshow(attention, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(word)), list(word))
    ax.set_yticks(range(len(phonemes)), phonemes)
    ax.set_xlabel("graphemes")
    ax.set_ylabel("phonemes")
    ax.set_title(f"{word}: cross-attention (last layer, mean of heads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(
    argv: list[str],
    add_client_arguments: Callable[[argparse.ArgumentParser], None],
    make_client: Callable[[argparse.Namespace], Any],
) -> int:
    import grpc

    from service.client import g2p_outputs, g2p_request

    parser = argparse.ArgumentParser(prog="qkv attention", description=__doc__)
    parser.add_argument("word")
    parser.add_argument("--out", type=Path, help="PNG file to write (matplotlib); without it, a table")
    parser.add_argument("--model", default="g2p")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    if args.out is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"qkv attention: {NEEDS_MATPLOTLIB}", file=sys.stderr)
        return 2
    try:
        with make_client(args) as client:
            out = g2p_outputs(client.infer(g2p_request([args.word], args.model, attention=True, lexicon=False)))
    except grpc.RpcError as e:
        print(f"qkv attention: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    phonemes = out["PHONEMES"][0].split()
    letters = args.word.lower().strip()
    attention = out["ATTENTION"][0, : len(phonemes), : len(letters)]
    if args.out is None:
        print(f"{args.word}\t{out['PHONEMES'][0]}\n{table(letters, phonemes, attention)}")
        return 0
    render(letters, phonemes, attention, args.out)
    print(f"{args.word}\t{out['PHONEMES'][0]}\t-> {args.out}")
    return 0
