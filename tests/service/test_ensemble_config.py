"""ensemble_scheduling as config.json writes it: what parses, and hostile configs refused with a reason."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from service.repository.ensemble_config import EnsembleConfigError, parse_ensemble_scheduling

NAMES = st.sampled_from(["a", "b", "c", "X", "Y", "Z", "", "ens"])
VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3) | NAMES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
    max_leaves=8,
)
STEP = st.fixed_dictionaries(
    {"model_name": NAMES, "input_map": st.dictionaries(NAMES, NAMES, max_size=2)},
    optional={
        "output_map": st.dictionaries(NAMES, NAMES, max_size=2) | VALUES,
        "model_version": VALUES,
        "extra": VALUES,
    },
)


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(STEP, max_size=5) | VALUES)
def test_any_config_parses_into_runnable_steps_or_is_refused_with_a_reason(steps: Any) -> None:
    try:
        config = parse_ensemble_scheduling({"step": steps}, "ens", ["X"], ["Z"])
    except EnsembleConfigError as e:
        assert str(e)
        return
    available = {"X"}
    for step in config.steps:  # each step's inputs are written before it runs
        assert set(step.reads) <= available, (step, available)
        available |= set(step.writes)
    assert "Z" in available
    assert config.needed(["Z"])


def test_a_diamond_orders_its_steps_and_a_request_runs_only_what_it_needs() -> None:
    steps = [
        {"model_name": "add", "input_map": {"a": "D", "b": "N"}, "output_map": {"c": "Z"}},
        {"model_name": "double", "input_map": {"a": "X"}, "output_map": {"c": "D"}},
        {"model_name": "negate", "input_map": {"a": "X"}, "output_map": {"c": "N"}},
    ]
    config = parse_ensemble_scheduling({"step": steps}, "ens", ["X"], ["Z", "N"])
    assert [s.model_name for s in config.steps] == ["double", "negate", "add"]
    assert [s.model_name for s in config.needed(["N"])] == ["negate"]
    assert [s.position for s in config.needed(["Z"])] == [1, 2, 0]
    assert config.models() == ("double", "negate", "add")


def test_too_many_steps_are_refused_before_any_is_read() -> None:
    try:
        parse_ensemble_scheduling({"step": [None] * 65}, "ens", ["X"], ["Z"])
    except EnsembleConfigError as e:
        assert str(e) == "ensemble_scheduling has 65 steps, the limit is 64"
    else:
        raise AssertionError("65 steps were accepted")
