"""Triton's request priorities and queue policies for a dynamically batched model.

A model's `dynamic_batching` may give `priority_levels` (1 is the highest) with a `default_priority_level`,
and queue policies (`default_queue_policy`, per level `priority_queue_policy`): a bound on what each level
queues (`max_queue_size`), how long a request may wait (`default_timeout_microseconds`, which a request's
`timeout` parameter may shorten when `allow_timeout_override`), and what then becomes of it
(`timeout_action`: REJECT fails it, DELAY lets it wait behind every other request).

A request's `priority` parameter (0: the model's default) sets its level. Batches are taken from the
highest level with requests queued, in arrival order within it, except that after `share` - 1 batches in a
row that passed over a lower level's requests the next batch is the oldest lower request's level: the
lower levels keep at least one batch in `share`, and none starves. Choosing is a pure function of the
queue, the time and what came before (`PriorityChooser`), unit-tested with an injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.errors import InvalidArgument, ResourceExhausted
from service.scheduling.admission import WorkItem

__all__ = ["DEFAULT_SHARE", "Priorities", "PriorityChooser", "QueuePolicy", "Select"]

DEFAULT_SHARE = 8  # the lower levels get at least one batch in this many while they have requests queued
TIMEOUT_ACTIONS = ("REJECT", "DELAY")

# select_batch's signature: (queue, max_rows, token_budget, length_aware, max_padding) -> indices
Select = Callable[[Sequence[WorkItem], int, int, bool, float], list[int]]


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ModelQueuePolicy: 0 is "no bound" for max_queue_size and "no timeout" for the timeout."""

    timeout_action: str = "REJECT"
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclass(frozen=True)
class Priorities:
    """A model's priority levels (0: none, one level) and queue policies."""

    levels: int = 0
    default_level: int = 0
    default_policy: QueuePolicy = field(default_factory=QueuePolicy)
    policies: Mapping[int, QueuePolicy] = field(default_factory=dict)  # by level
    share: int = DEFAULT_SHARE

    def policy(self, level: int) -> QueuePolicy:
        return self.policies.get(level, self.default_policy)

    def level_of(self, params: Mapping[str, Any]) -> int:
        """The level of a request with `params` (its `priority`; 0 or none: the default level)."""
        raw = params.get("priority", 0)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
            raise InvalidArgument(f"parameters: 'priority' must be an integer >= 0, got {raw!r}")
        if raw == 0:
            return self.default_level
        if raw > max(self.levels, 1):
            raise InvalidArgument(
                f"parameters: 'priority' {raw} is outside the model's priority levels 1 (highest) to "
                f"{max(self.levels, 1)} (0: its default level)"
            )
        return raw

    def admit(self, item: WorkItem, params: Mapping[str, Any], queue: Sequence[WorkItem]) -> None:
        """Set `item`'s level and its queue timeout from the policy; ResourceExhausted when its level has
        max_queue_size requests queued already."""
        item.level = self.level_of(params)
        policy = self.policy(item.level)
        if policy.max_queue_size and sum(1 for x in queue if x.level == item.level) >= policy.max_queue_size:
            raise ResourceExhausted(
                f"Exceeds maximum queue size: priority level {item.level} holds {policy.max_queue_size} "
                "requests, its queue policy's max_queue_size"
            )
        timeout_us = policy.default_timeout_us
        asked = params.get("timeout")
        if policy.allow_timeout_override and isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            timeout_us = min(timeout_us, asked) if timeout_us else asked  # it may shorten the default, not lengthen
        if not timeout_us:
            return
        at = item.arrived + timeout_us / 1e6
        if policy.timeout_action == "DELAY":
            item.delay_at = at
        else:  # REJECT: a request still queued then fails DEADLINE_EXCEEDED
            item.deadline = at if item.deadline is None else min(item.deadline, at)


class PriorityChooser:
    """The next batch under priorities: the indices (into `queue`) `select` picks among the requests of one
    level. `clock` is injected for tests."""

    def __init__(self, priorities: Priorities, select: Select, clock: Callable[[], float] = time.monotonic) -> None:
        self.priorities, self.select, self.clock = priorities, select, clock
        self.passed_over = 0  # batches in a row that left a lower level's requests waiting

    def level(self, item: WorkItem, now: float) -> int:
        """A request's level now: past its DELAY timeout, below every level."""
        if item.delay_at is not None and now >= item.delay_at:
            return max(self.priorities.levels, 1) + 1
        return item.level

    def __call__(
        self,
        queue: Sequence[WorkItem],
        max_rows: int,
        token_budget: int,
        length_aware: bool = True,
        max_padding: float = 1.0,
    ) -> list[int]:
        if not queue:
            return []
        now = self.clock()
        levels = [self.level(x, now) for x in queue]
        top = min(levels)
        lower = [i for i, level in enumerate(levels) if level > top]
        chosen = top
        if lower and self.passed_over >= self.priorities.share - 1:
            chosen, self.passed_over = levels[lower[0]], 0  # the oldest request below the top level
        else:
            self.passed_over = self.passed_over + 1 if lower else 0
        members = [i for i, level in enumerate(levels) if level == chosen]
        picked = self.select([queue[i] for i in members], max_rows, token_budget, length_aware, max_padding)
        return sorted(members[j] for j in picked)


def parse_priorities(d: Mapping[str, Any]) -> Priorities | None:
    """Triton's dynamic_batching (its JSON form) -> Priorities; None when it gives no priorities or queue
    policy. ValueError naming the field when a value is out of range."""
    keys = ("priority_levels", "default_priority_level", "default_queue_policy", "priority_queue_policy")
    if not any(k in d for k in keys):
        return None
    levels = int(d.get("priority_levels", 0))
    default = int(d.get("default_priority_level", 0))
    if levels and not 1 <= default <= levels:
        raise ValueError(
            f"dynamic_batching.default_priority_level must be within 1..priority_levels ({levels}), got {default}"
        )
    if not levels and default:
        raise ValueError("dynamic_batching.default_priority_level needs priority_levels")
    policies = {}
    for key, raw in d.get("priority_queue_policy", {}).items():
        level = int(key)
        if not 1 <= level <= levels:
            raise ValueError(f"dynamic_batching.priority_queue_policy: level {level} is outside 1..{levels}")
        policies[level] = _policy(raw, f"dynamic_batching.priority_queue_policy[{level}]")
    return Priorities(
        levels=levels,
        default_level=default,
        default_policy=_policy(d.get("default_queue_policy", {}), "dynamic_batching.default_queue_policy"),
        policies=policies,
    )


def _policy(raw: Mapping[str, Any], at: str) -> QueuePolicy:
    action = raw.get("timeout_action", "REJECT")
    if action not in TIMEOUT_ACTIONS:
        raise ValueError(f"{at}.timeout_action must be REJECT or DELAY, got {action!r}")
    return QueuePolicy(
        timeout_action=action,
        default_timeout_us=int(raw.get("default_timeout_microseconds", 0)),
        allow_timeout_override=bool(raw.get("allow_timeout_override", False)),
        max_queue_size=int(raw.get("max_queue_size", 0)),
    )
