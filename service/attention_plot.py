"""`qkv attention WORD --out FILE.png`: the word's cross-attention map, asked of the server.

Rows are the phonemes the decoder produced, columns the graphemes it attended to: the
alignment picture of the paper's readers (matplotlib, from the `plot` extra).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "render"]


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
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--model", default="g2p")
    add_client_arguments(parser)
    args = parser.parse_args(argv)
    try:
        with make_client(args) as client:
            out = g2p_outputs(client.infer(g2p_request([args.word], args.model, attention=True)))
    except grpc.RpcError as e:
        print(f"qkv attention: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    phonemes = out["PHONEMES"][0].split()
    letters = args.word.lower().strip()
    attention = out["ATTENTION"][0, : len(phonemes), : len(letters)]
    render(letters, phonemes, attention, args.out)
    print(f"{args.word}\t{out['PHONEMES'][0]}\t-> {args.out}")
    return 0
