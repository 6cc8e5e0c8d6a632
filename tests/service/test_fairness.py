"""Fair decoding: greedy and beam work share an instance's decoding steps by cost, so neither waits
behind the other without bound, and admission predicts each class's wait from its fair share.

The choice of the next step (`FairShare`) and the admission arithmetic are checked as pure
functions; the scheduler's interleaving on the shipped g2p graphs, by the steps it ran; and a real
server under a flood of beam requests, by a greedy probe that is always answered, and soon.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from service import protocol
from service.decoding.engine import Engine
from service.decoding.words import greedy_decode, word_engine
from service.errors import ResourceExhausted
from service.scheduling import continuous as scheduler
from service.scheduling.admission import Admission, WorkItem
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.scheduling.fair_share import BEAM, GREEDY, FairShare
from service.seq2seq.generation import BeamSearch, beam_search
from service.seq2seq.graphs import OnnxSeq2Seq, session_options
from service.seq2seq.vocab import Vocabulary
from service.tools.client import g2p_request
from tests.conftest import MODELS, start_server, stop_server
from tests.figures import FIGURES as ALL_FIGURES
from tests.service.queue_helpers import FLOOD_QUEUE_WAIT_MS, beam_beside_greedy_flood, until

FIGURES = ALL_FIGURES.setdefault("fair decoding", {})  # printed in the run's summary

# -- FairShare: the choice of the next step -------------------------------------------------------


def serve(
    share: FairShare,
    steps: int,
    greedy_cost: Callable[[], int],
    beam_cost: Callable[[], int],
    greedy: Callable[[int], bool] | None = None,
    beam: Callable[[int], bool] | None = None,
) -> list[tuple[str, int]]:
    """Run `steps` choices; `greedy` / `beam` (step -> bool) say when each class has work (always by
    default). Returns the steps served: (class, cost)."""
    served: list[tuple[str, int]] = []
    for i in range(steps):
        work = share.choose(greedy(i) if greedy else True, beam(i) if beam else True)
        if work is None:
            continue
        cost = greedy_cost() if work == GREEDY else beam_cost()
        share.charge(work, cost)
        served.append((work, cost))
    return served


def longest_wait(served: list[tuple[str, int]], waiting: str) -> int:
    """The most cost the other class was served between two steps of `waiting` (from its first)."""
    first = next(i for i, (w, _) in enumerate(served) if w == waiting)
    worst = run = 0
    for work, cost in served[first:]:
        run = 0 if work == waiting else run + cost
        worst = max(worst, run)
    return worst


@pytest.mark.parametrize("seed", range(5))
def test_with_both_classes_waiting_each_gets_its_share_of_the_cost_and_waits_at_most_one_step_of_each(
    seed: int,
) -> None:
    rng = random.Random(seed)
    max_greedy, max_beam = 64, 512  # a full greedy batch; 64 words x 8 beams
    served = serve(FairShare(), 5000, lambda: rng.randint(1, max_greedy), lambda: rng.choice([2, 8, 64, 512]))
    total = {w: sum(c for x, c in served if x == w) for w in (GREEDY, BEAM)}
    assert abs(total[GREEDY] - total[BEAM]) <= max(max_greedy, max_beam)
    # Between two of its steps, a class waits for at most one step of its own class's cost plus one of the other's.
    assert longest_wait(served, GREEDY) <= max_greedy + max_beam
    assert longest_wait(served, BEAM) <= max_greedy + max_beam


def test_a_cheap_greedy_step_goes_between_every_two_beam_steps_however_large_they_are() -> None:
    served = serve(FairShare(), 2000, lambda: 1, lambda: 512)
    assert longest_wait(served, GREEDY) == 512  # one beam step, never two in a row
    assert [w for w, _ in served[:4]] == [GREEDY, BEAM, GREEDY, GREEDY]  # a tie goes to greedy
    # and a full beam step buys greedy as many rows before beam goes again
    assert served.count((GREEDY, 1)) == pytest.approx(served.count((BEAM, 512)) * 512, abs=512)


def alone_until(alone: str, step: int) -> tuple[Callable[[int], bool], Callable[[int], bool]]:
    """When each class has work: `alone` only, until `step`; then both."""
    return (lambda i: alone == GREEDY or i >= step), (lambda i: alone == BEAM or i >= step)


def test_a_class_that_had_no_work_banks_no_credit() -> None:
    """Hours of beam work alone do not entitle greedy work, when it comes, to hours alone; nor the reverse."""
    for alone in (BEAM, GREEDY):
        greedy, beam = alone_until(alone, 900)
        served = serve(FairShare(), 1000, lambda: 64, lambda: 64, greedy, beam)
        assert {w for w, _ in served[:900]} == {alone}
        after = [w for w, _ in served[900:]]
        assert after[:4] == [GREEDY, BEAM, GREEDY, BEAM]
        assert after.count(GREEDY) == after.count(BEAM) == 50


def test_with_no_work_there_is_nothing_to_step() -> None:
    share = FairShare()
    assert share.choose(False, False) is None
    assert share.choose(True, False) == GREEDY and share.choose(False, True) == BEAM


# -- Admission: each class's wait is its fair share ------------------------------------------------


def two_classes(**config: Any) -> Admission:
    admission = Admission("g2p", BatchingConfig(**config), 1, kinds=(GREEDY, BEAM))
    admission.tokens_per_second = 1000.0
    return admission


def test_a_beam_backlog_predicts_a_greedy_word_only_its_fair_share_of_waiting() -> None:
    admission = two_classes(max_queue_wait_ms=1000)
    for _ in range(3):
        admission.admit(300, None, BEAM)  # 0.9 s of beam work queued
    assert admission.predicted_wait_ms(10, GREEDY) == 20  # its 10 tokens, and as many of beam work meanwhile
    assert admission.predicted_wait_ms(300, BEAM) == 1200  # behind every queued beam token
    admission.check(10, time.monotonic() + 0.5, GREEDY)  # a 0.5 s deadline is kept
    with pytest.raises(Exception, match="exceeds the request's deadline"):
        admission.check(300, time.monotonic() + 0.5, BEAM)
    admission.admit(300, None, BEAM)  # 1.2 s of beam work: beams are refused, greedy words are not
    with pytest.raises(ResourceExhausted, match="predicted queueing 1200 ms"):
        admission.check(300, None, BEAM)
    admission.check(10, None, GREEDY)
    admission.check(0, None)  # the server's check before decoding refuses only what every class would refuse
    for _ in range(4):
        admission.release(300, BEAM)
    assert admission.queued_tokens == 0 and admission.by_kind[BEAM].tokens == 0


def test_one_class_cannot_fill_the_queue_bounds_against_the_other() -> None:
    admission = two_classes(max_queue_tokens=1000, max_queue_wait_ms=1e9)
    admission.admit(600, None, BEAM)
    admission.admit(400, None, BEAM)  # the token bound is full, by beam work
    with pytest.raises(ResourceExhausted, match="1000 tokens"):
        admission.check(1, None, BEAM)
    admission.admit(500, None, GREEDY)  # greedy work still has its half
    with pytest.raises(ResourceExhausted):
        admission.check(1, None, GREEDY)
    admission = two_classes(max_queue_requests=4, max_queue_wait_ms=1e9)
    for _ in range(4):
        admission.admit(1, None, BEAM)  # the request bound is full, by beam work
    with pytest.raises(ResourceExhausted, match="4 requests"):
        admission.check(1, None, BEAM)
    admission.admit(1, None, GREEDY)  # greedy work still has its half
    admission.admit(1, None, GREEDY)
    with pytest.raises(ResourceExhausted, match="6 requests"):
        admission.check(1, None, GREEDY)


def test_a_single_class_queue_predicts_and_refuses_as_one_queue() -> None:
    admission = Admission("m", BatchingConfig(max_queue_tokens=100), 1)
    admission.tokens_per_second = 100.0
    admission.admit(60, None)
    assert admission.predicted_wait_ms(40) == 1000
    with pytest.raises(ResourceExhausted):
        admission.check(41, None)


# -- The scheduler interleaves the two classes' steps on the shipped g2p graphs ---------------------


@pytest.fixture(scope="module")
def g2p_graphs() -> tuple[OnnxSeq2Seq, Vocabulary]:
    version = MODELS / "g2p" / "1"
    return OnnxSeq2Seq(version, session_options(1)), Vocabulary.load(version / "graphemes.json")


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every decoding step the scheduler runs, in order: (class, rows)."""
    log: list[tuple[str, int]] = []

    def logged_engine(*args: Any, **kwargs: Any) -> Engine:
        engine = word_engine(*args, **kwargs)
        step = engine.step

        def logged() -> Any:
            log.append((GREEDY, len(engine.running)))
            return step()

        engine.step = logged  # type: ignore[method-assign]
        return engine

    class Beams(BeamSearch):
        def step(self) -> Any:
            log.append((BEAM, len(self)))
            return super().step()

    monkeypatch.setattr(scheduler, "word_engine", logged_engine)
    monkeypatch.setattr(scheduler, "BeamSearch", Beams)
    return log


