"""Triton's priority levels and queue policies: the scheduler's decisions under an injected clock and cost,
and a real server obeying a request's `priority` parameter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.errors import InvalidArgument, ResourceExhausted
from service.repository.layout import RepositoryError, load_model_config
from service.scheduling.admission import WorkItem
from service.scheduling.batching import select_batch
from service.scheduling.preferred import PreferredSizes
from service.scheduling.priorities import Priorities, PriorityChooser, QueuePolicy, parse_priorities
from tests.conftest import RunningServer, start_server, stop_server
from tests.service.test_triton_pbtxt import SIMPLE_PBTXT, _simple


def _item(level: int, arrived: float) -> WorkItem:
    """A queued request as the chooser sees it (it never touches the future)."""
    return WorkItem(rows=1, length=1, payload=None, future=None, arrived=arrived, level=level)  # type: ignore[arg-type]


def _p99(waits: list[float]) -> float:
    return float(np.percentile(waits, 99))


TICKS = 400


def test_under_a_two_level_flood_high_priority_waits_a_quarter_of_low_and_low_still_progresses() -> None:
    """Each tick two high and two low requests arrive; the model serves one batch of three rows a tick
    (the injected cost), so the queue grows: a flood. High-priority requests are served first, but the
    low level keeps one batch in DEFAULT_SHARE."""
    now = [0.0]
    priorities = Priorities(levels=2, default_level=2)
    chooser = PriorityChooser(priorities, select_batch, clock=lambda: now[0])
    queue: list[WorkItem] = []
    waits: dict[int, list[float]] = {1: [], 2: []}
    for tick in range(TICKS):
        now[0] = float(tick)
        queue += [_item(1, tick), _item(1, tick), _item(2, tick), _item(2, tick)]
        picked = chooser(queue, 3, 1 << 20, False, 1.0)
        for i in picked:
            waits[queue[i].level].append(now[0] - queue[i].arrived)
        queue = [x for i, x in enumerate(queue) if i not in set(picked)]
    high, low = _p99(waits[1]), _p99(waits[2])
    assert high <= low / 4, (high, low)
    assert high <= 1.0  # served within a tick of arriving
    assert len(waits[2]) >= TICKS * 3 / 8 * 0.9  # low still progresses: about its share of the batches
    assert len(waits[1]) >= 2 * TICKS - 2  # every high request, but perhaps the last tick's


def test_a_delayed_request_waits_behind_every_level_and_a_batch_holds_one_level() -> None:
    now = [0.0]
    priorities = Priorities(levels=2, default_level=2, share=1000)
    chooser = PriorityChooser(priorities, select_batch, clock=lambda: now[0])
    late = _item(1, 0.0)
    late.delay_at = 5.0
    queue = [late, _item(2, 1.0), _item(1, 2.0)]
    assert chooser(queue, 8, 1 << 20, False, 1.0) == [0, 2]  # level 1 only, in arrival order
    now[0] = 6.0  # past its DELAY timeout: the level 2 request goes first
    assert chooser(queue[:2], 8, 1 << 20, False, 1.0) == [1]
    assert chooser(queue[:1], 8, 1 << 20, False, 1.0) == [0]


def test_queue_policy_sets_timeouts_bounds_levels_and_checks_the_priority_parameter() -> None:
    policy = QueuePolicy("REJECT", default_timeout_us=2_000_000, allow_timeout_override=True, max_queue_size=2)
    delay = QueuePolicy("DELAY", default_timeout_us=1_000_000)
    priorities = Priorities(levels=3, default_level=2, default_policy=policy, policies={3: delay})
    item = _item(0, 10.0)
    priorities.admit(item, {"priority": 0, "timeout": 500_000}, [])
    assert item.level == 2 and item.deadline == 10.5 and item.delay_at is None  # the request's shorter timeout
    item = _item(0, 10.0)
    priorities.admit(item, {"timeout": 9_000_000}, [])
    assert item.deadline == 12.0  # a request may shorten the default, not lengthen it
    item = _item(0, 10.0)
    priorities.admit(item, {"priority": 3}, [])
    assert item.level == 3 and item.delay_at == 11.0 and item.deadline is None
    with pytest.raises(ResourceExhausted, match="Exceeds maximum queue size"):
        priorities.admit(_item(0, 0.0), {"priority": 1}, [_item(1, 0.0), _item(1, 0.0)])
    for bad in (4, -1, "1", True):
        with pytest.raises(InvalidArgument, match="'priority'"):
            priorities.level_of({"priority": bad})


def test_priorities_are_read_from_the_config_and_checked(tmp_path: Path) -> None:
    parsed = parse_priorities({
        "priority_levels": "2", "default_priority_level": "2",
        "default_queue_policy": {"max_queue_size": 4, "timeout_action": "DELAY", "default_timeout_microseconds": "100"},
        "priority_queue_policy": {"1": {"max_queue_size": 8}},
    })  # fmt: skip
    assert parsed == Priorities(
        levels=2,
        default_level=2,
        default_policy=QueuePolicy("DELAY", 100, False, 4),
        policies={1: QueuePolicy(max_queue_size=8)},
    )
    bad = SIMPLE_PBTXT.replace("max_queue_delay_microseconds: 500", "priority_levels: 2 default_priority_level: 3")
    _simple(tmp_path / "simple", bad)
    with pytest.raises(RepositoryError, match=r"default_priority_level must be within 1..priority_levels \(2\)"):
        load_model_config(tmp_path / "simple")


PRIORITY_PBTXT = SIMPLE_PBTXT.replace(
    "dynamic_batching { max_queue_delay_microseconds: 500 }",
    "dynamic_batching { priority_levels: 2 default_priority_level: 2 default_queue_policy { max_queue_size: 64 } }",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("priorities")
    _simple(root / "simple", PRIORITY_PBTXT)
    s = start_server(["--model-repository", str(root)], root.parent / "server.log")
    yield s
    stop_server(s)


def test_a_server_takes_the_priority_parameter_and_refuses_one_outside_the_levels(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [g.InferInput("INPUT0", [1, 16], "INT32"), g.InferInput("INPUT1", [1, 16], "INT32")]
    for t in inputs:
        t.set_data_from_numpy(a)
    for level in (0, 1, 2):
        assert (client.infer("simple", inputs, priority=level).as_numpy("OUTPUT0") == 2 * a).all()
    with pytest.raises(InferenceServerException) as e:
        client.infer("simple", inputs, priority=3)
    assert "INVALID_ARGUMENT" in str(e.value.status()) and "'priority' 3 is outside" in e.value.message()
    config = client.get_model_config("simple").config.dynamic_batching
    assert (config.priority_levels, config.default_priority_level, config.default_queue_policy.max_queue_size) == (
        2,
        2,
        64,
    )


def test_preferred_batch_sizes_cut_a_batch_to_the_largest_it_fills() -> None:
    chooser = PreferredSizes((4, 2), select_batch)
    queue = [_item(0, float(t)) for t in range(7)]
    assert chooser(queue, 8, 1 << 20, False, 1.0) == [0, 1, 2, 3]  # 7 queued: 4 go, 3 wait
    assert chooser(queue[:3], 8, 1 << 20, False, 1.0) == [0, 1]  # 3: 2 go
    assert chooser(queue[:1], 8, 1 << 20, False, 1.0) == [0]  # fewer than any: as they are
    # composed under priorities: the level's requests, cut to a preferred size
    both = PriorityChooser(Priorities(levels=2, default_level=2), chooser, clock=lambda: 0.0)
    mixed = [_item(2, 0.0), *(_item(1, float(t)) for t in range(5))]
    assert both(mixed, 8, 1 << 20, False, 1.0) == [1, 2, 3, 4]


def test_preferred_batch_sizes_are_read_and_checked(tmp_path: Path) -> None:
    pbtxt = SIMPLE_PBTXT.replace("max_queue_delay_microseconds: 500", "preferred_batch_size: [ 4, 2 ]")
    _simple(tmp_path / "a", pbtxt)
    assert load_model_config(tmp_path / "a").preferred_batch_sizes == (2, 4)
    _simple(tmp_path / "b", pbtxt.replace("[ 4, 2 ]", "[ 16 ]"))
    with pytest.raises(RepositoryError, match=r"preferred_batch_size: 16 is not within 1..max_batch_size"):
        load_model_config(tmp_path / "b")
