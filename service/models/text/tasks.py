"""The text endpoints' tasks in the text kind's tensors: the request an ask is, and the answer its outputs say.

texts          -> TEXT (BYTES [N])                     embed, classify
token ids      -> INPUT_IDS (INT64 [N, L], -1 pads)    embed
query + texts  -> QUERY (BYTES [1]) + TEXT             rerank
answer         <- EMBEDDING or SCORES, and TOKENS and TRUNCATED when the ask counts them
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from service.errors import InvalidArgument
from service.models.catalog import TextAnswer, TextAsk

__all__ = ["task_answer", "task_io"]

RESULTS = {"embed": "EMBEDDING", "classify": "SCORES", "rerank": "SCORES"}
COUNTS = ("TOKENS", "TRUNCATED")
_NONE = np.zeros(0, dtype=np.int64)


def task_io(ask: TextAsk, task: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """The inputs of a request of `task` that asks `ask`, and the outputs it asks for."""
    inputs = {} if ask.query is None else {"QUERY": _encoded([ask.query])}
    if ask.token_ids:
        inputs["INPUT_IDS"] = _padded(ask.token_ids)
    else:
        inputs["TEXT"] = _encoded(ask.texts)
    return inputs, [RESULTS[task], *COUNTS] if ask.counts else [RESULTS[task]]


def task_answer(outputs: Mapping[str, np.ndarray], task: str, labels: tuple[str, ...]) -> TextAnswer:
    """What a request of `task_io` got: its embeddings or scores, and the counts when it asked for them."""
    tokens, truncated = (outputs.get(name, _NONE) for name in COUNTS)
    return TextAnswer(outputs[RESULTS[task]], tokens, truncated, labels if task == "classify" else ())


def _padded(rows: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Token ids as INPUT_IDS [N, L], -1 padding."""
    ids = np.full((len(rows), max(map(len, rows))), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids


def _encoded(texts: Iterable[str]) -> np.ndarray:
    """Texts as a BYTES tensor's elements."""
    try:
        return np.array([t.encode() for t in texts], dtype=np.object_)
    except UnicodeEncodeError:
        raise InvalidArgument("a text holds a lone surrogate: not UTF-8") from None
