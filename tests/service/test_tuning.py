"""Batching settings from a model's measured cost (service/scheduling/tuning.py), on stand-in models whose cost
is set: computed inline only when cheap and requests come one at a time, a partial batch waits only
when company is coming, the token budget where throughput flattens; config.json's values win; the
values in force are shown."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from service import protocol
from service.scheduling.admission import WorkItem
from service.scheduling.batching import DynamicBatcher
from service.scheduling.config import BatchingConfig
from service.scheduling.tuning import QUIET_ARRIVALS, CostModel, Pacing, sweep, tune
from tests.conftest import MODELS, start_server, stop_server

# A batch's cost as served (the hand-off included): fixed, per token.
CHEAP = (0.00021, 0.0000001)  # a 200 us hand-off + 10 us, + 0.1 us a token
DEAR = (0.0005, 0.00003)  # 500 us + 30 us a token
# The hand-off the batchers below are tuned with, in place of this machine's (which load stretches): the
# settings then follow from the stand-ins' set costs alone.
HANDOFF = 0.0002


def test_the_cost_model_recovers_a_batch_cost_from_measurements() -> None:
    fixed, per_token = DEAR
    cost = CostModel.fit((t, fixed + per_token * t) for t in (16, 64, 256, 1024, 4096))
    assert math.isclose(cost.fixed, fixed, rel_tol=1e-6) and math.isclose(cost.per_token, per_token, rel_tol=1e-6)
    for _ in range(32):  # the machine slows down: served batches refit the model
        cost.observe(1000, 2 * (fixed + per_token * 1000))
    assert cost.predict(1000) > 1.5 * (fixed + per_token * 1000)


def test_a_cost_that_does_not_grow_with_tokens_is_a_fixed_cost() -> None:
    flat = [(t, 0.05) for t in (16, 32, 64, 128, 256)]
    cost = CostModel.fit(flat)
    assert cost.per_token == 0 and math.isclose(cost.fixed, 0.05, rel_tol=1e-9)
    falling = CostModel.fit([(16, 0.0052), (64, 0.0051), (256, 0.0050)])  # noise, slightly falling
    assert falling.per_token == 0 and 0.0050 <= falling.fixed <= 0.0052
    one_size = CostModel.fit([(64, 0.0064)] * 3)  # nothing tells fixed from per-token time: all per token
    assert one_size.fixed == 0 and math.isclose(one_size.per_token, 0.0001, rel_tol=1e-9)
    # Inline: a fixed cost of 50 ms is never 20 hand-offs of 0.2 ms, whatever the request's size; a fixed cost
    # of 1 ms is, at every size the sweep measured.
    assert tune(BatchingConfig(), frozenset(), flat, 0.0002, cost).config.inline_max_tokens == 0
    assert _tuned((0.05, 0.0), handoff=0.0002).config.inline_max_tokens == 0
    assert _tuned((0.001, 0.0), handoff=0.0002).config.inline_max_tokens == 4096  # the largest measured
    assert _tuned((0.05, 0.0), handoff=0.0002).config.max_queue_delay_ms == pytest.approx(50)


def test_the_sweep_stops_once_a_batch_is_slow() -> None:
    points = sweep(lambda rows: 0.01 * rows, length=64, max_rows=64)
    assert [t for t, _ in points] == [64, 128, 256, 512, 1024, 2048]  # 32 rows took 0.32 s > 0.25 s
    assert [t for t, _ in sweep(lambda rows: 1e-4 * rows, 16, 8)] == [16, 32, 64, 128]


def test_a_slow_moment_of_the_machine_slows_no_size_of_the_sweep_throughout() -> None:
    """Three runs in a row come out three times slower (another process took the core): timed in turns,
    every size still has an undisturbed run to keep. Timed back to back, one size's every run fell there."""
    calls = iter(range(1000))

    def run(rows: int) -> float:
        slow = next(calls) in (6, 7, 8)
        return 1e-3 * rows * (3 if slow else 1)

    assert sweep(run, length=16, max_rows=64) == [(16 * r, 1e-3 * r) for r in (1, 2, 4, 8, 16, 32, 64)]


