"""OpenAI- and TEI-shaped HTTP endpoints for text models, on the REST front end's port (docs/text-models.md).

    POST /v1/embeddings   OpenAI: {"model", "input", "dimensions", "encoding_format"} -> a list of embeddings
    GET  /v1/models       OpenAI: the served text models
    POST /embed           TEI: {"inputs", "truncate", "truncation_direction", "prompt_name", "dimensions"}
    POST /rerank          TEI: {"query", "texts", "return_text", "raw_scores"} -> [{"index", "score"}], sorted
    POST /predict         TEI: {"inputs", "top_k"} -> [{"label", "score"}], sorted
    POST /tokenize        TEI: {"inputs", "add_special_tokens"} -> each text's tokens

Each is a request to a text model through the same data plane as v2, in the model's own tensors (its kind's
`Tokenizes`: `task_io` the request, `task_answer` what it says): these requests batch with v2's and share
admission, limits, metrics and statistics. A body names its model ("model"); TEI's, which have no such
field, may leave it out when the server serves one model of the task. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import web

from service.errors import InvalidArgument, ServingError, quote
from service.frontends.generation import generating_models
from service.frontends.json_numbers import float_rows, floats
from service.frontends.rest_codec import parse_json
from service.frontends.statuses import http_status
from service.models.catalog import TextAnswer, TextAsk, Tokenizes, capability
from service.serving.dataplane import DataPlane
from service.serving.dataplane_types import InferInput, InferRequest, Parameter, RequestedOutput

__all__ = ["ENDPOINTS", "TextApi"]

Body = Callable[[web.BaseRequest], Awaitable[bytes]]
Handler = Callable[[web.BaseRequest, str, str], Awaitable[web.Response]]
# path -> (the metric's endpoint label, method)
ENDPOINTS = {
    ("v1", "embeddings"): ("openai_embeddings", "POST"),
    ("v1", "models"): ("openai_models", "GET"),
    ("embed",): ("tei_embed", "POST"),
    ("rerank",): ("tei_rerank", "POST"),
    ("predict",): ("tei_predict", "POST"),
    ("tokenize",): ("tei_tokenize", "POST"),
}
TASK_OF = {"openai_embeddings": "embed", "tei_embed": "embed", "tei_rerank": "rerank", "tei_predict": "classify"}


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.json_response(doc, status=status)


def _json_text(body: str) -> web.Response:
    return web.Response(text=body, content_type="application/json")


def _openai_error(e: ServingError) -> web.Response:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    status = http_status(e)
    kind = "invalid_request_error" if status < 500 else "server_error"
    param = e.message.split("'")[1] if e.message.startswith(("field '", "parameter '")) else None
    return _json({"error": {"message": e.message, "type": kind, "param": param, "code": e.code.lower()}}, status)


def _field(doc: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """A body's field of one of `kinds` (a bool is no number), or a 400 naming it."""
    value = doc.get(name, default)
    if value is default:
        return value
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidArgument(f"field '{name}' must be {_kind_names(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise InvalidArgument(f"field '{name}' must be {_kind_names(kinds)}, got {type(value).__name__}")
    return value


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", bool: "true or false", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _texts(value: Any, name: str) -> list[str]:
    """A string or a non-empty list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise InvalidArgument(f"field '{name}' must be a string or a non-empty list of strings")


def _token_lists(value: Any) -> tuple[tuple[int, ...], ...]:
    """OpenAI's token input (a list of ids, or a list of such lists), one tuple a text; () for text."""
    if not isinstance(value, list) or not value or isinstance(value[0], str):
        return ()
    rows = value if isinstance(value[0], list) else [value]
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise InvalidArgument(f"field 'input': element {i} must be a non-empty list of token ids (integers)")
        if min(row) < 0 or max(row) >= 1 << 31:
            raise InvalidArgument(f"field 'input': element {i} holds a token id outside [0, 2^31)")
    return tuple(map(tuple, rows))


class TextApi:
    """The handlers, over one data plane; `body` reads a request's body within the server's limits."""

    def __init__(self, plane: DataPlane, body: Body) -> None:
        self.plane, self.body = plane, body
        self.handlers: dict[str, Handler] = {
            "openai_embeddings": self._embeddings,
            "openai_models": self._models,
            "tei_embed": self._embed,
            "tei_rerank": self._rerank,
            "tei_predict": self._predict,
            "tei_tokenize": self._tokenize,
        }

    def route(self, parts: tuple[str, ...]) -> tuple[str, str, Handler] | None:
        """(endpoint, method, handler) of a path, or None when it is none of these."""
        found = ENDPOINTS.get(parts)
        if found is None:
            return None
        return found[0], found[1], self.handlers[found[0]]

    # --- the model a body names -----------------------------------------------------------------------

    def _text_models(self, task: str = "") -> list[str]:
        """The names of the served text models (of `task`), each once."""
        names = []
        for m in self.plane.registry.served():
            text = capability(m, Tokenizes)
            if text is not None and (not task or text.text_task() == task) and m.name not in names:
                names.append(m.name)
        return names

    def _model(self, doc: dict[str, Any], task: str) -> tuple[str, Tokenizes]:
        """The model of `task` a body names (or the one the server serves), and its text endpoints."""
        name = _field(doc, "model", str)
        if name is None:
            served = self._text_models(task)
            if len(served) != 1:
                raise InvalidArgument(
                    f"field 'model' is required: the server serves {len(served)} {task} models ({', '.join(served)})"
                )
            name = served[0]
        model = self.plane.model(name)  # NotFound when it serves none of that name
        text = capability(model, Tokenizes)
        if text is None or text.text_task() != task:
            raise InvalidArgument(
                f"field 'model': {quote(name)} is not a {task} model (its kind: {model.metadata.kind})"
            )
        return str(name), text

    async def _infer(self, target: tuple[str, Tokenizes], ask: TextAsk, params: dict[str, Parameter],
                     method: str) -> TextAnswer:  # fmt: skip
        """`ask` of the model `_model` found, one request through the data plane."""
        name, text = target
        inputs, outputs = text.task_io(ask)
        request = InferRequest(
            model_name=name,
            inputs=[InferInput.of(k, v) for k, v in inputs.items()],
            outputs=[RequestedOutput(o) for o in outputs],
            parameters=params,
            method=method,
        )
        outcome = await self.plane.infer(request)
        if isinstance(outcome, ServingError):
            raise outcome
        return text.task_answer(outcome.outputs)

    # --- OpenAI -----------------------------------------------------------------------------------------

    async def _embeddings(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        try:
            return await self._openai_embeddings(request)
        except ServingError as e:
            return _openai_error(e)

    async def _openai_embeddings(self, request: web.BaseRequest) -> web.Response:
        doc = parse_json(await self.body(request))
        if "model" not in doc:
            raise InvalidArgument("field 'model' is required")
        target = self._model(doc, "embed")
        if "input" not in doc:
            raise InvalidArgument("field 'input' is required")
        encoding = _field(doc, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise InvalidArgument(f"field 'encoding_format' must be float or base64, got {quote(encoding)}")
        params = self._params(doc)
        ids = _token_lists(doc["input"])
        ask = TextAsk(token_ids=ids, counts=True) if ids else TextAsk(tuple(_texts(doc["input"], "input")), counts=True)
        out = await self._infer(target, ask, params, "POST /v1/embeddings")
        data = []  # each item's JSON, written here: the embeddings are most of the body
        for i, (vector, cut) in enumerate(zip(out.values, out.truncated, strict=True)):
            if encoding == "base64":  # the little-endian float32 bytes, as OpenAI's clients decode them
                value = '"' + base64.b64encode(vector.astype("<f4").tobytes()).decode() + '"'
            else:
                value = floats(vector)
            more = f',"truncated_tokens":{int(cut)}' if cut else ""
            data.append(f'{{"object":"embedding","index":{i},"embedding":{value}{more}}}')
        tokens = int(out.tokens.sum())
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "truncated_tokens": int(out.truncated.sum())}
        return _json_text(
            f'{{"object":"list","data":[{",".join(data)}],"model":{json.dumps(target[0])},"usage":{json.dumps(usage)}}}'
        )

    def _params(self, doc: dict[str, Any]) -> dict[str, Parameter]:
        """The request parameters a body's fields set: dimensions, long_inputs, truncation_side, prompt_name."""
        params: dict[str, Parameter] = {}
        dimensions = _field(doc, "dimensions", int)
        if dimensions is not None:
            params["dimensions"] = dimensions
        for key in ("long_inputs", "truncation_side", "prompt_name"):
            value = _field(doc, key, str)
            if value is not None:
                params[key] = value
        return params

    async def _models(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        names = self._text_models() + [n for n in generating_models(self.plane) if n not in self._text_models()]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "qkv"} for n in names]
        return _json({"object": "list", "data": data})

    # --- TEI --------------------------------------------------------------------------------------------

    def _tei_params(self, doc: dict[str, Any]) -> dict[str, Parameter]:
        """TEI's truncate (true: cut, false: refuse; absent: the model's policy) and truncation_direction."""
        params = self._params(doc)
        truncate = _field(doc, "truncate", bool)
        if truncate is not None:
            params["long_inputs"] = "truncate" if truncate else "refuse"
        direction = _field(doc, "truncation_direction", str)
        if direction is not None:
            if direction.lower() not in ("left", "right"):
                raise InvalidArgument(f"field 'truncation_direction' must be Left or Right, got {quote(direction)}")
            params["truncation_side"] = direction.lower()
        return params

    async def _embed(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        doc = parse_json(await self.body(request))
        target = self._model(doc, "embed")
        texts = _texts(doc.get("inputs"), "inputs")
        out = await self._infer(target, TextAsk(tuple(texts)), self._tei_params(doc), "POST /embed")
        return _json_text(float_rows(out.values))

    async def _rerank(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        doc = parse_json(await self.body(request))
        target = self._model(doc, "rerank")
        query = _field(doc, "query", str)
        if query is None:
            raise InvalidArgument("field 'query' is required")
        texts = _texts(doc.get("texts", doc.get("documents")), "texts")
        with_text = bool(_field(doc, "return_text", bool, False) or _field(doc, "return_documents", bool, False))
        out = await self._infer(target, TextAsk(tuple(texts), query=query), self._tei_params(doc), "POST /rerank")
        scores = out.values
        ranked = []
        for i in sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i)):
            item: dict[str, Any] = {"index": i, "score": float(scores[i])}
            if with_text:
                item["text"] = texts[i]
            ranked.append(item)
        top = _field(doc, "top_n", int)
        return _json(ranked[:top] if top is not None else ranked)

    async def _predict(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        doc = parse_json(await self.body(request))
        target = self._model(doc, "classify")
        raw = doc.get("inputs")
        texts = _texts(raw, "inputs")
        top = _field(doc, "top_k", int)
        if top is not None and top < 1:
            raise InvalidArgument(f"field 'top_k' must be >= 1, got {top}")
        out = await self._infer(target, TextAsk(tuple(texts)), self._tei_params(doc), "POST /predict")
        labels = out.labels
        answers = []
        for row in out.values:
            order = np.argsort(-row, kind="stable")[:top]
            answers.append(
                [{"label": labels[k] if k < len(labels) else f"LABEL_{k}", "score": float(row[k])} for k in order]
            )
        return _json(answers[0] if isinstance(raw, str) else answers)

    async def _tokenize(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        doc = parse_json(await self.body(request))
        name = _field(doc, "model", str)
        served = self._text_models()
        if name is None and len(served) != 1:
            raise InvalidArgument(f"field 'model' is required: the server serves {len(served)} text models")
        m = self.plane.model(name or served[0])
        text = capability(m, Tokenizes)
        if text is None:
            raise InvalidArgument(f"field 'model': {quote(m.name)} is not a text model")
        texts = _texts(doc.get("inputs"), "inputs")
        special = _field(doc, "add_special_tokens", bool, True)
        tokens = await asyncio.to_thread(text.tokenize, texts, special)
        return _json(tokens)
