"""Incremental decoding through a stateful model: one tritonclient request per output token.

    from service.tools.incremental import IncrementalG2P
    decoder = IncrementalG2P("127.0.0.1:8001")                # g2p_decoder (export/stateful_decoder.py)
    decoder.phonemes("attention")                              # ['AH0', 'T', 'EH1', 'N', 'SH', 'AH0', 'N']

The server keeps the word's encoding and the key/value cache between the requests of a sequence
(docs/sequences.md, "Incremental decoding"); the client sends the word once, then one token a request.

    python -m service.tools.incremental [--url 127.0.0.1:8001] [--words export/data/split/test.txt]

decodes every word of the file both ways, through g2p_decoder and through g2p in one request, and prints
how many answers are equal.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from service.config import DEFAULT_URL, server_url
from service.seq2seq.graphs import GRAPHEMES_FILE, PHONEMES_FILE
from service.seq2seq.vocab import Vocabulary

__all__ = ["Comparison", "IncrementalG2P", "compare_with_g2p", "main", "one_shot"]

DEFAULT_VOCABULARIES = Path("models/g2p/2")  # the g2p version export/stateful_decoder.py wraps by default
MAX_OUTPUT_LENGTH = 40  # tokens, </s> excluded: models/g2p's max_output_length, so the two stop alike


class IncrementalG2P:
    """Greedy decoding of one word at a time, one request a token, over one gRPC connection (thread-safe:
    each word is its own sequence)."""

    _ids = itertools.count(1)
    _ids_lock = threading.Lock()

    def __init__(
        self,
        url: str,
        model: str = "g2p_decoder",
        vocabularies: Path = DEFAULT_VOCABULARIES,
        max_output_length: int = MAX_OUTPUT_LENGTH,
    ) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.graphemes = Vocabulary.load(vocabularies / GRAPHEMES_FILE)
        self.phonemes_vocabulary = Vocabulary.load(vocabularies / PHONEMES_FILE)
        self.max_output_length = max_output_length
        self.requests = 0  # sent, the end-of-sequence ones included

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def _step(self, sid: int, ids: np.ndarray, token: int, start: bool, end: bool) -> np.ndarray:
        word = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
        word.set_data_from_numpy(ids)
        previous = grpcclient.InferInput("token", [1, 1], "INT64")
        previous.set_data_from_numpy(np.array([[token]], dtype=np.int64))
        result = self.client.infer(
            self.model,
            [word, previous],
            outputs=[grpcclient.InferRequestedOutput("log_probs")],  # the state stays on the server
            sequence_id=sid,
            sequence_start=start,
            sequence_end=end,
        )
        with self._ids_lock:
            self.requests += 1
        log_probs: np.ndarray | None = result.as_numpy("log_probs")
        assert log_probs is not None
        return log_probs

    def tokens(self, word: str) -> list[int]:
        """The greedy output token ids of `word`, </s> excluded."""
        sid = self._next_id()
        ids = np.array([self.graphemes.encode(word)], dtype=np.int64)
        nothing = np.zeros((1, 1), dtype=np.int64)  # input_ids is read on the start only: later ones send a pad
        token, out = self.graphemes.bos_id, []
        for t in range(self.max_output_length):
            token = int(self._step(sid, ids if t == 0 else nothing, token, t == 0, False).argmax())
            if token == self.graphemes.eos_id:
                break
            out.append(token)
        # The last answer said the word is done: one more request ends the sequence and frees its state
        # (a sequence's end is marked on a request; its answer is not needed).
        self._step(sid, nothing, token, False, True)
        return out

    def phonemes(self, word: str) -> list[str]:
        return self.phonemes_vocabulary.decode(self.tokens(word))

    def close(self) -> None:
        self.client.close()


def one_shot(client: grpcclient.InferenceServerClient, word: str, model: str = "g2p") -> tuple[list[str], str]:
    """g2p's answer to `word` in one request, decoded by the model (`lexicon: false`, as the incremental
    decoder is): the words its text rules read it as, and the phonemes ("W ER1 L D", words joined by " | ")."""
    text = grpcclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([word.encode()], dtype=np.object_))
    wanted = [grpcclient.InferRequestedOutput(n) for n in ("PHONEMES", "WORDS")]
    result = client.infer(model, [text], outputs=wanted, parameters={"lexicon": False})
    words, phonemes = result.as_numpy("WORDS"), result.as_numpy("PHONEMES")
    assert words is not None and phonemes is not None
    return [w.decode() for w in words.reshape(-1)], phonemes.reshape(-1)[0].decode()


@dataclass
class Comparison:
    words: int = 0
    equal: int = 0
    read_otherwise: int = 0  # words g2p's text rules changed (spelled out, split): decoded as g2p read them
    differing: list[tuple[str, str, str]] = field(default_factory=list)  # word, one-shot, incremental

    def __str__(self) -> str:
        return f"{self.equal}/{self.words} equal"


def compare_with_g2p(
    url: str,
    words: Sequence[str],
    concurrency: int = 8,
    model: str = "g2p_decoder",
    vocabularies: Path = DEFAULT_VOCABULARIES,
) -> Comparison:
    """Each word decoded incrementally and by g2p in one request; the words g2p's text rules read otherwise
    are decoded as g2p read them, so both decode the same graphemes."""
    incremental = IncrementalG2P(url, model, vocabularies)
    reference = grpcclient.InferenceServerClient(url)

    def both(word: str) -> tuple[str, list[str], str, str]:
        read, expected = one_shot(reference, word)
        got = " | ".join(" ".join(incremental.phonemes(w)) for w in read)
        return word, read, expected, got

    out = Comparison()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for word, read, expected, got in pool.map(both, words):
                out.words += 1
                out.read_otherwise += read != [word]
                if got == expected:
                    out.equal += 1
                else:
                    out.differing.append((word, expected, got))
    finally:
        incremental.close()
        reference.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.tools.incremental", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", default=server_url(), help=f"the server's gRPC address (default: $QKV_URL, else {DEFAULT_URL})"
    )
    parser.add_argument("--words", type=Path, default=Path("export/data/split/test.txt"), help="one word a line")
    parser.add_argument("--vocabularies", type=Path, default=DEFAULT_VOCABULARIES, help="the wrapped g2p version")
    parser.add_argument("--concurrency", type=int, default=8, help="words decoded at once")
    args = parser.parse_args(argv)
    words = [w for w in args.words.read_text().split("\n") if w.strip()]
    result = compare_with_g2p(args.url, words, args.concurrency, vocabularies=args.vocabularies)
    otherwise = f"{result.read_otherwise} read otherwise by g2p's text rules"
    print(f"incremental g2p_decoder vs one-shot g2p: {result} ({otherwise})")
    for word, expected, got in result.differing[:20]:
        print(f"  {word}: one-shot {expected!r}, incremental {got!r}")
    return 0 if result.equal == result.words else 1


if __name__ == "__main__":
    sys.exit(main())