def _tuned(cost: tuple[float, float], handoff: float, given: frozenset[str] = frozenset()) -> Any:
    fixed, per_token = cost
    points = [(t, fixed + per_token * t) for t in (64, 128, 256, 512, 1024, 2048, 4096)]
    return tune(BatchingConfig(), given, points, handoff, CostModel.fit(points))


def test_inline_only_up_to_a_compute_of_twenty_handoffs() -> None:
    assert _tuned(CHEAP, handoff=0.0002).config.inline_max_tokens == 39_900  # (20 x 200 us - 10 us) / 0.1 us
    assert _tuned(DEAR, handoff=0.0002).config.inline_max_tokens == 123  # (4,000 us - 300 us) / 30 us
    assert _tuned((0.005, 0.00003), handoff=0.0002).config.inline_max_tokens == 0  # a batch's fixed cost alone is more


def test_the_token_budget_is_where_measured_throughput_stops_paying() -> None:
    handoff = 0.0002
    tuning = _tuned(DEAR, handoff)
    fixed = DEAR[0]
    # Throughput t / (fixed + per_token x t) climbs towards 1 / per_token: 512 tokens are the fewest of the
    # sweep's (64 ... 4,096) within 97 % of its best (4,096 tokens).
    assert tuning.config.token_budget == 512
    assert tuning.config.max_queue_delay_ms == pytest.approx(fixed * 1e3)

    def budget(rates: dict[int, float]) -> int:
        points = [(t, t / r) for t, r in rates.items()]
        return int(tune(BatchingConfig(), frozenset(), points, handoff, CostModel.fit(points)).config.token_budget)

    # Larger batches slower per token past 512 (their activations leave the caches): no linear model shows it.
    assert budget({64: 20e3, 128: 26e3, 256: 30e3, 512: 32e3, 1024: 31e3, 2048: 25e3, 4096: 18e3}) == 512
    assert budget({64: 1e3, 128: 2e3, 256: 4e3, 512: 8e3}) == 512  # still climbing: the largest measured


def test_config_json_values_win_and_say_so() -> None:
    tuning = _tuned(DEAR, 0.0002, given=frozenset({"token_budget", "max_queue_delay_ms"}))
    assert tuning.config.token_budget == BatchingConfig().token_budget
    assert tuning.config.max_queue_delay_ms == BatchingConfig().max_queue_delay_ms
    assert tuning.reasons["token_budget"] == tuning.reasons["max_queue_delay_ms"] == "config.json"
    assert tuning.config.inline_max_tokens == 123 and "hand-offs" in tuning.reasons["inline_max_tokens"]
    assert "token_budget 8192 (config.json)" in tuning.summary("m")


def test_pacing_waits_only_while_requests_come_faster_than_a_batch_costs() -> None:
    pacing = Pacing(CostModel(fixed=0.001, per_token=0.0))
    for k in range(10):
        pacing.arrived(100.0 + k * 0.0002)  # every 0.2 ms
    assert pacing.company_soon()
    for k in range(10):
        pacing.arrived(101.0 + k * 0.01)  # every 10 ms
    assert not pacing.company_soon()
    assert Pacing(None).company_soon()  # no cost model (an explicit delay): wait as configured


def test_pacing_says_alone_only_after_requests_came_one_at_a_time() -> None:
    pacing = Pacing(None, overlap=0.0003)
    now = 100.0
    for _ in range(QUIET_ARRIVALS - 1):
        now += 0.01
        pacing.arrived(now)
        assert not pacing.alone()  # not yet: QUIET_ARRIVALS in a row first
    pacing.arrived(now + 0.01)
    assert pacing.alone()
    pacing.arrived(now + 0.02, busy=True)  # another request was in the server
    assert not pacing.alone()
    for k in range(QUIET_ARRIVALS):
        pacing.arrived(now + 0.03 + 0.01 * k)
    assert pacing.alone()
    pacing.inlined(now + 0.5)
    pacing.arrived(now + 0.5001)  # 0.1 ms after an inline computation ended: it had waited behind it
    assert not pacing.alone()
    assert Pacing(None).alone()  # no overlap gap (inline_max_tokens from config.json): the token rule alone