LONG = ["internationalization", "counterrevolutionaries", "electroencephalograph", "unconstitutionally"] * 4


def test_a_greedy_word_waits_for_at_most_two_beam_steps_while_beam_searches_run(
    g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary], steps: list[tuple[str, int]]
) -> None:
    model, graphemes = g2p_graphs
    beam_alone = [h.output for h in beam_search(model, [graphemes.encode(w) for w in LONG], 8, 40)]
    (cat_alone,) = greedy_decode(model, [graphemes.encode("cat")], 40)

    async def run() -> tuple[list[list[int]], list[int], int]:
        s = GenerationScheduler("g2p", BatchingConfig(), [model])
        s.start()
        loop = asyncio.get_running_loop()

        async def convert(words: list[str], k: int) -> list[list[int]]:
            sources = [graphemes.encode(w) for w in words]
            item = WorkItem(
                len(sources) * k, max(map(len, sources)) + 1, WordsRequest(sources, 40, k), loop.create_future()
            )
            return [h.output for h in await s.submit(item)]

        first: list[list[list[int]]] = []
        stop = asyncio.Event()

        async def beam_client() -> None:  # beam work is always there: a search runs, another waits
            while not stop.is_set():
                first.append(await convert(LONG, 8))

        flood = [asyncio.create_task(beam_client()) for _ in range(2)]  # 128 rows each
        await until(lambda: len(steps) >= 2, "the first beam search steps")
        mark = len(steps)
        try:
            (cat,) = await asyncio.wait_for(convert(["cat"], 1), 120)  # bounds only a word that is never served
        finally:
            stop.set()
            await asyncio.gather(*flood)
            await s.close()
        return first[0], cat, mark

    served, cat, mark = asyncio.run(run())
    assert served == beam_alone and cat == cat_alone.output  # interleaving changes no one's answer
    greedy = [i for i, (w, _) in enumerate(steps) if w == GREEDY]
    assert len(greedy) == len(cat_alone.tokens) - 1 and greedy[0] >= mark
    waited = [w for w, _ in steps[mark : greedy[-1]]].count(BEAM)
    assert waited <= 2, f"the word waited for {waited} beam steps: {steps[mark:]}"


