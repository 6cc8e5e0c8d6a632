"""How a request's sampling fields become a GenerationRequest (service/frontends/generation.py): each field
left out takes the model's default (generation_config.json, as vLLM takes it), each given one is checked
and a bad one refused naming it, whatever the wire it came on."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from service.errors import InvalidArgument
from service.frontends.generation import Sampling, generation_request
from service.frontends.grpc_generate import BOOL_INPUTS
from service.frontends.triton_generation import stream_fields
from service.models.generation.capability import GenerationDefaults

DEFAULTS = GenerationDefaults(max_positions=32, max_prompt_tokens=30, max_new_tokens=20, eos_token_ids=(2,))


@dataclass
class _Defaults:
    """What generation_request reads of a model: its defaults (the rest of the Generator is not used)."""

    defaults: GenerationDefaults


def _request(fields: dict[str, Any], defaults: GenerationDefaults = DEFAULTS, prompt: int = 4, **kw: Any) -> Any:
    return generation_request(_Defaults(defaults), list(range(prompt)), Sampling.of(fields), **kw)  # type: ignore[arg-type]


def test_fields_left_out_take_the_models_defaults() -> None:
    r = _request({})
    assert (r.max_tokens, r.do_sample, r.num_beams, r.repetition_penalty) == (20, False, 1, 1.0)
    sampled = replace(DEFAULTS, do_sample=True, temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.2)
    r = _request({}, sampled)
    assert (r.do_sample, r.temperature, r.top_p, r.top_k, r.repetition_penalty) == (True, 0.7, 0.9, 40, 1.2)
    assert _request({}, replace(DEFAULTS, num_beams=4)).num_beams == 1  # no beam search here, as vLLM


def test_temperature_zero_is_greedy_and_a_sampling_field_samples() -> None:
    sampled = replace(DEFAULTS, do_sample=True, temperature=0.7)
    assert not _request({"temperature": 0}, sampled).do_sample
    r = _request({"top_p": 0.5})
    assert r.do_sample and r.top_p == 0.5 and r.temperature == 1.0
    assert _request({"top_k": -1}).top_k == 0  # vLLM's "no top-k"
    assert _request({"seed": 5}, seed_offset=2).seed == 7 and not _request({"seed": 5}).do_sample


def test_max_tokens_within_the_positions() -> None:
    assert _request({}, prompt=20).max_tokens == 12  # left out: what the 32 positions leave
    assert _request({"max_tokens": 12}, prompt=20).max_tokens == 12
    with pytest.raises(InvalidArgument, match=r"field .max_tokens. is 13: .* \(at most 12\)"):
        _request({"max_tokens": 13}, prompt=20)
    unbounded = replace(DEFAULTS, max_positions=0)
    assert _request({"max_tokens": 1000}, unbounded, prompt=20).max_tokens == 1000
    with pytest.raises(InvalidArgument, match="field 'prompt' has 31 tokens, the model takes 30 at most"):
        _request({}, prompt=31)
    with pytest.raises(InvalidArgument, match="field 'text_input' is empty"):
        _request({}, prompt=0, prompt_field="text_input")


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": 1}, "stop"),
        ({"stop": ["a", 2]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 257}, "stop"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_a_bad_field_is_refused_by_name(fields: dict[str, Any], names: str) -> None:
    with pytest.raises(InvalidArgument, match=f"field '{names}'"):
        _request(fields)


def test_a_field_is_named_as_its_wire_names_it() -> None:
    sampling = Sampling.of({"max_completion_tokens": 0}, {"max_tokens": "max_completion_tokens"})
    with pytest.raises(InvalidArgument, match="field 'max_completion_tokens' must be at least 1"):
        generation_request(_Defaults(DEFAULTS), [1, 2], sampling)  # type: ignore[arg-type]


def test_stop_strings_and_ids_pass_through() -> None:
    r = _request({"stop": "\n", "stop_token_ids": [5, 6], "ignore_eos": True, "max_tokens": 3.0})
    assert (r.stop, r.stop_token_ids, r.ignore_eos, r.max_tokens) == (("\n",), (5, 6), True, 3)


def test_grpc_fields_from_parameters_and_sampling_parameters() -> None:
    fields = stream_fields({"max_tokens": 4, "stop": '["a", "b"]'}, '{"temperature": 0, "max_tokens": 6}')
    assert fields == {"max_tokens": 6, "stop": ["a", "b"], "temperature": 0}
    with pytest.raises(InvalidArgument, match="sampling_parameters"):
        stream_fields({}, "[1]")
    assert "stream" in BOOL_INPUTS
