"""A generation request checked against the model, and one built from v2 parameters (Triton's names).

Every refusal is InvalidArgument naming the field, so a front end answers 400 / INVALID_ARGUMENT, never 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from service.errors import InvalidArgument
from service.models.generation.capability import GenerationDefaults, GenerationRequest

__all__ = ["MAX_BEAMS", "MAX_STOP", "MAX_STOP_CHARS", "check_request", "from_parameters"]

MAX_STOP = 16  # stop strings (and stop token ids) a request may give
MAX_STOP_CHARS = 256
MAX_BEAMS = 16


def check_request(r: GenerationRequest, d: GenerationDefaults, vocab_size: int, name: str) -> None:
    """Raise InvalidArgument, naming the field, for a request the model cannot answer."""
    prompt = len(r.prompt_ids)
    if prompt == 0:
        raise InvalidArgument(f"model '{name}': the prompt is empty (prompt: no tokens)")
    if prompt > d.max_prompt_tokens:
        raise InvalidArgument(
            f"model '{name}': the prompt has {prompt} tokens, more than the model's {d.max_prompt_tokens} (prompt)"
        )
    if any(not 0 <= t < vocab_size for t in r.prompt_ids):
        raise InvalidArgument(f"model '{name}': prompt token ids must be in [0, {vocab_size}) (prompt)")
    if r.max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be at least 1, got {r.max_tokens}")
    _range("temperature", r.temperature, 0.0, math.inf, low_open=True)
    _range("top_p", r.top_p, 0.0, 1.0, low_open=True)
    _range("repetition_penalty", r.repetition_penalty, 0.0, math.inf, low_open=True)
    if r.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {r.top_k}")
    if not 1 <= r.num_beams <= MAX_BEAMS:
        raise InvalidArgument(f"num_beams must be in [1, {MAX_BEAMS}], got {r.num_beams}")
    if r.num_beams > 1 and r.do_sample:
        raise InvalidArgument("num_beams > 1 is beam search: it does not sample (do_sample must be false)")
    if r.num_beams > 1 and r.stop:
        raise InvalidArgument("num_beams > 1 is beam search: it takes stop_token_ids but no stop strings (stop)")
    if not math.isfinite(r.length_penalty):
        raise InvalidArgument(f"length_penalty must be a finite number, got {r.length_penalty}")
    if r.early_stopping not in (True, False, "never"):
        raise InvalidArgument(f'early_stopping must be true, false or "never", got {r.early_stopping!r}')
    if len(r.stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in r.stop):
        raise InvalidArgument(f"stop: at most {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters")
    if len(r.stop_token_ids) > MAX_STOP or any(not 0 <= t < vocab_size for t in r.stop_token_ids):
        raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP} token ids in [0, {vocab_size})")


def _range(field: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = (value > low if low_open else value >= low) and value <= high and math.isfinite(value)
    if not ok:
        raise InvalidArgument(f"{field} must be in {'(' if low_open else '['}{low}, {high}], got {value}")


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"parameter '{key}' must be a number, got {json.dumps(value)[:64]}")
    return float(value)


def _integer(params: dict[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"parameter '{key}' must be an integer, got {json.dumps(value)[:64]}")
    return value


def _strings(value: Any, key: str) -> tuple[str, ...]:
    """A string, or a JSON list of strings (v2 parameters are scalars: a list comes as its JSON text)."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument(f"parameter '{key}': not a JSON list of strings") from None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidArgument(f"parameter '{key}' must be a string or a list of strings, got {json.dumps(value)[:64]}")


def _ids(value: Any, key: str) -> tuple[int, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument(f"parameter '{key}': not a JSON list of token ids") from None
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidArgument(f"parameter '{key}' must be a token id or a list of them, got {json.dumps(value)[:64]}")
    return tuple(values)


KNOWN = ("max_tokens", "temperature", "top_p", "top_k", "seed", "num_beams", "length_penalty", "early_stopping",
         "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "do_sample")  # fmt: skip


def from_parameters(prompt: tuple[int, ...], params: dict[str, Any], d: GenerationDefaults,
                    deadline: float | None) -> GenerationRequest:  # fmt: skip
    """A request from v2 parameters (Triton's generate names: max_tokens, temperature, ...); a temperature
    above 0 samples (0: greedy), as vLLM's backend reads it. Parameters it does not know are left to others."""
    temperature = _number(params, "temperature", d.temperature if d.do_sample else 0.0)
    if temperature < 0:
        raise InvalidArgument(f"parameter 'temperature' must be >= 0, got {temperature}")
    sample = params.get("do_sample", temperature > 0)
    if not isinstance(sample, bool):
        raise InvalidArgument("parameter 'do_sample' must be a boolean")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument(f"parameter 'seed' must be an integer, got {json.dumps(seed)[:64]}")
    ignore = params.get("ignore_eos", False)
    if not isinstance(ignore, bool):
        raise InvalidArgument("parameter 'ignore_eos' must be a boolean")
    early = params.get("early_stopping", d.early_stopping)
    if early not in (True, False, "never"):
        raise InvalidArgument(f"parameter 'early_stopping' must be true, false or \"never\", got {early!r:.32}")
    return GenerationRequest(
        prompt_ids=prompt,
        max_tokens=_integer(params, "max_tokens", d.max_new_tokens),
        do_sample=sample,
        temperature=temperature if sample and temperature > 0 else 1.0,
        top_p=_number(params, "top_p", d.top_p),
        top_k=_integer(params, "top_k", d.top_k if sample else 0),
        seed=seed,
        num_beams=_integer(params, "num_beams", 1 if sample else d.num_beams),
        length_penalty=_number(params, "length_penalty", d.length_penalty),
        early_stopping=early,
        repetition_penalty=_number(params, "repetition_penalty", d.repetition_penalty),
        stop=_strings(params["stop"], "stop") if "stop" in params else (),
        stop_token_ids=_ids(params["stop_token_ids"], "stop_token_ids") if "stop_token_ids" in params else (),
        ignore_eos=ignore,
        deadline=deadline,
    )
