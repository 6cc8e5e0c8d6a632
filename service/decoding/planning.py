"""What one decoding step runs: a pure function of the running sequences, unit-tested without a model.

Every sequence past its prompt decodes one token a step. What is left of the step's token budget goes to
prompts (prefill), first come first served, a long prompt in chunks: so a 2,000-token prompt arriving
among running streams costs each of their steps at most a budget's worth of prefill, not the whole
prompt at once. A step with no room left still gives the oldest prompt `MIN_CHUNK` tokens, so prefill
always moves on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MIN_CHUNK", "PREFILL_SHARE", "Plan", "plan_step", "step_budget"]

MIN_CHUNK = 16  # prompt tokens a step gives the oldest waiting prompt, however many sequences decode
# While sequences decode, a step's prefill may cost this much of a decoding step's time: a step with a
# chunk of prompt then takes about (1 + PREFILL_SHARE) x a step without (more while the measured cost of a
# prompt token catches up as the prompt's cache grows), so the running streams' gaps between tokens stay
# within some twice their usual.
PREFILL_SHARE = 0.5


@dataclass(frozen=True)
class Plan:
    decode: tuple[int, ...]  # the sequences (indices into the running list) that decode one token
    prefill: tuple[tuple[int, int], ...]  # (sequence, prompt tokens it runs this step)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


def plan_step(remaining: Sequence[int], budget: int, chunked: bool = True) -> Plan:
    """The step for running sequences whose prompts have `remaining` tokens still to run (0: decoding), in
    arrival order. `chunked` False (an encoder-decoder: the encoder reads a prompt whole): a prompt is
    taken whole or waits, the oldest always taken."""
    decode = tuple(i for i, r in enumerate(remaining) if r == 0)
    room = budget - len(decode)
    prefill: list[tuple[int, int]] = []
    for i, r in enumerate(remaining):
        if r == 0:
            continue
        if not prefill:
            take = r if not chunked else min(r, max(room, MIN_CHUNK))
        elif chunked:
            take = min(r, room)
        else:
            take = r if r <= room else 0
        if take <= 0:
            if chunked:
                break
            continue  # a prompt read whole: a shorter one behind it may still fit
        prefill.append((i, take))
        room -= take
    return Plan(decode, tuple(prefill))


def step_budget(decoding: int, most: int, decode_seconds: float, token_seconds: float) -> int:
    """A step's token budget: `most` (batching.token_budget) when nothing decodes; else the decoding rows and
    the prompt tokens whose measured cost (`token_seconds` each) fits PREFILL_SHARE of a decoding step's
    (`decode_seconds`), at least MIN_CHUNK, at most `most`. Before anything is measured: `most`."""
    if decoding == 0 or decode_seconds <= 0 or token_seconds <= 0:
        return most
    prefill = int(PREFILL_SHARE * decode_seconds / token_seconds)
    return decoding + min(max(prefill, MIN_CHUNK), max(most - decoding, MIN_CHUNK))
