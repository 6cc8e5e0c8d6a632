"""The sequence batcher's promises, on the real scheduler with a numpy accumulator for a model and an
injected clock: requests of one sequence in order and one at a time, sequences batched together, the
controls of every row, the implicit state carried, and the bounds (live sequences, state bytes, idle time).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.callers import Caller
from service.errors import Internal, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from service.scheduling.sequence import SequenceBatcher, SequenceStep, initial_state, select_oldest
from service.scheduling.sequence_config import (
    Control,
    InitialState,
    SequenceConfig,
    SequenceConfigError,
    StateSpec,
    parse_sequence_batching,
)

CONTROLS = (
    Control("START", "START", "INT32", (0, 1)),
    Control("END", "END", "FP32", (0.0, 1.0)),
    Control("READY", "READY", "BOOL", (False, True)),
    Control("CORRID", "CORRID", "UINT64"),
)
STATE = StateSpec("STATE_IN", "STATE_OUT", "INT32", (1,))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleepers: list[float] = []  # when each task in `sleep` wakes, by this clock

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        """Until the test moves the clock `seconds` on (checked every millisecond of real time)."""
        wake = self.now + seconds
        self.sleepers.append(wake)
        try:
            while self.now < wake:
                await asyncio.sleep(0.001)
        finally:
            self.sleepers.remove(wake)


class Seen:
    """A SequenceObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.sequences_and_bytes: list[tuple[int, int]] = []
        self.expired = 0
        self.rows: list[int] = []  # of each batch

    def sequences(self, live: int, state_bytes: int) -> None:
        self.sequences_and_bytes.append((live, state_bytes))

    def sequences_expired(self, count: int) -> None:
        self.expired += count

    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None:
        self.rows.append(rows)


class Accumulator:
    """A stateful model in numpy: OUTPUT = STATE_IN + INPUT on ready rows, and STATE_OUT the same. Records
    each batch's rows as (correlation id, start, end, ready); the first batch holds until `gate` opens."""

    def __init__(self, hold_first: bool = False) -> None:
        self.gate = threading.Event()
        if not hold_first:
            self.gate.set()
        self.batches: list[list[tuple[int, int, float, bool]]] = []
        self.instances: list[int] = []

    def __call__(self, steps: list[SequenceStep], instance: int) -> list[Any]:
        first = not self.batches
        feeds = {k: np.concatenate([s.feeds[k] for s in steps]) for k in steps[0].feeds}
        columns = [feeds[k][:, 0].tolist() for k in ("CORRID", "START", "END", "READY")]
        self.batches.append([(int(c), int(a), float(e), bool(r)) for c, a, e, r in zip(*columns, strict=True)])
        self.instances.append(instance)
        if first:
            assert self.gate.wait(60), "the test never opened the gate"
        if (feeds["INPUT"] < -1000).any():
            raise ValueError("an input below -1000")
        total = feeds["STATE_IN"] + feeds["INPUT"] * feeds["READY"]
        return [{"OUTPUT": total[i : i + 1], "STATE_OUT": total[i : i + 1]} for i in range(len(steps))]


def batcher(
    model: Accumulator, clock: Clock | None = None, rows: int = 8, instances: int = 1, **config: Any
) -> SequenceBatcher:
    c = SequenceConfig(**{"strategy": "oldest", "controls": CONTROLS, "states": (STATE,), **config})
    return SequenceBatcher("acc", c, model, rows, instances, clock or Clock())