def test_a_request_the_loop_reached_without_waiting_after_an_inline_one_had_waited_behind_it() -> None:
    for pacing in (Pacing(None, overlap=0.0003), Pacing(None)):  # tuned, or inline_max_tokens from config.json
        now = 100.0
        for k in range(QUIET_ARRIVALS):
            pacing.arrived(now + 0.01 * k, loop_idle=now + 0.01 * k - 0.001)
        assert pacing.alone()
        pacing.inlined(now + 1.0)
        # 5 ms later, far beyond the overlap gap, but the loop never waited since: it was queued behind it
        pacing.arrived(now + 1.005, loop_idle=now + 0.9)
        assert not pacing.alone()
        pacing.arrived(now + 1.5, loop_idle=now + 1.499)  # the loop waited for this one: it came alone
        assert pacing.alone() is (pacing.overlap is None)  # tuned: QUIET_ARRIVALS in a row again first


class StandIn:
    """A model whose batch costs fixed + per_token x padded tokens, spent on the calling thread."""

    def __init__(self, cost: tuple[float, float]) -> None:
        self.fixed, self.per_token = cost
        self.threads: list[int] = []
        self.sizes: list[int] = []

    def __call__(self, items: list[WorkItem], instance: int) -> list[Any]:
        self.threads.append(threading.get_ident())
        self.sizes.append(len(items))
        end = (
            time.perf_counter()
            + self.fixed
            + self.per_token * sum(x.rows for x in items) * max(x.length for x in items)
        )
        while time.perf_counter() < end:  # busy, as compute is: a sleep would free the core
            pass
        return [x.payload for x in items]


def _batcher(model: StandIn, cost: tuple[float, float]) -> DynamicBatcher:
    """A batcher tuned as a server tunes one, from a sweep of the stand-in's set cost and a set hand-off."""
    b = DynamicBatcher("m", BatchingConfig(), model, instances=2)
    points = sweep(lambda rows: cost[0] + cost[1] * rows * 16, 16, 64)
    fitted = CostModel.fit(points)
    b.use(tune(b.config, frozenset(), points, HANDOFF, fitted), fitted)
    return b


def _item(k: int, length: int = 16) -> WorkItem:
    return WorkItem(rows=1, length=length, payload=k, future=asyncio.get_running_loop().create_future())


def test_a_cheap_model_runs_on_the_event_loop_and_a_dear_one_on_its_threads() -> None:
    async def run() -> None:
        loop_thread = threading.get_ident()
        # Free compute goes inline; 50 ms of it, the same at every batch size, never does.
        for cost, inline in (((0.0, 1e-7), True), ((0.05, 0.0), False)):
            model = StandIn(cost)
            b = _batcher(model, cost)
            assert (b.config.inline_max_tokens >= 16) is inline, (cost, b.config)
            b.start()
            # One at a time: the server is idle at each, and each arrives more than the overlap gap (three
            # hand-offs, 0.6 ms) after the previous one ended; a loaded machine only stretches the pause.
            for k in range(QUIET_ARRIVALS + 4):
                assert await b.submit(_item(k)) == k
                await asyncio.sleep(0.002)
            # The first few go to the threads: nothing yet says requests come one at a time.
            assert all(t != loop_thread for t in model.threads[: QUIET_ARRIVALS - 1])
            assert all((t == loop_thread) is inline for t in model.threads[QUIET_ARRIVALS - 1 :]), (cost, b.config)
            await b.close()

    asyncio.run(run())


