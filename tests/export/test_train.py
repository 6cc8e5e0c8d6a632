"""Training survives interruptions: a run stopped and resumed ends with the weights of one that was not."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from export import data  # noqa: E402
from export.train import Teachers, TrainConfig, learning_rate, train  # noqa: E402

TINY = TrainConfig(
    d_model=32, h=2, n_encoder=1, n_decoder=1, d_ff=64, max_tokens=400, epochs=2, train_words=300,
    dev_words=20, warmup=5, decay_start=10, threads=1, bf16=False, checkpoint_minutes=1e6,
)  # fmt: skip


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    whole = replace(TINY, out=str(tmp_path / "whole"))
    train(whole)
    cut = replace(TINY, out=str(tmp_path / "cut"))
    train(replace(cut, steps=7))  # stops mid-epoch, as a killed run would at its last checkpoint
    stopped = torch.load(tmp_path / "cut" / "last.pt", weights_only=False)
    assert stopped["step"] == 7 and stopped["epoch"] == 0 and stopped["position"][0] == 7
    train(cut, resume=True)

    a = torch.load(tmp_path / "whole" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] > 7 and a["epoch"] == b["epoch"] == 2
    for name, weight in a["model"].items():
        assert torch.equal(weight, b["model"][name]), f"{name} differs after resuming"
    assert [h["loss"] for h in a["history"]] == pytest.approx([h["loss"] for h in b["history"]])

    run = tmp_path / "cut"
    assert json.loads((run / "config.json").read_text())["d_model"] == 32
    epochs = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2] and all(0 <= e["wer"] <= 1 for e in epochs)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run of 3 epochs keeping its last 2 (evaluated every second epoch, and after the last)."""
    out = tmp_path_factory.mktemp("teacher")
    train(replace(TINY, out=str(out), epochs=3, keep_epochs=2, eval_every=2))
    return out


def test_the_last_epochs_are_kept_and_averaged(teacher: Path) -> None:
    kept = sorted(p.name for p in teacher.glob("epoch-*.pt"))
    assert kept == ["epoch-002.pt", "epoch-003.pt"]
    a, b, mean = (torch.load(teacher / name, weights_only=False) for name in (*kept, "averaged.pt"))
    for name, weight in mean["model"].items():
        assert torch.allclose(weight, (a["model"][name] + b["model"][name]) / 2), name
    assert a["optimizer"] is None  # kept epochs are weights only
    lines = [json.loads(line) for line in (teacher / "history.jsonl").read_text().splitlines()]
    assert [line.get("epoch") for line in lines] == [2, 3, None]  # evaluated epochs, then the average
    assert lines[-1]["averaged"] == kept and mean["dev"]["wer"] == lines[-1]["wer"]


class Ticks:
    """A clock that advances `tick` seconds each time it is read: a run's timing without its speed."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_timed_run_stops_on_time_after_a_cool_down_on_the_clock(tmp_path: Path) -> None:
    timed = replace(TINY, out=str(tmp_path), epochs=10_000, hours=1.5 / 3600, cooldown_minutes=1 / 60)
    clock = Ticks(0.01)  # a few reads a step: the budget lasts some 50 steps, a few epochs
    train(timed, clock=clock)
    state = torch.load(tmp_path / "last.pt", weights_only=False)
    # It stopped at the first check past the budget: within a couple of reads of 1.5 s, mid-run.
    assert 1.5 <= state["elapsed_s"] < 1.5 + 5 * clock.tick, state["elapsed_s"]
    assert 0 < state["epoch"] < 10_000
    peak = learning_rate(10_000, timed)  # past warm-up; the decay is the same in the three calls
    assert learning_rate(10_000, timed, seconds_left=1.0) == peak  # the cool-down is the last second
    assert learning_rate(10_000, timed, seconds_left=0.5) == pytest.approx(peak / 2)
    assert learning_rate(10_000, timed, seconds_left=0) == pytest.approx(peak * 0.02)


def test_a_run_started_from_another_has_its_weights_and_lists_it(teacher: Path, tmp_path: Path) -> None:
    # A learning rate of 0 trains nothing: the weights stay the ones started from.
    train(replace(TINY, out=str(tmp_path), init=str(teacher / "averaged.pt"), lr=0.0, epochs=1))
    start = torch.load(teacher / "averaged.pt", weights_only=False)
    state = torch.load(tmp_path / "last.pt", weights_only=False)
    for name, weight in start["model"].items():
        assert torch.equal(weight, state["model"][name]), name
    assert [run["run"] for run in state["lineage"]] == [str(teacher)]
    assert state["lineage"][0]["steps"] == start["step"] and "CPU" in state["hardware"]
    from export.onnx_export import _earlier_runs

    card = _earlier_runs(state)  # the card names each run and its recipe's folders, never their paths
    assert [run["run"] for run in card["continues"]] == [teacher.name]
    assert card["continues"][0]["recipe"]["out"] == teacher.name
    assert [{k: v for k, v in run.items() if k not in ("run", "recipe")} for run in card["continues"]] == [
        {k: v for k, v in run.items() if k not in ("run", "recipe")} for run in state["lineage"]
    ]
    assert card["total_hours"] == pytest.approx((state["elapsed_s"] + start["elapsed_s"]) / 3600, abs=1e-3)


def test_a_distilled_student_learns_its_teachers_distribution(teacher: Path, tmp_path: Path) -> None:
    """Two runs from the teacher's weights on the same batches: taught by the teacher alone, the student
    keeps its distribution (the distillation loss is at its minimum there); taught by the gold targets
    alone, it moves away from it."""
    start = teacher / "epoch-003.pt"
    taught = replace(TINY, init=str(start), epochs=3, lr=3e-3)
    train(replace(taught, out=str(tmp_path / "distilled"), teachers=str(start), distill_weight=1.0))
    train(replace(taught, out=str(tmp_path / "gold")))
    from export.checkpoint import load_checkpoint

    loaded = load_checkpoint(start)
    words = data.read_split("train")[: TINY.train_words]  # the words both were trained on
    examples = data.examples(data.load_lexicon(), words, loaded.graphemes, loaded.phonemes)
    src, tgt = (torch.from_numpy(a) for a in next(data.token_batches(examples, 10_000)))
    soft = Teachers([start], torch.device("cpu"), loaded.phonemes).distribution(src, tgt[:, :-1], bf16=False)
    real = tgt[:, 1:] != 0

    def divergence(run: str) -> float:
        """KL(teacher || student) per target token."""
        student = load_checkpoint(tmp_path / run / "last.pt").model
        with torch.no_grad():
            log_q = student(src, tgt[:, :-1]).log_softmax(-1)
        return float((soft * (soft.clamp_min(1e-12).log() - log_q)).sum(-1)[real].mean())

    assert divergence("distilled") < 0.2 * divergence("gold")
