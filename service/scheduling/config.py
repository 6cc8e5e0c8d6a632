"""How one model's requests are gathered into batches: config.json's "batching" section, with its
defaults. The repository parses it (service/repository/layout.py); the schedulers read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PADDING", "BatchingConfig"]

# Tensor models with a sequence axis: whether requests of different lengths may be padded into one batch.
PADDING = ("check", "safe", "unsafe")


@dataclass(frozen=True)
class BatchingConfig:
    """How requests of one model are gathered into batches (config.json "batching")."""

    enabled: bool = True
    max_batch_size: int = 64  # rows per batch (words, for g2p)
    max_queue_delay_ms: float = 2.0  # how long a partial batch may wait for company
    token_budget: int = 8192  # rows x padded length of one batch
    length_aware: bool = True  # group requests of similar length (False: plain FIFO, pad to longest)
    max_padding: float = 0.1  # length-aware: the padded share a batch may reach
    padding: str = "check"  # PADDING: checked at load, trusted ("safe"), or never ("unsafe": equal lengths only)
    max_queue_requests: int = 1024  # beyond this, RESOURCE_EXHAUSTED at once
    max_queue_tokens: int = 32768  # queued tokens beyond which new work is refused
    max_queue_wait_ms: float = 1000.0  # refuse work whose predicted wait (queued tokens / measured rate) is longer
    inline_max_tokens: int = 32  # a request this small on an idle server skips the hand-off to an instance thread
    continuous: bool = True  # g2p: words join a running decode at the next step
    min_join_rows: int = 8  # g2p: words that join together (fewer once max_queue_delay_ms has passed)