def test_a_burst_is_batched_on_the_threads_however_cheap_the_model() -> None:
    """Computing on the event loop while requests overlap would run them one at a time, unbatched."""

    async def run() -> None:
        loop_thread = threading.get_ident()
        cheap = (0.0005, 1e-6)
        model = StandIn(cheap)
        b = _batcher(model, cheap)
        assert abs(b.config.inline_max_tokens - 3700) <= 1  # (21 x 0.2 ms - 0.5 ms) / 1 us, rounded down
        b.start()
        for k in range(QUIET_ARRIVALS + 2):
            await b.submit(_item(k))
            await asyncio.sleep(0.002)
        assert model.threads[-1] == loop_thread  # one at a time: inline
        model.threads.clear()
        model.sizes.clear()
        # All 32 arrive (WorkItem.arrived) before the first is computed: each after the first finds it
        # computing or just ended, whatever the machine's speed.
        burst = [asyncio.create_task(b.submit(_item(k))) for k in range(32)]
        assert [await t for t in burst] == list(range(32))
        assert model.threads.count(loop_thread) <= 1  # at most the first, before the others were seen
        assert max(model.sizes) > 1, model.sizes
        await b.close()

    asyncio.run(run())


def test_a_partial_batch_waits_for_company_only_when_it_is_coming() -> None:
    async def run() -> None:
        # Requests 1 ms apart for a batch of 100 ms fixed cost: company is coming, even were each pause 50
        # times longer on a loaded machine. Requests 50 ms apart for one of 5 ms: it is not, and a pause only
        # ever lasts longer. (A stand-in's cost is spent by the clock, so load does not stretch it.)
        for cost, gap, batched in (((0.1, 0.00001), 0.001, True), ((0.005, 0.00001), 0.05, False)):
            model = StandIn(cost)
            b = _batcher(model, cost)
            assert b.config.inline_max_tokens == 0, b.config  # none computes on the event loop
            b.start()
            tasks = []
            for k in range(16):
                tasks.append(asyncio.create_task(b.submit(_item(k))))
                await asyncio.sleep(gap)
            assert [await t for t in tasks] == list(range(16))
            assert b.pacing.company_soon() is batched, (gap, b.pacing.interarrival)
            assert model.sizes[0] == 1, model.sizes  # the first found the server idle and went at once
            if batched:
                # The second found an instance computing and the other idle: it waited for the ones after it.
                assert model.sizes[1] > 1 and sum(model.sizes) / len(model.sizes) > 1.5, model.sizes
            else:  # requests 50 ms apart never wait: each went as it came
                assert max(model.sizes) == 1, model.sizes
            await b.close()

    asyncio.run(run())


def test_the_values_in_force_are_in_model_config_and_the_metrics(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    (repo / "tuned").mkdir(parents=True)
    (repo / "tuned" / "1").symlink_to(MODELS / "g2p_encoder" / "1", target_is_directory=True)
    shipped = json.loads((MODELS / "g2p_encoder" / "config.json").read_text())
    shipped.get("batching", {}).pop("token_budget", None)
    (repo / "tuned" / "config.json").write_text(json.dumps(shipped))
    (repo / "given").mkdir()
    (repo / "given" / "1").symlink_to(MODELS / "g2p_encoder" / "1", target_is_directory=True)
    (repo / "given" / "config.json").write_text(json.dumps({**shipped, "batching": {"token_budget": 1000}}))
    s = start_server(["--model-repository", str(repo)], tmp_path / "log")
    try:
        with grpc.insecure_channel(s.url) as channel:
            stub = protocol.Stub(channel)
            params = {
                name: stub.ModelConfig(protocol.ModelConfigRequest(name=name), timeout=10).config.parameters
                for name in ("tuned", "given")
            }
        metrics = urllib.request.urlopen(s.metrics_url, timeout=10).read().decode()
    finally:
        stop_server(s)
    assert params["given"]["batching.token_budget"].string_value == "1000"
    assert params["given"]["batching.token_budget.source"].string_value == "config.json"
    tuned = params["tuned"]["batching.token_budget"].string_value
    assert tuned != "8192" and "throughput" in params["tuned"]["batching.token_budget.source"].string_value
    assert f'qkv_batching_setting{{model="tuned",setting="token_budget",version="1"}} {float(tuned)}' in metrics
    assert 'qkv_batching_setting{model="given",setting="token_budget",version="1"} 1000.0' in metrics
    log = s.output()
    assert "batching model 'tuned': a batch costs" in log and "token_budget 1000 (config.json)" in log
