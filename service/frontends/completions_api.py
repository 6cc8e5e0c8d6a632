"""OpenAI's completions and chat completions for generating models, on the REST front end's port
(docs/generation.md, "Interfaces").

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                                 "stream", "stream_options", ...} -> choices of text
    POST /v1/chat/completions   {"model", "messages", "max_completion_tokens", ...} -> choices of messages

A prompt is a string, a list of strings, a list of token ids or a list of such lists; chat messages are
rendered with the model's chat template (service/models/generation/chat.py) and encoded without adding
special tokens. Every choice is one sequence of the model's engine: the choices of a request, and the
requests of every client, decode together. Fields left out take the model's defaults (its
generation_config.json); vLLM's extras top_k, repetition_penalty, stop_token_ids and ignore_eos are taken;
a field qkv does not support is refused (400 naming it) unless it is set to what it does when left out.
With `stream`, the answer is server-sent events in OpenAI's chunk format, `data: [DONE]` last, and usage
on a last chunk of its own with `stream_options.include_usage`. Errors are OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from service.errors import Internal, InvalidArgument, ServingError
from service.frontends.generation import (
    CHARS_PER_TOKEN,
    GeneratingModel,
    Sampling,
    chunks,
    encoded,
    generating_model,
    generation_request,
)
from service.frontends.rest_codec import parse_json
from service.frontends.statuses import http_status
from service.models.generation.capability import GenerationChunk, GenerationRequest
from service.models.generation.chat import chat_template
from service.serving.dataplane import DataPlane

__all__ = ["ENDPOINTS", "CompletionsApi"]

Body = Callable[[web.BaseRequest], Awaitable[bytes]]
Handler = Callable[[web.BaseRequest, str, str], Awaitable[web.StreamResponse]]
# path -> (the metric's endpoint label, method)
ENDPOINTS = {
    ("v1", "completions"): ("openai_completions", "POST"),
    ("v1", "chat", "completions"): ("openai_chat_completions", "POST"),
}
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request (prompts x n)
MAX_MESSAGES = 1024
ROLES = ("system", "developer", "user", "assistant")
log = logging.getLogger("qkv.http")

# Fields both endpoints take; then each one's own. vLLM's extras: top_k, repetition_penalty, stop_token_ids,
# ignore_eos, length_penalty; and num_beams (a beam search, answered in one chunk). `user`, `metadata`,
# `store` and `parallel_tool_calls` change nothing here and are ignored.
COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "top_k", "repetition_penalty", "stop_token_ids", "ignore_eos", "num_beams", "length_penalty",
}  # fmt: skip
FIELDS = {
    "openai_completions": COMMON | {"prompt"},
    "openai_chat_completions": COMMON
    | {"messages", "max_completion_tokens", "add_generation_prompt", "metadata", "store", "parallel_tool_calls"},
}
# Fields qkv does not support, taken only when set to what leaving them out does (OpenAI's clients send some).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v in (None, False),
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v in (None, 0),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "best_of": lambda v: v in (None, 1),
    "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
}


def _openai_error(e: ServingError) -> web.Response:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}, param the field a message names."""
    status = http_status(e)
    kind = "invalid_request_error" if status < 500 else "server_error"
    param = e.message.split("'")[1] if e.message.startswith("field '") else None
    body = {"error": {"message": e.message, "type": kind, "param": param, "code": e.code.lower()}}
    return web.json_response(body, status=status)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _event(doc: Any) -> bytes:
    return f"data: {_dumps(doc)}\n\n".encode()


def _check_fields(doc: dict[str, Any], endpoint: str) -> None:
    for key, value in doc.items():
        if key in FIELDS[endpoint]:
            continue
        neutral = NEUTRAL.get(key)
        if neutral is None:
            raise InvalidArgument(f"field '{key}' is not supported by qkv's {endpoint.removeprefix('openai_')}")
        if not neutral(value):
            raise InvalidArgument(f"field '{key}' is not supported by qkv: leave it out (or null)")


def _bool(doc: dict[str, Any], name: str, default: bool) -> bool:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"field '{name}' must be true or false")
    return value


def _prompts(model: GeneratingModel, value: Any, n: int) -> list[list[int]]:
    """A completion's prompt: a string, a list of strings, a list of token ids or a list of such lists; at most
    MAX_CHOICES choices in all (counted before any is encoded)."""
    if isinstance(value, str):
        return [encoded(model, value, "prompt")]
    if not isinstance(value, list) or not value:
        raise InvalidArgument("field 'prompt' must be a string, a list of strings or a list of token ids")
    count = 1 if not isinstance(value[0], list | str) else len(value)
    if count * n > MAX_CHOICES:
        raise InvalidArgument(f"field 'prompt': {count} prompts x n={n} choices, the limit is {MAX_CHOICES}")
    if all(isinstance(v, str) for v in value):
        return [encoded(model, v, "prompt") for v in value]
    rows = value if isinstance(value[0], list) else [value]
    for row in rows:
        if not isinstance(row, list) or not row or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise InvalidArgument("field 'prompt' must be a string, a list of strings or a list of token ids")
        if min(row) < 0 or max(row) >= 2**31:
            raise InvalidArgument("field 'prompt' holds a token id outside [0, 2^31)")
    return [list(row) for row in rows]


