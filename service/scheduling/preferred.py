"""Triton's `dynamic_batching.preferred_batch_size`: a batch that holds more rows than a preferred size is cut
to the largest preferred size it can fill, the rest left queued for the next; one smaller than every
preferred size goes as it is (its queue delay has passed, or nothing more is queued). Wraps the choice of
the next batch (`select_batch`'s signature), so it composes with the priority levels' chooser."""

from __future__ import annotations

from collections.abc import Sequence

from service.scheduling.admission import WorkItem
from service.scheduling.priorities import Select

__all__ = ["PreferredSizes"]


class PreferredSizes:
    def __init__(self, sizes: Sequence[int], select: Select) -> None:
        self.sizes, self.select = sorted(set(sizes)), select

    def __call__(
        self,
        queue: Sequence[WorkItem],
        max_rows: int,
        token_budget: int,
        length_aware: bool = True,
        max_padding: float = 1.0,
    ) -> list[int]:
        picked = self.select(queue, max_rows, token_budget, length_aware, max_padding)
        rows = sum(queue[i].rows for i in picked)
        fitting = [size for size in self.sizes if size <= rows]
        if not fitting:
            return picked
        kept: list[int] = []
        total = 0
        for i in picked:  # the oldest first (indices are in arrival order); the anchor always goes
            if kept and total + queue[i].rows > fitting[-1]:
                continue
            kept.append(i)
            total += queue[i].rows
        return kept
