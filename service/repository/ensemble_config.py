"""An ensemble's steps, as config.json writes them in Triton's `ensemble_scheduling`.

    "ensemble_scheduling": {"step": [
        {"model_name": "preprocess", "model_version": -1,
         "input_map": {"RAW": "IMAGE"}, "output_map": {"PIXELS": "pixels"}},
        {"model_name": "classifier", "model_version": -1,
         "input_map": {"input": "pixels"}, "output_map": {"scores": "SCORES"}}]}

A map goes from the step model's tensor (the key) to an ensemble tensor (the value): the ensemble's own
inputs and outputs, or an internal tensor one step writes and later ones read. What can be checked
without the step models is checked here: each tensor written once, each read tensor written by someone,
each ensemble output written, each ensemble input read, and no cycle. The steps are kept in an order in
which each comes after those it reads from; the checks against the step models' own tensors are made
when the ensemble loads (service/models/ensemble/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_STEPS", "EnsembleConfig", "EnsembleConfigError", "EnsembleStep", "parse_ensemble_scheduling"]

MAX_STEPS = 64  # steps of one ensemble, at most (each is a request to a model)


class EnsembleConfigError(ValueError):
    """An ensemble_scheduling that cannot run; the message names the step and the tensor."""


@dataclass(frozen=True)
class EnsembleStep:
    """One step: a request to `model_name` (version `model_version`, "" for the newest ready one)."""

    model_name: str
    model_version: str
    input_map: tuple[tuple[str, str], ...]  # (the step model's input, the ensemble tensor it reads)
    output_map: tuple[tuple[str, str], ...]  # (the step model's output, the ensemble tensor it writes)
    position: int  # where config.json lists it (messages count steps from 0, as config.json is indexed)

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(tensor for _, tensor in self.input_map)

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(tensor for _, tensor in self.output_map)

    def describe(self) -> str:
        version = f" version {self.model_version}" if self.model_version else ""
        return f"step {self.position} (model '{self.model_name}'{version})"


@dataclass(frozen=True)
class EnsembleConfig:
    steps: tuple[EnsembleStep, ...]  # each after the steps whose outputs it reads

    def models(self) -> tuple[str, ...]:
        """The step models' names, each once, in step order."""
        return tuple(dict.fromkeys(s.model_name for s in self.steps))

    def needed(self, outputs: list[str]) -> tuple[EnsembleStep, ...]:
        """The steps that lead to `outputs`, in order: a request asking for fewer outputs runs fewer steps."""
        wanted, chosen = set(outputs), []
        for step in reversed(self.steps):
            if wanted & set(step.writes):
                chosen.append(step)
                wanted |= set(step.reads)
        return tuple(reversed(chosen))


def _name(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value:
        raise EnsembleConfigError(f"{at} must be a non-empty string, got {value!r:.64}")
    return value


def _version(value: Any, at: str) -> str:
    """Triton's model_version: -1 (the newest ready version, the default) or a version number."""
    if value is None:
        return ""
    number = None
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 19:
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    if number is None or number < -1:
        raise EnsembleConfigError(f"{at} must be -1 (the newest version) or a version number, got {value!r:.64}")
    return "" if number == -1 else str(number)


def _tensor_map(raw: Any, at: str, required: bool) -> tuple[tuple[str, str], ...]:
    if raw is None and not required:
        return ()
    if not isinstance(raw, dict) or (required and not raw):
        need = "a non-empty" if required else "a"
        raise EnsembleConfigError(
            f"{at} must be {need} JSON object of model tensor -> ensemble tensor, got {raw!r:.64}"
        )
    return tuple((_name(k, f"{at} key"), _name(v, f"{at}.{k}")) for k, v in raw.items())


def _step(raw: Any, position: int) -> EnsembleStep:
    at = f"ensemble_scheduling.step[{position}]"
    if not isinstance(raw, dict):
        raise EnsembleConfigError(f"{at} must be a JSON object, got {raw!r:.64}")
    known = {"model_name", "model_version", "input_map", "output_map"}
    if set(raw) - known:
        raise EnsembleConfigError(f"{at}: unknown setting(s) {sorted(set(raw) - known)}; known: {sorted(known)}")
    return EnsembleStep(
        model_name=_name(raw.get("model_name"), f"{at}.model_name"),
        model_version=_version(raw.get("model_version"), f"{at}.model_version"),
        input_map=_tensor_map(raw.get("input_map"), f"{at}.input_map", required=False),
        output_map=_tensor_map(raw.get("output_map"), f"{at}.output_map", required=True),
        position=position,
    )


def _ordered(steps: list[EnsembleStep], inputs: set[str]) -> tuple[EnsembleStep, ...]:
    """`steps` so that each comes after the steps it reads from; an EnsembleConfigError naming a step that
    reads what no one writes, or steps that wait on each other."""
    written = {t: s for s in steps for t in s.writes}
    for s in steps:
        for tensor in s.reads:
            if tensor not in inputs and tensor not in written:
                raise EnsembleConfigError(
                    f"{s.describe()} reads ensemble tensor '{tensor}', which is neither an input of the ensemble "
                    "nor written by any step"
                )
    available, order, waiting = set(inputs), [], list(steps)
    while waiting:
        ready = [s for s in waiting if set(s.reads) <= available]
        if not ready:
            stuck = ", ".join(s.describe() for s in waiting)
            raise EnsembleConfigError(f"the steps form a cycle, each waiting for another's output: {stuck}")
        for s in ready:
            waiting.remove(s)
            order.append(s)
            available |= set(s.writes)
    return tuple(order)


def parse_ensemble_scheduling(raw: Any, name: str, inputs: list[str], outputs: list[str]) -> EnsembleConfig:
    """config.json's ensemble_scheduling for the ensemble `name` whose declared tensors are `inputs` and
    `outputs`; an EnsembleConfigError saying what is wrong."""
    if not isinstance(raw, dict) or set(raw) != {"step"}:
        raise EnsembleConfigError(f'ensemble_scheduling must be {{"step": [...]}}, got {raw!r:.64}')
    listed = raw["step"]
    if not isinstance(listed, list) or not listed:
        raise EnsembleConfigError(f"ensemble_scheduling.step must be a non-empty list of steps, got {listed!r:.64}")
    if len(listed) > MAX_STEPS:
        raise EnsembleConfigError(f"ensemble_scheduling has {len(listed)} steps, the limit is {MAX_STEPS}")
    steps = [_step(s, i) for i, s in enumerate(listed)]
    for s in steps:
        if s.model_name == name:
            raise EnsembleConfigError(f"{s.describe()} names the ensemble itself")
    if not inputs or not outputs:
        raise EnsembleConfigError("an ensemble declares its inputs and outputs (config.json 'inputs' and 'outputs')")
    writers: dict[str, EnsembleStep] = {}
    for s in steps:
        for model_tensor, tensor in s.output_map:
            if tensor in inputs:
                raise EnsembleConfigError(
                    f"{s.describe()} writes '{tensor}' ({model_tensor}), which is an input of the ensemble"
                )
            if tensor in writers:
                raise EnsembleConfigError(
                    f"ensemble tensor '{tensor}' is written twice: by {writers[tensor].describe()} and {s.describe()}"
                )
            writers[tensor] = s
    for tensor in outputs:
        if tensor not in writers:
            raise EnsembleConfigError(f"ensemble output '{tensor}' is written by no step")
    read = {t for s in steps for t in s.reads}
    unread = [t for t in inputs if t not in read]
    if unread:
        raise EnsembleConfigError(f"ensemble input(s) {unread} are read by no step")
    return EnsembleConfig(_ordered(steps, set(inputs)))