def test_a_beam_request_steps_between_every_few_greedy_steps_under_a_greedy_flood(
    g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary], steps: list[tuple[str, int]]
) -> None:
    model, graphemes = g2p_graphs
    (expected,) = beam_search(model, [graphemes.encode("pronunciation")], 4, 40)
    config = BatchingConfig(max_batch_size=16, max_queue_wait_ms=FLOOD_QUEUE_WAIT_MS)
    scheduler = GenerationScheduler("g2p", config, [model])
    run = beam_beside_greedy_flood(scheduler, graphemes, lambda: len(steps), beam_rows=4)
    beam, mark = asyncio.run(run)
    assert beam == expected.output
    ours = [i for i, (w, _) in enumerate(steps) if w == BEAM]
    assert ours and ours[0] >= mark
    # From its arrival, and between two of its steps: at most a full greedy batch and a beam step of greedy cost.
    for before, after in zip([mark, *ours], ours, strict=False):
        cost = sum(rows for w, rows in steps[before:after] if w == GREEDY)
        assert cost <= config.max_batch_size * 2 + 4, f"the beam search waited for {cost} greedy rows: {steps[mark:]}"


# -- On a real server: a greedy probe through a flood of beam requests ------------------------------

COMMON = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two"
)
WORDS = COMMON.split()  # 64 words


