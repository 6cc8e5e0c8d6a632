"""Triton's generate extension and decoupled ModelStreamInfer for generating models, as Triton's vLLM backend
answers them (docs/generation.md, "Interfaces").

    POST /v2/models/M/generate         {"text_input", "parameters": {"max_tokens", "temperature", ...}}
                                        -> {"model_name", "model_version", "text_output"}
    POST /v2/models/M/generate_stream  the same, as server-sent events: one a chunk, each its new text
    gRPC ModelStreamInfer              text_input (BYTES [1]) -> one response a chunk (text_output), the
                                        last flagged by the parameter triton_final_response

A field may sit at the body's top level (Triton maps them to inputs) or in `parameters`. Besides the
sampling fields of OpenAI's endpoints, `exclude_input_in_output` (false by default for generate, whose
text_output then starts with the prompt, as the vLLM backend's does; a stream sends only the new text)
and `return_finish_reason`, `return_num_input_tokens`, `return_num_output_tokens`, which add
finish_reason, num_input_tokens and num_output_tokens to the answer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from service.errors import InvalidArgument, ServingError, quote
from service.frontends.generation import (
    GeneratingModel,
    Sampling,
    chunks,
    encoded,
    generating_model,
    generation_request,
)
from service.frontends.statuses import http_status
from service.models.generation.capability import GenerationChunk, GenerationRequest, Generator
from service.serving.dataplane import DataPlane

__all__ = ["EXTRAS", "Generation", "TritonGenerate", "generates", "triton_generation"]

EXTRAS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
FLAGS = ("stream", "exclude_input_in_output", *EXTRAS)
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "stop_token_ids",
            "ignore_eos")  # fmt: skip
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


def _body_fields(doc: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(text_input, id, fields) of a generate body: `parameters`' entries, then the top level's."""
    text = doc.get("text_input")
    if not isinstance(text, str):
        raise InvalidArgument("field 'text_input' is required: the prompt, a string")
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("field 'id' must be a string")
    params = doc.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument("field 'parameters' must be an object")
    top = {k: v for k, v in doc.items() if k not in ("text_input", "id", "parameters")}
    return text, request_id, params | top


def _error(e: ServingError) -> web.Response:
    return web.json_response({"error": e.message}, status=http_status(e))


class TritonGenerate:
    """generate and generate_stream of a generating model, over one data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def _head(self, g: Generation, request_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"model_name": g.model.name, "model_version": g.model.version}
        if request_id:
            doc["id"] = request_id
        return doc

    async def generate(self, doc: dict[str, Any], model: str, version: str) -> web.Response:
        text, request_id, fields = _body_fields(doc)
        g = triton_generation(self.plane, model, version, text, fields, stream=False)
        said: list[str] = []
        last: GenerationChunk | None = None
        async with contextlib.aclosing(chunks(self.plane, g.model, g.request)) as answer:
            async for chunk in answer:
                said.append(chunk.text)
                last = chunk
        assert last is not None  # the last chunk carries finish_reason
        output = (g.prompt if g.prepend else "") + "".join(said)
        return web.json_response(self._head(g, request_id) | g.fields(last, output))

    async def generate_stream(
        self, request: web.BaseRequest, doc: dict[str, Any], model: str, version: str
    ) -> web.StreamResponse:
        """One event a chunk of new text (the last with the extras asked for). Until the first chunk the answer
        can still be an error status; a later failure is an error event, and the stream ends."""
        text, request_id, fields = _body_fields(doc)
        g = triton_generation(self.plane, model, version, text, fields, stream=True)
        async with contextlib.aclosing(chunks(self.plane, g.model, g.request)) as answer:
            try:
                first = await anext(answer)
            except ServingError as e:
                return _error(e)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await self._events(response, g, request_id, first, answer)
            except ConnectionError:  # the client left mid-stream: the sequence is closed (aclosing)
                return response
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response

    async def _events(
        self,
        response: web.StreamResponse,
        g: Generation,
        request_id: str,
        first: GenerationChunk,
        rest: AsyncIterator[GenerationChunk],
    ) -> None:
        chunk = first
        while True:
            if chunk.text or chunk.finish_reason is not None:
                event = self._head(g, request_id) | g.fields(chunk, chunk.text)
                await response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
            if chunk.finish_reason is not None:
                return
            try:
                chunk = await anext(rest)
            except ServingError as e:
                await response.write(f"data: {json.dumps({'error': e.message})}\n\n".encode())
                return
            except StopAsyncIteration:
                return


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
