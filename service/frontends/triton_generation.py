"""Triton's generate fields for generating models, whatever the transport: a checked request from a generate
body (HTTP) or a stream request's parameters (gRPC ModelStreamInfer), as Triton's vLLM backend takes them
(docs/generation.md, "Interfaces"). No aiohttp here: the gRPC front end uses it with HTTP off.

A field may sit at the body's top level (Triton maps them to inputs) or in `parameters`. Besides the
sampling fields of OpenAI's endpoints, `exclude_input_in_output` (false by default for generate, whose
text_output then starts with the prompt, as the vLLM backend's does; a stream sends only the new text)
and `return_finish_reason`, `return_num_input_tokens`, `return_num_output_tokens`, which add
finish_reason, num_input_tokens and num_output_tokens to the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.errors import InvalidArgument, ServingError, quote
from service.frontends.generation import GeneratingModel, Sampling, encoded, generating_model, generation_request
from service.models.generation.capability import GenerationChunk, GenerationRequest, Generator
from service.serving.dataplane import DataPlane

__all__ = ["EXTRAS", "Generation", "generates", "stream_fields", "triton_generation"]


EXTRAS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
FLAGS = ("stream", "exclude_input_in_output", *EXTRAS)
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "stop_token_ids",
            "ignore_eos", "num_beams", "length_penalty")  # fmt: skip
# Parameters of the protocol that every request may carry (priority, timeout) and Triton's own.
PROTOCOL = ("priority", "timeout", "triton_enable_empty_final_response", "binary_data_output")


def generates(plane: DataPlane, model: str, version: str) -> bool:
    """Whether `model` is served and generates (an unknown model: False, its usual path says why)."""
    try:
        return isinstance(plane.model(model, version), Generator)
    except ServingError:
        return False


@dataclass(frozen=True)
class Generation:
    """A checked generate request."""

    model: GeneratingModel
    prompt: str
    request: GenerationRequest
    prepend: bool  # text_output starts with the prompt
    extras: frozenset[str]  # the return_* asked for

    def fields(self, chunk: GenerationChunk, text: str) -> dict[str, Any]:
        """An answer's text_output, and the extras asked for."""
        doc: dict[str, Any] = {"text_output": text}
        if "return_finish_reason" in self.extras and chunk.finish_reason is not None:
            doc["finish_reason"] = chunk.finish_reason
        if "return_num_input_tokens" in self.extras:
            doc["num_input_tokens"] = chunk.prompt_tokens
        if "return_num_output_tokens" in self.extras:
            doc["num_output_tokens"] = chunk.completion_tokens
        return doc


def triton_generation(
    plane: DataPlane, name: str, version: str, text: str, fields: Mapping[str, Any], stream: bool,
    deadline: float | None = None,
) -> Generation:  # fmt: skip
    """The request of a generate body's (or a stream request's) text and fields, each checked by name."""
    model = generating_model(plane, name, version)
    for key in fields:
        if key not in SAMPLING and key not in FLAGS and key not in PROTOCOL:
            raise InvalidArgument(f"field '{key}' is not a parameter of generate (text_input, {', '.join(SAMPLING)})")
    flags = {}
    for key in FLAGS:
        value = fields.get(key)
        if value is not None and not isinstance(value, bool):
            raise InvalidArgument(f"field '{key}' must be true or false")
        flags[key] = value
    exclude = flags["exclude_input_in_output"]
    prepend = not stream if exclude is None else not exclude
    if prepend and stream:
        raise InvalidArgument("field 'exclude_input_in_output': a stream sends only the new text (leave it out)")
    ids = encoded(model, text, "text_input")
    request = generation_request(model, ids, Sampling.of(fields), "text_input", deadline)
    extras = frozenset(k for k in EXTRAS if flags[k])
    return Generation(model, text, request, prepend, extras)


def stream_fields(parameters: Mapping[str, Any], sampling_json: str | None) -> dict[str, Any]:
    """A gRPC stream request's fields: its parameters, then the vLLM backend's sampling_parameters input
    (a JSON object) over them."""
    fields = dict(parameters)
    if sampling_json is not None:
        try:
            extra = json.loads(sampling_json)
        except ValueError:
            raise InvalidArgument("input 'sampling_parameters' must be a JSON object") from None
        if not isinstance(extra, dict):
            raise InvalidArgument("input 'sampling_parameters' must be a JSON object")
        fields |= extra
    for key, value in fields.items():
        if isinstance(value, str) and key in ("stop", "stop_token_ids") and value.startswith("["):
            try:  # a list travels as a string parameter
                fields[key] = json.loads(value)
            except ValueError:
                raise InvalidArgument(f"parameter {quote(key)} is not valid JSON") from None
    return fields