def test_one_greedy_word_is_answered_soon_while_four_clients_loop_beam_8_x_64_words(tmp_path: Path) -> None:
    """The issue's attack: before, the probe waited until the flood stopped. Asserted: every probe is
    answered while the flood goes on (none refused, beam requests answered meanwhile); the probe's
    latency beside the beam requests' is reported as a figure."""
    assert len(WORDS) == 64
    server = start_server([], tmp_path / "server.log")
    stop = threading.Event()
    beam_times: list[tuple[float, float]] = []  # (answered at, seconds)
    beam_refused: list[str] = []

    def beam_client() -> None:
        with grpc.insecure_channel(server.url) as channel:
            stub, request = protocol.Stub(channel), g2p_request(WORDS, beam_size=8, lexicon=False)
            while not stop.is_set():
                start = time.monotonic()
                try:
                    stub.ModelInfer(request, timeout=60)
                    beam_times.append((time.monotonic(), time.monotonic() - start))
                except grpc.RpcError as e:  # a refused beam request (its queue is full) tries again soon
                    beam_refused.append(e.code().name)
                    time.sleep(0.05)

    flood = [threading.Thread(target=beam_client, daemon=True) for _ in range(4)]
    probes: list[float] = []
    failed: list[str] = []
    try:
        for t in flood:
            t.start()
        deadline = time.monotonic() + 60
        while len(beam_times) < 4:  # the flood is on: each instance has answered beam requests
            assert time.monotonic() < deadline, f"no beam request answered: {beam_refused}"
            time.sleep(0.05)
        with grpc.insecure_channel(server.url) as channel:
            stub, request = protocol.Stub(channel), g2p_request(["probe"], lexicon=False)
            started = time.monotonic()
            while time.monotonic() - started < (6 if len(probes) + len(failed) >= 20 else 60):  # 20 at least
                t0 = time.monotonic()
                try:
                    stub.ModelInfer(request, timeout=300)  # bounds only a probe that is never answered
                    probes.append(time.monotonic() - t0)
                except grpc.RpcError as e:
                    failed.append(f"{e.code().name}: {e.details()}")
                time.sleep(0.05)
            window = (started, time.monotonic())
    finally:
        stop.set()
        for t in flood:
            t.join(timeout=120)
        stop_server(server)

    assert not failed, f"probes failed: {failed[:3]}"
    during = [s for at, s in beam_times if window[0] <= at <= window[1]]
    assert during, "no beam request was answered while the probe ran"
    probes.sort()
    p50, p99 = (probes[min(len(probes) - 1, int(q * len(probes)))] for q in (0.5, 0.99))
    beam_median = statistics.median(during)
    FIGURES["one-word greedy probe p50 / p99, 4 clients looping beam 8 x 64 words"] = (
        f"{p50 * 1e3:.0f} / {p99 * 1e3:.0f} ms ({len(probes)} probes, none refused)"
    )
    FIGURES["beam throughput meanwhile"] = (
        f"{len(during) * 64 / (window[1] - window[0]):.0f} words/s, request median {beam_median * 1e3:.0f} ms"
        + (f", {len(beam_refused)} refused ({', '.join(sorted(set(beam_refused)))})" if beam_refused else "")
    )
    # Latencies are figures, not assertions (they follow the machine's load): the step order that makes the
    # probe prompt is asserted, without clocks, by the scheduler tests above.
