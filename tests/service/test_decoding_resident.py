"""The engine's resident caches (service/decoding/resident.py): rows joining and leaving keep every row's own
cache where its mask says it is, and the buffers shed positions no row uses any more."""

from __future__ import annotations

import random

import numpy as np

from service.decoding.choosing import Chooser
from service.decoding.engine import Sequence
from service.decoding.request import GenerationRequest
from service.decoding.resident import ResidentCaches
from service.decoding.steps import CacheLayout
from service.decoding.words import Outcome

H, D, ROOM = 2, 3, 4
LAYOUT = CacheLayout(("k", "v", "ck", "cv"), (), H, D, (True, True, False, False))


def row(ident: int, prompt: int, cached: int) -> Sequence:
    """A sequence whose every cache value is its `ident`: `cached` positions of its own, `prompt` of cross."""
    s = Sequence(GenerationRequest(tuple(range(1, prompt + 1)), 8), Chooser(False, 1.0, 0, 1.0, 1.0, None), None,
                 Outcome(), tag=ident)  # fmt: skip
    s.cache = [np.full((H, cached if own else prompt, D), ident, dtype=np.float32) for own in LAYOUT.self_attention]
    return s


def test_rows_joining_and_leaving_keep_their_own_caches() -> None:
    rng = random.Random(0)
    caches = ResidentCaches(LAYOUT, np.float32, ROOM)
    live: list[Sequence] = []
    made = 0
    for _ in range(300):
        live = [s for s in live if rng.random() > 0.15]  # some leave
        for _ in range(rng.randint(0, 3)):  # some join, most with no cache yet, some with one
            made += 1
            live.append(row(made, rng.randint(1, 9), rng.choice([0, 0, 0, rng.randint(1, 6)])))
        if not live:
            continue
        caches.hold(live)
        mask, self_mask, past = caches.past()
        n, t = len(caches), caches.t
        assert {id(s) for s in caches.rows} == {id(s) for s in live}
        for r, (s, length) in enumerate(zip(caches.rows, caches.lengths, strict=True)):
            ident = s.tag
            assert (self_mask[r, : t - length] == 0).all() and (self_mask[r, t - length :] == 1).all()
            assert (mask[r, : len(s.prompt)] == 1).all() and (mask[r, len(s.prompt) :] == 0).all()
            for a, own in zip(past, LAYOUT.self_attention, strict=True):
                held = a[r, :, t - length :] if own else a[r, :, : len(s.prompt)]
                assert (held == ident).all(), f"row {ident} holds another's cache"
        assert t <= max(caches.lengths) + ROOM, "positions no row uses were kept"
        for a, own in zip(past, LAYOUT.self_attention, strict=True):  # the step writes position T, in place
            if own:
                a.base[:n, :, t] = np.array([s.tag for s in caches.rows], dtype=np.float32)[:, None, None]
        caches.stepped()


def test_a_joiner_with_a_longer_cache_moves_the_held_rows_right() -> None:
    caches = ResidentCaches(LAYOUT, np.float32, ROOM)
    first = row(1, 3, 2)
    caches.hold([first])
    second = row(2, 5, 6)
    caches.hold([first, second])
    mask, self_mask, past = caches.past()
    assert caches.t == 6 and caches.lengths == [2, 6]
    assert self_mask[0].tolist() == [0, 0, 0, 0, 1, 1, 1] and self_mask[1].tolist() == [1] * 7
    assert (past[0][0, :, 4:] == 1).all() and (past[0][1] == 2).all()
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