def step(
    sid: int | str, value: int, start: bool = False, end: bool = False, outputs: tuple[str, ...] = ()
) -> SequenceStep:
    inputs = {"INPUT": np.array([[value]], dtype=np.int32)}
    return SequenceStep(sid, start, end, inputs, asyncio.get_running_loop().create_future(), outputs)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(60_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never came")


async def send(b: SequenceBatcher, sid: int | str, values: list[int]) -> list[int]:
    """One sequence, request after request: its outputs."""
    out = []
    for i, v in enumerate(values):
        r = await b.submit(step(sid, v, start=i == 0, end=i == len(values) - 1))
        out.append(int(r["OUTPUT"][0, 0]))
    return out


def test_a_sequence_carries_its_state_in_order_and_is_freed_at_its_end() -> None:
    async def test() -> None:
        model = Accumulator()
        b = batcher(model)
        b.start()
        values = [0, 11, 7, 5, 3, 2, 0, 1]
        assert await send(b, 1000, values) == list(np.cumsum(values))
        rows = [batch[0] for batch in model.batches]
        assert rows[0] == (1000, 1, 0.0, True) and rows[-1] == (1000, 0, 1.0, True)
        assert all(r == (1000, 0, 0.0, True) for r in rows[1:-1])
        assert b.live == {} and b.state_bytes == 0 and b.queued == 0
        await b.close()

    run(test)


def test_many_sequences_share_one_batch_each_row_with_its_own_controls() -> None:
    async def test() -> None:
        model = Accumulator(hold_first=True)
        b = batcher(model, rows=8)
        b.start()
        first = asyncio.create_task(b.submit(step(7, 5, start=True)))
        await until(lambda: len(model.batches) == 1)  # the blocker computes
        later = asyncio.create_task(b.submit(step(7, 1)))
        news = [asyncio.create_task(b.submit(step(sid, sid, start=True, end=sid == 3))) for sid in (1, 2, 3, 4)]
        await until(lambda: b.queued == 5)
        model.gate.set()
        assert int((await first)["OUTPUT"][0, 0]) == 5
        assert int((await later)["OUTPUT"][0, 0]) == 6  # its state: the first request's
        assert [int((await t)["OUTPUT"][0, 0]) for t in news] == [1, 2, 3, 4]
        assert model.batches[1] == [
            (7, 0, 0.0, True), (1, 1, 0.0, True), (2, 1, 0.0, True), (3, 1, 1.0, True), (4, 1, 0.0, True)
        ]  # fmt: skip
        assert sorted(b.live) == [1, 2, 4, 7]  # 3 ended
        await b.close()

    run(test)


def test_one_request_of_a_sequence_in_flight_at_a_time_in_the_order_sent() -> None:
    async def test() -> None:
        model = Accumulator(hold_first=True)
        b = batcher(model, rows=8, instances=2)
        b.start()
        head = asyncio.create_task(b.submit(step(5, 1, start=True)))
        await until(lambda: len(model.batches) == 1)
        rest = [asyncio.create_task(b.submit(step(5, v, end=v == 4))) for v in (2, 3, 4)]
        other = asyncio.create_task(b.submit(step(9, 10, start=True, end=True)))
        await until(lambda: len(model.batches) == 2)  # the other instance takes sequence 9 alone
        assert model.batches[1] == [(9, 1, 1.0, True)] and b.queued == 3
        model.gate.set()
        assert [int((await t)["OUTPUT"][0, 0]) for t in [head, *rest]] == [1, 3, 6, 10]
        assert int((await other)["OUTPUT"][0, 0]) == 10
        mine = [[r for r in batch if r[0] == 5] for batch in model.batches]
        assert [len(rows) for rows in mine if rows] == [1, 1, 1, 1]  # four batches, one row of 5 in each
        await b.close()

    run(test)


def test_the_oldest_waiting_request_of_each_sequence_goes_first() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        heads = [SequenceStep(i, False, False, {}, loop.create_future(), order=o) for i, o in ((1, 5), (2, 1), (3, 3))]
        assert [s.sequence_id for s in select_oldest(heads, 2)] == [2, 3]

    run(test)


def test_direct_binds_each_sequence_to_a_slot_and_fills_idle_slots_as_not_ready() -> None:
    async def test() -> None:
        model = Accumulator()
        b = batcher(model, rows=4, strategy="direct")
        b.start()
        for sid in (1, 2, 3):
            await b.submit(step(sid, sid, start=True))
        assert [batch for batch in model.batches] == [
            [(1, 1, 0.0, True)],
            [(0, 0, 0.0, False), (2, 1, 0.0, True)],  # slot 0 held by sequence 1, with no request now
            [(0, 0, 0.0, False), (0, 0, 0.0, False), (3, 1, 0.0, True)],
        ]
        await b.submit(step(2, 1, end=True))  # frees slot 1
        assert int((await b.submit(step(4, 40, start=True)))["OUTPUT"][0, 0]) == 40
        assert model.batches[-1] == [(0, 0, 0.0, False), (4, 1, 0.0, True)]  # slot 1 again
        assert int((await b.submit(step(3, 1)))["OUTPUT"][0, 0]) == 4  # slot 2 kept its sequence
        for sid in (5,):
            await b.submit(step(sid, 0, start=True))
        with pytest.raises(ResourceExhausted, match="all 4 batch slots held"):
            await b.submit(step(6, 0, start=True))
        await b.close()

    run(test)


def test_an_idle_sequence_is_freed_and_its_next_request_refused_naming_it() -> None:
    async def test() -> None:
        clock = Clock()
        model = Accumulator()
        b = batcher(model, clock, max_sequence_idle_us=5_000_000)
        b.start()
        await b.submit(step(1000, 1, start=True))
        await b.submit(step(1001, 1, start=True))
        clock.now += 4.0
        await b.submit(step(1001, 1))  # 1001 is active again
        clock.now += 2.0
        assert b.expire() == 1 and sorted(b.live) == [1001]
        with pytest.raises(InvalidArgument, match=r"sequence 1000 is not live .* must set sequence_start"):
            await b.submit(step(1000, 1))
        assert int((await b.submit(step(1001, 5)))["OUTPUT"][0, 0]) == 7
        assert b.expired == 1 and b.state_bytes == 4
        await b.close()

    run(test)


def test_idle_sequences_are_freed_at_their_expiry_time_with_no_request_coming() -> None:
    async def test() -> None:
        clock, model, seen = Clock(), Accumulator(), Seen()
        c = SequenceConfig(strategy="direct", controls=CONTROLS, states=(STATE,), max_sequence_idle_us=5_000_000)
        b = SequenceBatcher("acc", c, model, 2, 1, clock, sleep=clock.sleep, observer=seen)  # two slots
        b.start()
        await b.submit(step(1, 1, start=True))  # at 100, slot 0
        clock.now += 3.0
        await b.submit(step(2, 1, start=True))  # at 103, slot 1
        assert sorted(b.live) == [1, 2] and b.state_bytes == 8 and seen.sequences_and_bytes[-1] == (2, 8)
        await until(lambda: clock.sleepers == [105.0])  # the reaper sleeps until sequence 1's idle time is up
        clock.now = 104.999
        assert sorted(b.live) == [1, 2]
        clock.now = 105.0
        await until(lambda: 1 not in b.live)
        assert b.state_bytes == 4 and b.expired == 1 and seen.expired == 1 and seen.sequences_and_bytes[-1] == (1, 4)
        with pytest.raises(InvalidArgument, match=r"sequence 1 is not live .* idle longer than .* 5000000"):
            await b.submit(step(1, 1))
        # its slot is free: a third sequence takes row 0 (both slots held, it would be refused)
        assert int((await b.submit(step(3, 7, start=True)))["OUTPUT"][0, 0]) == 7
        assert model.batches[-1] == [(3, 1, 0.0, True)]
        await until(lambda: clock.sleepers == [108.0])  # sequence 2's turn
        clock.now = 110.0  # past both 2's (108) and 3's (110)
        await until(lambda: not b.live)
        assert b.state_bytes == 0 and b.expired == 3 and seen.sequences_and_bytes[-1] == (0, 0)
        assert seen.rows == [1, 2, 1]  # direct: row 0 alone, row 1 after a filler row 0, then row 0 again
        await until(lambda: not clock.sleepers)  # nothing idle: the reaper waits for a sequence, not the clock
        await b.submit(step(4, 1, start=True))
        await until(lambda: clock.sleepers == [115.0])
        await b.close()

    run(test)


def test_a_reaper_that_fails_makes_the_model_refuse_requests_saying_why() -> None:
    async def test() -> None:
        async def broken(seconds: float) -> None:
            raise RuntimeError("no clock")

        c = SequenceConfig(strategy="oldest", controls=CONTROLS, states=(STATE,))
        b = SequenceBatcher("acc", c, Accumulator(), 8, 1, Clock(), sleep=broken)
        told: list[Exception] = []
        b.on_failure = told.append
        b.start()
        await b.submit(step(1, 1, start=True))  # then sequence 1 is idle: the reaper sleeps, and fails
        await until(lambda: bool(told))
        with pytest.raises(
            Unavailable, match=r"model 'acc' is unavailable: .*reaper failed: RuntimeError\('no clock'\)"
        ):
            await b.submit(step(1, 1))
        assert str(told[0]) == b.failure
        await b.close()

    run(test)


class Failing(Seen):
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None:
        raise RuntimeError("observer broke")


def test_a_batch_whose_bookkeeping_fails_answers_its_requests_and_stops_the_batcher() -> None:
    async def test() -> None:
        c = SequenceConfig(strategy="oldest", controls=CONTROLS, states=(STATE,))
        b = SequenceBatcher("acc", c, Accumulator(), 8, 1, Clock(), observer=Failing())
        b.start()
        with pytest.raises(Unavailable, match=r"sequence-batch failed: RuntimeError\('observer broke'\)"):
            await b.submit(step(1, 1, start=True))
        with pytest.raises(Unavailable, match="observer broke"):
            await b.submit(step(2, 1, start=True))
        await b.close()

    run(test)


def test_new_sequences_beyond_the_bounds_are_refused_retryably_until_one_ends() -> None:
    async def test() -> None:
        clock = Clock()
        b = batcher(Accumulator(), clock, max_sequences=2, max_sequence_idle_us=3_000_000)
        b.start()
        await b.submit(step(1, 1, start=True))
        clock.now += 1.0
        await b.submit(step(2, 1, start=True))
        with pytest.raises(ResourceExhausted, match=r"cannot start sequence 3: 2 live sequences") as e:
            await b.submit(step(3, 1, start=True))
        assert e.value.retry_after_ms == 2000  # when sequence 1 would idle out
        await b.submit(step(1, 1, end=True))
        await b.submit(step(3, 1, start=True))
        await b.close()

        small = batcher(Accumulator(), max_state_bytes=8)  # two sequences of one INT32 each
        small.start()
        await small.submit(step(1, 1, start=True))
        await small.submit(step(2, 1, start=True))
        with pytest.raises(ResourceExhausted, match="max_state_bytes 8"):
            await small.submit(step(3, 1, start=True))
        await small.close()

    run(test)


class Growing(Accumulator):
    """Its state gains an element with every request."""

    def __call__(self, steps: list[SequenceStep], instance: int) -> list[Any]:
        return [
            {"OUTPUT": s.inputs["INPUT"], "STATE_OUT": np.zeros((1, s.feeds["STATE_IN"].shape[1] + 1), np.int32)}
            for s in steps
        ]


def test_a_state_that_grows_past_the_bound_ends_its_sequence() -> None:
    async def test() -> None:
        config = {"states": (StateSpec("STATE_IN", "STATE_OUT", "INT32", (-1,)),), "max_state_bytes": 16}
        b = batcher(Growing(), **config)
        b.start()
        for _ in range(3):  # 2, 3, then 4 elements: 16 bytes
            await b.submit(step(1, 0, start=not b.live))
        with pytest.raises(
            ResourceExhausted, match=r"over sequence_batching\.max_state_bytes 16: the sequence is ended"
        ):
            await b.submit(step(1, 0))
        assert b.live == {} and b.state_bytes == 0
        await b.close()

    run(test)


def test_a_sequence_past_its_request_bound_is_refused_and_ended_and_a_new_start_counts_afresh() -> None:
    async def test() -> None:
        b = batcher(Accumulator(), max_sequence_requests=3)
        b.start()
        assert await send(b, 1, [1, 1, 1]) == [1, 2, 3]  # three requests, the last one its end: freed
        for i in range(3):
            await b.submit(step(2, 1, start=i == 0))
        with pytest.raises(InvalidArgument, match=r"3 requests, sequence_batching\.max_sequence_requests 3"):
            await b.submit(step(2, 1))
        assert 2 not in b.live and b.state_bytes == 0  # ended and freed: nothing of it ran or waited
        with pytest.raises(InvalidArgument, match="is not live"):
            await b.submit(step(2, 1))
        assert await send(b, 2, [5, 1]) == [5, 6]  # started again: counted from its start
        await b.close()

    run(test)


def test_a_start_for_a_live_sequence_restarts_it_after_its_queued_requests() -> None:
    async def test() -> None:
        model = Accumulator()
        b = batcher(model)
        b.start()
        assert await send(b, 5, [1, 2]) == [1, 3]
        await b.submit(step(5, 3, start=True))
        r = await b.submit(step(5, 4, start=True))  # live, not ended: Triton's "conflict", a restart
        assert int(r["OUTPUT"][0, 0]) == 4 and model.batches[-1] == [(5, 1, 0.0, True)]
        assert int((await b.submit(step(5, 1, end=True)))["OUTPUT"][0, 0]) == 5
        await b.close()

    run(test)


def test_requests_that_break_the_sequence_rules_are_refused_naming_what_is_wrong() -> None:
    async def test() -> None:
        model = Accumulator(hold_first=True)
        b = batcher(model)
        b.start()
        with pytest.raises(InvalidArgument, match="sequence 42 is not live"):
            await b.submit(step(42, 1))
        with pytest.raises(InvalidArgument, match="non-zero, non-empty 'sequence_id'"):
            await b.submit(step(0, 1, start=True))
        with pytest.raises(InvalidArgument, match="non-zero, non-empty 'sequence_id'"):
            await b.submit(step("", 1, start=True))
        with pytest.raises(InvalidArgument, match=r"sequence_id 'u-1' is a string.*'CORRID' is UINT64"):
            await b.submit(step("u-1", 1, start=True))
        with pytest.raises(InvalidArgument, match=r"sequence_id -3 does not fit .* \(UINT64\)"):
            await b.submit(step(-3, 1, start=True))
        two = step(8, 1, start=True)
        two.inputs["INPUT"] = np.zeros((2, 1), np.int32)
        with pytest.raises(InvalidArgument, match="input 'INPUT' has batch size 2"):
            await b.submit(two)
        # a decimal string is an integer id for a UINT64 CORRID
        first = asyncio.create_task(b.submit(step("77", 1, start=True)))
        await until(lambda: len(model.batches) == 1)
        ending = asyncio.create_task(b.submit(step("77", 1, end=True)))
        await until(lambda: b.queued == 1)
        with pytest.raises(InvalidArgument, match="sequence '77' has ended"):  # after its queued end
            await b.submit(step("77", 1))
        with pytest.raises(InvalidArgument, match="sequence 77 is not live"):  # an integer id is another sequence
            await b.submit(step(77, 1))
        model.gate.set()
        assert int((await first)["OUTPUT"][0, 0]) == 1 and int((await ending)["OUTPUT"][0, 0]) == 2
        assert model.batches[0] == [(77, 1, 0.0, True)] and b.live == {}
        await b.close()

    run(test)


def test_a_failed_run_fails_its_request_and_leaves_the_state_as_it_was() -> None:
    async def test() -> None:
        b = batcher(Accumulator())
        b.start()
        await b.submit(step(1, 5, start=True))
        with pytest.raises(Internal, match="an input below -1000"):
            await b.submit(step(1, -5000))
        assert int((await b.submit(step(1, 1)))["OUTPUT"][0, 0]) == 6
        await b.close()

    run(test)


def test_state_outputs_are_answered_only_when_asked_for() -> None:
    async def test() -> None:
        b = batcher(Accumulator())
        b.start()
        assert set(await b.submit(step(1, 5, start=True))) == {"OUTPUT"}
        assert set(await b.submit(step(1, 5, outputs=("OUTPUT", "STATE_OUT")))) == {"OUTPUT", "STATE_OUT"}
        await b.close()

    run(test)


def test_close_fails_queued_requests_and_frees_every_sequence() -> None:
    async def test() -> None:
        model = Accumulator(hold_first=True)
        b = batcher(model)
        b.start()
        running = asyncio.create_task(b.submit(step(1, 1, start=True)))
        await until(lambda: len(model.batches) == 1)
        queued = [asyncio.create_task(b.submit(step(sid, 1, start=True))) for sid in (2, 3)]
        await until(lambda: b.queued == 2)
        closing = asyncio.create_task(b.close())
        for t in queued:
            with pytest.raises(Unavailable, match="shutting down"):
                await t
        model.gate.set()
        await closing
        assert int((await running)["OUTPUT"][0, 0]) == 1  # the running batch finished
        assert b.live == {} and b.state_bytes == 0 and b.queued == 0
        with pytest.raises(Unavailable):
            await b.submit(step(4, 1, start=True))

    run(test)


def test_initial_state_is_zeros_or_the_raw_values_of_a_data_file(tmp_path: Path) -> None:
    zeros = initial_state(StateSpec("S", "T", "FP32", (-1, 3)))
    assert zeros.shape == (1, 1, 3) and not zeros.any()
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "five").write_bytes(np.arange(4, dtype=np.int32).tobytes())
    spec = StateSpec("S", "T", "INT32", (-1,), InitialState("INT32", (4,), "five"))
    assert initial_state(spec, tmp_path).tolist() == [[0, 1, 2, 3]]
    short = StateSpec("S", "T", "INT32", (-1,), InitialState("INT32", (5,), "five"))
    with pytest.raises(ValueError, match="holds 16 bytes, dims \\[5\\] of INT32 need 20"):
        initial_state(short, tmp_path)

    async def test() -> None:  # a sequence starts from the file's values
        b = SequenceBatcher(
            "acc", SequenceConfig(states=(spec,)), lambda steps, _: [{"T": s.feeds["S"] + 1} for s in steps], 4,
            initial={"S": initial_state(spec, tmp_path)},
        )  # fmt: skip
        b.start()
        loop = asyncio.get_running_loop()
        await b.submit(SequenceStep(1, True, False, {}, loop.create_future()))
        r = await b.submit(SequenceStep(1, False, False, {}, loop.create_future(), ("T",)))
        assert r["T"].tolist() == [[2, 3, 4, 5]]
        await b.close()

    run(test)


