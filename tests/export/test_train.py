"""Training survives interruptions: a run stopped and resumed ends with the weights of one that was not."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from export.train import TrainConfig, train  # noqa: E402

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
