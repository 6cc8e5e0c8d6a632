"""`qkv attention TEXT [--out FILE.png]`: the cross-attention map of every word of TEXT, asked of the server.

Rows are the phonemes the decoder produced, columns the graphemes it attended to: the alignment picture
of the paper's readers. TEXT is read as `qkv infer` reads it (numbers, symbols and abbreviations spoken,
long words cut into pieces), and each word it reads gets its own map; a word the model cannot spell
(an emoji, Chinese) gets its reason instead. With `--out`, one PNG with a panel per word (matplotlib, the
`plot` extra, which `make serve` installs); without it, the same maps as tables in the terminal, which
need nothing more. The words are asked with `lexicon` false: the model decodes each, whether or not its
lexicon knows it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WordMap", "main", "render", "table", "word_maps"]

NEEDS_MATPLOTLIB = "the PNG needs matplotlib: pip install -e '.[plot]' in the repository (or no --out: a table)"
PANELS_A_ROW = 4


@dataclass
class WordMap:
    """One word read from the text: its letters, its phonemes and their attention (phonemes x letters),
    or, for a word the model did not spell, why not."""

    word: str
    phonemes: list[str]
    attention: np.ndarray
    reason: str = ""


def word_maps(outputs: dict[str, Any]) -> list[WordMap]:
    """The maps of one TEXT element's answer (PHONEMES, ATTENTION, WORDS, REASONS, as `g2p_outputs` reads
    them): a word's phonemes are its part of PHONEMES between " | ", its map ATTENTION's row cut to them."""
    words, reasons = outputs["WORDS"], outputs["REASONS"]
    parts = outputs["PHONEMES"][0].split(" | ") if words else []
    maps = []
    for i, (word, reason) in enumerate(zip(words, reasons, strict=True)):
        phonemes = parts[i].split() if i < len(parts) else []
        attention = outputs["ATTENTION"][i, : len(phonemes), : len(word)]
        maps.append(WordMap(word, phonemes, attention, reason))
    return maps


def table(word: str, phonemes: list[str], attention: np.ndarray) -> str:
    """The attention map as text: one row per phoneme, one column per letter, weights in percent."""
    width = max(3, *(len(p) for p in phonemes)) if phonemes else 3
    lines = [" " * width + "".join(f"{c:>4}" for c in word)]
    for p, row in zip(phonemes, attention, strict=True):
        lines.append(f"{p:>{width}}" + "".join(f"{round(100 * float(w)):>4}" for w in row))
    return "\n".join(lines)


def render(maps: list[WordMap], out: Path) -> None:
    """One PNG, a panel per word (PANELS_A_ROW a row), each sized to the longest word and phonemes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():  # a word the font cannot draw (an emoji) is drawn as boxes, not refused
        warnings.filterwarnings("ignore", "Glyph .* missing from", UserWarning)
        _draw(plt, maps, out)


def _draw(plt: Any, maps: list[WordMap], out: Path) -> None:
    columns = min(len(maps), PANELS_A_ROW)
    rows = math.ceil(len(maps) / columns)
    letters = max(len(m.word) for m in maps)
    phonemes = max((len(m.phonemes) for m in maps), default=1)
    size = (columns * (1.2 + 0.4 * letters), rows * (1.2 + 0.35 * max(phonemes, 2)))
    fig, axes = plt.subplots(rows, columns, figsize=size, squeeze=False)
    for ax, m in zip(axes.flat, maps, strict=False):
        if m.phonemes:
            ax.imshow(m.attention, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_yticks(range(len(m.phonemes)), m.phonemes, fontsize=8)
        else:  # nothing decoded: the word's letters, and why
            ax.text(0.5, 0.5, m.reason or "no phonemes", ha="center", va="center", wrap=True, fontsize=8,
                    transform=ax.transAxes)  # fmt: skip
            ax.set_yticks([])
        ax.set_xticks(range(len(m.word)), list(m.word), fontsize=8)
        ax.set_title(m.word, fontsize=9)
    for ax in list(axes.flat)[len(maps) :]:
        ax.axis("off")
    fig.supxlabel("graphemes", fontsize=9)
    fig.supylabel("phonemes", fontsize=9)
    fig.suptitle("cross-attention (last layer, mean of heads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(
    argv: list[str],
    add_client_arguments: Callable[[argparse.ArgumentParser], None],
    make_client: Callable[[argparse.Namespace], Any],
) -> int:
    import grpc

    from service.tools.client import g2p_outputs, g2p_request, rpc_problem

    parser = argparse.ArgumentParser(prog="qkv attention", description=__doc__)
    parser.add_argument("text", help="a word, or any text: each word it reads gets a map")
    parser.add_argument("--out", type=Path, help="PNG file to write, a panel per word (matplotlib); without it, tables")
    parser.add_argument("--model", default="g2p")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    if args.out is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"qkv attention: {NEEDS_MATPLOTLIB}", file=sys.stderr)
        return 2
    request = g2p_request([args.text], args.model, attention=True, lexicon=False)
    request.outputs.add(name="WORDS")
    request.outputs.add(name="REASONS")
    try:
        with make_client(args) as client:
            out = g2p_outputs(client.infer(request))
    except grpc.RpcError as e:
        print(f"qkv attention: {rpc_problem(e, args.url)}", file=sys.stderr)
        return 1
    maps = word_maps(out)
    print(f"{args.text}\t{out['PHONEMES'][0]}")
    if not maps:
        print(f"qkv attention: no word to map in {args.text!r}", file=sys.stderr)
        return 1
    if args.out is None:  # a block a word, a blank line between two
        blocks = [f"{m.word}: {m.reason}" if m.reason else table(m.word, m.phonemes, m.attention) for m in maps]
        print("\n\n".join(blocks))
        return 0
    render(maps, args.out)
    print(f"{len(maps)} word{'s' if len(maps) > 1 else ''} -> {args.out}")
    return 0
