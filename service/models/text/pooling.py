"""From the graph's outputs to answers, in numpy: pooling, normalization, Matryoshka dimensions, chunks
pooled back into one embedding, and classifier scores.

Shapes: B rows, S tokens, D the hidden size, C classes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["activate", "l2_normalized", "pool", "pool_windows", "truncated_dimensions"]


def pool(tokens: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """(B, S, D) token embeddings, (B, S) attention mask -> (B, D): the mean of the real tokens, the first
    token (CLS), the last real one, or the maximum over the real ones."""
    out: np.ndarray
    m = mask.astype(np.float32)[:, :, None]  # (B, S, 1)
    if mode == "cls":
        out = tokens[:, 0]
    elif mode == "mean":
        summed = np.einsum("bsd,bs->bd", tokens, mask.astype(tokens.dtype))  # (B, D)
        out = summed / np.maximum(m.sum(axis=1), 1e-9)
    elif mode == "last":
        last = np.maximum(mask.sum(axis=1).astype(np.int64) - 1, 0)  # (B,)
        out = tokens[np.arange(len(tokens)), last]
    else:  # max
        out = np.where(m > 0, tokens, -np.inf).max(axis=1)
    return np.ascontiguousarray(out, dtype=np.float32)


def l2_normalized(x: np.ndarray) -> np.ndarray:
    """Each row scaled to unit length (a zero row stays zero), as torch.nn.functional.normalize."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    out: np.ndarray = (x / np.maximum(norms, 1e-12)).astype(np.float32)
    return out


def truncated_dimensions(x: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dimensions` of each embedding, renormalized when the model normalizes."""
    cut: np.ndarray = np.ascontiguousarray(x[:, :dimensions])
    return l2_normalized(cut) if normalize else cut


def pool_windows(windows: np.ndarray, tokens: np.ndarray, normalize: bool) -> np.ndarray:
    """(W, D) embeddings of one text's windows, (W,) tokens each -> (D,): their mean weighted by tokens,
    renormalized when the model normalizes."""
    weights = tokens.astype(np.float32) / max(1, int(tokens.sum()))
    mean: np.ndarray = (windows * weights[:, None]).sum(axis=0, keepdims=True).astype(np.float32)
    pooled: np.ndarray = (l2_normalized(mean) if normalize else mean)[0]
    return pooled


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """(B, C) logits -> scores: softmax over the classes, a sigmoid each (multi-label, or a cross-encoder's
    one score), or the logits themselves (regression)."""
    x: np.ndarray = logits.astype(np.float32)
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        x = e / e.sum(axis=-1, keepdims=True)
    elif activation == "sigmoid":
        x = 1.0 / (1.0 + np.exp(-x))
    return x.astype(np.float32)