# -- config.json's sequence_batching ---------------------------------------------------------------


def test_tritons_sequence_batching_json_parses_to_typed_values() -> None:
    c = parse_sequence_batching({
        "max_sequence_idle_microseconds": "5000000",
        "oldest": {"max_candidate_sequences": "4", "max_queue_delay_microseconds": "100", "preferred_batch_size": [2]},
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]},
            {"name": "END", "control": [{"kind": "CONTROL_SEQUENCE_END", "fp32_false_true": [0, 1.5]}]},
            {"name": "READY", "control": [{"kind": "CONTROL_SEQUENCE_READY", "bool_false_true": [False, True]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_STRING"}]},
        ],
        "state": [{"input_name": "S_IN", "output_name": "S_OUT", "data_type": "TYPE_INT32", "dims": ["-1"],
                   "initial_state": [{"data_type": "TYPE_INT32", "dims": ["1"], "zero_data": True, "name": "z"}]}],
    })  # fmt: skip
    assert c.strategy == "oldest" and c.max_sequence_idle_us == 5_000_000 and c.max_queue_delay_us == 100
    assert c.max_candidate_sequences == 4 and c.preferred_batch_size == (2,)
    assert c.controls == (
        Control("START", "START", "INT32", (0, 1)),
        Control("END", "END", "FP32", (0, 1.5)),
        Control("READY", "READY", "BOOL", (False, True)),
        Control("CORRID", "CORRID", "BYTES", ("", "")),
    )
    assert c.states == (StateSpec("S_IN", "S_OUT", "INT32", (-1,), InitialState("INT32", (1,), None, "z")),)
    assert c.hidden_inputs == {"START", "END", "READY", "CORRID", "S_IN"}
    assert parse_sequence_batching({}) == SequenceConfig()  # direct, Triton's default
    assert parse_sequence_batching({"max_sequence_requests": "512"}).max_sequence_requests == 512


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"max_sequence_idle_microseconds": "soon"}, r"sequence_batching\.max_sequence_idle_microseconds must be"),
        ({"oldest": {"max_candidate_sequences": 1.5}}, r"sequence_batching\.oldest\.max_candidate_sequences must be"),
        ({"direct": {}, "oldest": {}}, "one strategy"),
        ({"oldest": {"max_queue_delay": 1}}, r"unknown setting\(s\) \['max_queue_delay'\] in sequence_batching.oldest"),
        ({"control_input": [{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_BEGIN"}]}]},
         r"sequence_batching.control_input\[0\].control\[0\].kind must be one of"),
        ({"control_input": [{"name": "S", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0]}]}]},
         r"control_input\[0\].control\[0\].int32_false_true must hold two values"),
        ({"control_input": [{"name": "E", "control": [{"kind": "CONTROL_SEQUENCE_END", "int32_false_true": [0, .5]}]}]},
         r"int32_false_true\[1\] must be a INT32 value"),
        ({"control_input": [{"name": "C", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_FP32"}]}]},
         "a correlation id is TYPE_UINT64"),
        ({"state": [{"input_name": "a", "output_name": "b", "data_type": "TYPE_INT33", "dims": [1]}]},
         r"sequence_batching.state\[0\].data_type must be a datatype"),
        ({"state": [{"input_name": "a", "output_name": "b", "data_type": "TYPE_INT32", "dims": [1]}] * 2},
         "input 'a' is named by more than one"),
        ({"state": [{"input_name": "a", "output_name": "b", "data_type": "TYPE_INT32", "dims": [2],
                     "initial_state": [{"data_type": "TYPE_INT32", "dims": [3], "zero_data": True}]}]},
         r"initial_state\[0\].dims \[3\] do not fit the state's dims \[2\]"),
        ({"state": [{"input_name": "a", "output_name": "b", "data_type": "TYPE_INT32", "dims": [1],
                     "initial_state": [{"data_type": "TYPE_INT32", "dims": [1], "data_file": "../x"}]}]},
         "must name a file in initial_state/"),
        ({"max_sequences": 0}, "sequence_batching.max_sequences must be an integer >= 1"),
        ({"max_sequence_requests": True}, "sequence_batching.max_sequence_requests must be an integer >= 1"),
    ],
)  # fmt: skip
def test_a_wrong_sequence_batching_value_is_refused_naming_its_key(raw: Any, message: str) -> None:
    with pytest.raises(SequenceConfigError, match=message):
        parse_sequence_batching(raw)


# --- callers (--isolate-tokens) ------------------------------------------------------------------------------


def _as(caller: Caller | None, s: SequenceStep) -> SequenceStep:
    s.caller = caller
    return s


def test_a_sequence_is_its_callers_and_another_caller_finds_none_of_that_id() -> None:
    a, b_ = Caller("token 1"), Caller("token 2")

    async def test() -> None:
        b = batcher(Accumulator())
        b.start()
        assert int((await b.submit(_as(a, step(7, 10, start=True))))["OUTPUT"][0, 0]) == 10
        for stranger in (_as(b_, step(7, 1)), _as(b_, step(7, 1, end=True)), step(7, 1)):
            with pytest.raises((NotFound, InvalidArgument), match="sequence 7 is not live") as e:
                await b.submit(stranger)  # neither another caller, nor a request with no caller, steps on it
            assert isinstance(e.value, NotFound) == (stranger.caller is not None)
        # another caller's start of the same id is a sequence of its own: A's goes on from where it was
        assert int((await b.submit(_as(b_, step(7, 100, start=True))))["OUTPUT"][0, 0]) == 100
        assert int((await b.submit(_as(a, step(7, 1))))["OUTPUT"][0, 0]) == 11
        assert int((await b.submit(_as(b_, step(7, 2, end=True))))["OUTPUT"][0, 0]) == 102
        assert int((await b.submit(_as(a, step(7, 1, end=True))))["OUTPUT"][0, 0]) == 12
        assert b.live == {} and b.state_bytes == 0 and b.owned == {}
        await b.close()

    run(test)


@pytest.mark.parametrize("bound", ["max_sequences", "max_state_bytes"])
def test_one_caller_holds_its_share_and_the_others_still_start_sequences(bound: str) -> None:
    """8 sequences of 4 bytes of state at most; a greedy caller starting all it can, then a victim. Without a
    share (1.0, as without isolation) the greedy one takes all 8 and the victim none."""
    limits = {"max_sequences": 8} if bound == "max_sequences" else {"max_state_bytes": 32}

    async def started(b: SequenceBatcher, caller: Caller, first: int) -> tuple[int, str]:
        """How many of 20 starts passed, and why the first refused one was."""
        n, why = 0, ""
        for sid in range(first, first + 20):
            try:
                await b.submit(_as(caller, step(sid, 1, start=True)))
                n += 1
            except ResourceExhausted as e:
                why = why or str(e)
        return n, why

    async def test(share: float) -> tuple[int, int]:
        b = batcher(Accumulator(), **limits)
        b.start()
        (greedy, why), (victim, _) = (
            await started(b, Caller("token 1", share), 1),
            await started(b, Caller("token 2", share), 100),
        )
        assert ("this caller's" in why) == (share < 1), why
        await b.close()
        return greedy, victim

    assert asyncio.run(test(1.0)) == (8, 0)
    assert asyncio.run(test(0.5)) == (4, 4)


def test_a_callers_growing_state_ends_at_its_share_and_the_others_grow_on() -> None:
    """A state that grows 4 bytes a request (a key/value cache's way), max_state_bytes 64 and a share of 0.5:
    the greedy caller's sequence ends when it would pass 32 bytes; the victim's grows to its own 32."""
    grows = StateSpec("STATE_IN", "STATE_OUT", "INT32", (-1,))

    def model(steps: list[SequenceStep], instance: int) -> list[Any]:
        return [
            {"OUTPUT": s.feeds["INPUT"], "STATE_OUT": np.concatenate([s.feeds["STATE_IN"], s.feeds["INPUT"]], axis=1)}
            for s in steps
        ]

    async def grown(b: SequenceBatcher, caller: Caller, sid: int) -> tuple[int, str]:
        """Requests answered until the first refusal, and why it was."""
        for n in range(20):
            try:
                await b.submit(_as(caller, step(sid, 1, start=n == 0)))
            except ResourceExhausted as e:
                return n, str(e)
        return 20, ""

    async def test() -> None:
        c = SequenceConfig(strategy="oldest", controls=CONTROLS, states=(grows,), max_state_bytes=64)
        b = SequenceBatcher("grow", c, model, 1, 1, Clock())
        b.start()
        greedy, why = await grown(b, Caller("token 1", 0.5), 1)
        assert greedy == 7 and "this caller's share" in why, (greedy, why)  # 4 initial bytes, +4 each: 32 at 7
        assert 1 not in b.live and ("token 1", 1) not in b.live  # the sequence ended with the refusal
        victim, why = await grown(b, Caller("token 2", 0.5), 2)
        assert victim == 7 and "this caller's share" in why, (victim, why)
        await b.close()

    run(test)
