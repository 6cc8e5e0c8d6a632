"""Who sent a request, when the server keeps each bearer token's state apart (--isolate-tokens).

A front end names the caller by its token's place in --auth-token-file ("token 3"), never by the token, and
hands the name to what keeps state for it: the shared memory regions it registers, and the sequences it
starts, are its own, and another token's name finds none of them. `share` is the part of each such bound
(live sequences and their state, shared memory regions and their bytes) one caller may hold, so that one
client cannot keep the others out. Without --isolate-tokens there is no caller (None): everything is
everyone's, as in Triton.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["CALLER", "Caller", "share_of"]


@dataclass(frozen=True)
class Caller:
    name: str  # "token 3": the token's line in the token file (never the token itself)
    share: float = 1.0  # of each bound, at most (--token-share)


# The caller of the request a task serves: set by the data plane around a request's model call, read by the
# models that keep state across requests (a sequence is bound to the caller that started it).
CALLER: ContextVar[Caller | None] = ContextVar("qkv_caller", default=None)


def share_of(bound: int, caller: Caller | None) -> int:
    """What of `bound` one caller may hold: all of it without isolation, at least 1 with."""
    if caller is None or caller.share >= 1:
        return bound
    return max(1, int(bound * caller.share))
