"""The statistics extension summed over the workers: a worker answering ModelStatistics adds every other
worker's counts to its own.

The other workers are asked over the control channel (service/workers/channel.py), asynchronously: the asking
worker's event loop goes on serving while they answer, and two workers asking each other at once each answer
the other's question. Each answer is a snapshot of the counts, taken under their lock. A worker that does not
answer within PEER_TIMEOUT_S (restarting, stopped) is left out of the sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from service.models.common import ModelStats

__all__ = ["PEER_TIMEOUT_S", "Counts", "counts", "summed"]

PEER_TIMEOUT_S = 2.0
Counts = list[tuple[str, str, dict[str, Any]]]  # (model, version, ModelStats's fields) of each version


def _fields(stats: ModelStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if not f.name.startswith("_")}


def counts(versions: list[tuple[str, str, ModelStats]]) -> Counts:
    """What a worker sends of its own versions' counts: a snapshot of each."""
    return [(name, version, _fields(stats.snapshot())) for name, version, stats in versions]


@dataclass
class SummedVersion:
    """A served version as the statistics message reads it: its name, version, config and counts."""

    name: str
    version: str
    config: Any
    stats: ModelStats


def summed(local: list[Any], others: list[Counts]) -> list[SummedVersion]:
    """Each of this worker's versions (`local`, ServedVersion) with the others' counts added."""
    answer = []
    for model in local:
        total = model.stats.snapshot()
        for each in others:
            for name, version, fields in each:
                if (name, version) == (model.name, model.version):
                    _add(total, fields)
        answer.append(SummedVersion(model.name, model.version, model.config, total))
    return answer


def _add(total: ModelStats, fields: dict[str, Any]) -> None:
    for key, value in fields.items():
        if key == "batches":
            for size, (count, ns) in value.items():
                entry = total.batches.setdefault(size, [0, 0])
                entry[0] += count
                entry[1] += ns
        elif key == "last_inference_ms":
            total.last_inference_ms = max(total.last_inference_ms, value)
        else:
            setattr(total, key, getattr(total, key) + value)