def _content(message: dict[str, Any], i: int) -> str | None:
    """A message's content: a string, or OpenAI's list of text parts (joined by newlines, as vLLM joins them)."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"field 'messages': message {i} has a content part that is not text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidArgument(f"field 'messages': message {i}'s content must be a string or a list of text parts")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument("field 'messages' must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise InvalidArgument(f"field 'messages' has {len(value)} messages, the limit is {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InvalidArgument(f"field 'messages': message {i} must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"field 'messages': message {i}'s role must be one of {', '.join(ROLES)}")
        content = _content(m, i)
        if content is None and role != "assistant":
            raise InvalidArgument(f"field 'messages': message {i} ({role}) has no content")
        message: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


@dataclass
class _Choice:
    """One choice's answer so far."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class _Call:
    """A checked request: what each choice generates, and how the answer is written."""

    endpoint: str
    model: GeneratingModel
    requests: list[GenerationRequest]  # choice i's
    prompt_tokens: int  # each prompt once, whatever n
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.endpoint == "openai_chat_completions"

    def head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model.name}  # fmt: skip

    def usage(self, choices: list[_Choice]) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}  # fmt: skip


class CompletionsApi:
    """The handlers, over one data plane; `body` reads a request's body within the server's limits."""

    def __init__(self, plane: DataPlane, body: Body) -> None:
        self.plane, self.body = plane, body

    def route(self, parts: tuple[str, ...]) -> tuple[str, str, Handler] | None:
        """(endpoint, method, handler) of a path, or None when it is none of these."""
        found = ENDPOINTS.get(parts)
        if found is None:
            return None
        endpoint = found[0]

        async def handler(request: web.BaseRequest, model: str, version: str) -> web.StreamResponse:
            return await self._answer(request, endpoint)

        return endpoint, found[1], handler

    async def _answer(self, request: web.BaseRequest, endpoint: str) -> web.StreamResponse:
        try:
            call = self._call(parse_json(await self.body(request)), endpoint)
            if call.stream:
                return await self._stream(request, call)
            return await self._whole(call)
        except ServingError as e:
            return _openai_error(e)

    # --- the request ----------------------------------------------------------------------------------

    def _call(self, doc: dict[str, Any], endpoint: str) -> _Call:
        _check_fields(doc, endpoint)
        name = doc.get("model")
        if not isinstance(name, str):
            raise InvalidArgument("field 'model' is required: a string, the name of a served generating model")
        model = generating_model(self.plane, name)
        n = doc.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise InvalidArgument(f"field 'n' must be an integer from 1 to {MAX_N}")
        if doc.get("best_of") not in (None, 1, n):
            raise InvalidArgument("field 'best_of' is not supported by qkv: leave it out (or equal to n)")
        stream = _bool(doc, "stream", False)
        options = doc.get("stream_options")
        if options is not None and not stream:
            raise InvalidArgument("field 'stream_options' is allowed only with stream: true")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise InvalidArgument("field 'stream_options' must be an object with include_usage (true or false)")
        include_usage = _bool(options or {}, "include_usage", False)
        if endpoint == "openai_chat_completions":
            if doc.get("max_completion_tokens") is not None and doc.get("max_tokens") is not None:
                raise InvalidArgument("field 'max_tokens': give max_completion_tokens or max_tokens, not both")
            names = {"max_tokens": "max_completion_tokens"} if doc.get("max_completion_tokens") is not None else {}
            prompts, prompt_field = [self._chat_prompt(model, doc)], "messages"
        else:
            if "prompt" not in doc:
                raise InvalidArgument("field 'prompt' is required")
            names, prompts, prompt_field = {}, _prompts(model, doc["prompt"], n), "prompt"
        sampling = Sampling.of(doc, names)
        requests = [
            generation_request(model, ids, sampling, prompt_field, seed_offset=j) for ids in prompts for j in range(n)
        ]
        return _Call(endpoint, model, requests, sum(map(len, prompts)), stream, include_usage)

    def _chat_prompt(self, model: GeneratingModel, doc: dict[str, Any]) -> list[int]:
        messages = _messages(doc.get("messages"))
        try:
            template = chat_template(model.folder)
        except ValueError as e:
            raise InvalidArgument(f"field 'model': {e}") from None
        if template is None:
            raise InvalidArgument(
                f"field 'model': {model.name} has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json): use /v1/completions"
            )
        if sum(len(m["content"]) for m in messages) > model.defaults.max_prompt_tokens * CHARS_PER_TOKEN:
            encoded(model, "".join(m["content"] for m in messages), "messages")  # refused, unrendered
        text = template.render(messages, _bool(doc, "add_generation_prompt", True))
        return encoded(model, text, "messages", special_tokens=False)

    # --- the answer -----------------------------------------------------------------------------------

    async def _run(self, call: _Call, queue: asyncio.Queue[tuple[int, GenerationChunk | ServingError]]) -> None:
        """Every choice at once, each chunk put on `queue` as (choice, chunk), or (choice, error) and the end."""

        async def one(i: int, request: GenerationRequest) -> None:
            try:
                async with contextlib.aclosing(chunks(self.plane, call.model, request)) as answer:
                    async for chunk in answer:
                        await queue.put((i, chunk))
            except ServingError as e:
                await queue.put((i, e))
            except Exception:  # a fault of the server's: logged, and the request answered with it
                log.exception("a generation failed inside the server")
                await queue.put((i, Internal("the server failed on this request: its log has the details")))

        async with asyncio.TaskGroup() as group:
            for i, request in enumerate(call.requests):
                group.create_task(one(i, request))

    async def _whole(self, call: _Call) -> web.Response:
        choices = [_Choice(i, len(r.prompt_ids)) for i, r in enumerate(call.requests)]
        queue: asyncio.Queue[tuple[int, GenerationChunk | ServingError]] = asyncio.Queue()
        runner = asyncio.create_task(self._run(call, queue))
        try:
            while any(c.finish_reason is None for c in choices):
                i, chunk = await queue.get()
                if isinstance(chunk, ServingError):
                    raise chunk
                _add(choices[i], chunk)
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        doc = call.head(stream=False)
        doc["choices"] = [self._whole_choice(call, c) for c in choices]
        doc["usage"] = call.usage(choices)
        return web.Response(text=_dumps(doc), content_type="application/json")

    @staticmethod
    def _whole_choice(call: _Call, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        if call.chat:
            return {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": c.finish_reason}  # fmt: skip
        return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}

    async def _stream(self, request: web.BaseRequest, call: _Call) -> web.StreamResponse:
        """Server-sent events, each chunk of each choice as it comes. Until the first chunk the answer can
        still be an error status; a later failure is an error event, and the stream ends."""
        choices = [_Choice(i, len(r.prompt_ids)) for i, r in enumerate(call.requests)]
        queue: asyncio.Queue[tuple[int, GenerationChunk | ServingError]] = asyncio.Queue(maxsize=4 * len(choices))
        runner = asyncio.create_task(self._run(call, queue))
        try:
            i, first = await queue.get()
            if isinstance(first, ServingError):
                return _openai_error(first)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                if call.chat:  # each choice's role first, as OpenAI's first chunk
                    for c in choices:
                        role = {"role": "assistant", "content": ""}
                        await response.write(self._chunk(call, c.index, role, None, call.include_usage))
                await self._events(response, call, choices, queue, (i, first))
            except ConnectionError:  # the client left mid-stream: the choices are closed (finally)
                return response
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response
        finally:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner

    async def _events(
        self,
        response: web.StreamResponse,
        call: _Call,
        choices: list[_Choice],
        queue: asyncio.Queue[tuple[int, GenerationChunk | ServingError]],
        first: tuple[int, GenerationChunk],
    ) -> None:
        item: tuple[int, GenerationChunk | ServingError] = first
        while True:
            i, chunk = item
            if isinstance(chunk, ServingError):
                error = {"error": {"message": chunk.message, "type": "server_error", "param": None,
                                   "code": chunk.code.lower()}}  # fmt: skip
                await response.write(_event(error))
                break
            c = choices[i]
            _add(c, chunk)
            if chunk.text or chunk.finish_reason is not None:
                delta: Any = {"content": chunk.text} if call.chat else chunk.text
                if call.chat and not chunk.text:
                    delta = {}
                await response.write(self._chunk(call, i, delta, chunk.finish_reason, call.include_usage))
            if all(c.finish_reason is not None for c in choices):
                if call.include_usage:
                    doc = call.head(stream=True) | {"choices": [], "usage": call.usage(choices)}
                    await response.write(_event(doc))
                break
            item = await queue.get()
        await response.write(b"data: [DONE]\n\n")

    @staticmethod
    def _chunk(call: _Call, index: int, delta: Any, finish: str | None, usage_field: bool = False) -> bytes:
        if call.chat:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}
        doc = call.head(stream=True) | {"choices": [choice]}
        if usage_field:
            doc["usage"] = None
        return _event(doc)


def _add(choice: _Choice, chunk: GenerationChunk) -> None:
    choice.text.append(chunk.text)
    choice.completion_tokens = chunk.completion_tokens
    if chunk.finish_reason is not None:
        choice.finish_reason = chunk.finish_reason
