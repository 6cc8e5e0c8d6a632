"""Triton's generate extension over HTTP for generating models, as Triton's vLLM backend answers it
(docs/generation.md, "Interfaces"); the fields are read by `triton_generation`.

    POST /v2/models/M/generate         {"text_input", "parameters": {"max_tokens", "temperature", ...}}
                                        -> {"model_name", "model_version", "text_output"}
    POST /v2/models/M/generate_stream  the same, as server-sent events: one a chunk, each its new text

gRPC's ModelStreamInfer for these models is `grpc_generate`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from service.errors import InvalidArgument, ServingError
from service.frontends.generation import chunks
from service.frontends.statuses import http_status
from service.frontends.triton_generation import Generation, triton_generation
from service.models.generation.capability import GenerationChunk
from service.serving.dataplane import DataPlane

__all__ = ["TritonGenerate"]


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
