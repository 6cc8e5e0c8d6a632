"""What every front end of a generating model shares (docs/generation.md, "Interfaces").

A generating model is found by its capability (`Generator`), not by its kind. Each front end reads its
wire format into `Sampling` fields, which `generation_request` checks against the model's
`GenerationDefaults` (every field left out takes the model's default, as generation_config.json says) and
turns into one `GenerationRequest`. `chunks` then streams the answer with the model held (an unload waits
for it), refused while the server drains, counted in the model's statistics, and closed (the sequence's
cache freed) when the front end stops reading: a client that went away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from service.errors import InvalidArgument, Unavailable, quote
from service.models.catalog import ServedVersion
from service.models.generation.capability import GenerationChunk, GenerationRequest, Generator
from service.models.generation.requests import MAX_BEAMS
from service.serving.dataplane import DataPlane

__all__ = [
    "CHARS_PER_TOKEN",
    "MAX_STOPS",
    "GeneratingModel",
    "Sampling",
    "chunks",
    "encoded",
    "generating_model",
    "generating_models",
    "generation_request",
]

MAX_STOPS = 16  # stop strings and stop token ids a request may give, each
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_SEED = 2**63
# A text longer than this many characters for each token the model takes is refused before it is encoded (on
# the event loop): no tokenizer packs that much into a token, and a body of megabytes costs no encoding.
CHARS_PER_TOKEN = 64


class GeneratingModel(ServedVersion, Generator, Protocol):
    """A served version with the generation capability: what `generating_model` hands back."""


def generating_model(plane: DataPlane, name: str, version: str = "", field: str = "model") -> GeneratingModel:
    """The served version `name` names, when it generates; NotFound when none is served, and InvalidArgument
    naming `field` when it does not generate."""
    model = plane.model(name, version)
    if not isinstance(model, Generator):
        raise InvalidArgument(
            f"field '{field}': {quote(name)} does not generate text (its kind: {model.metadata.kind})"
        )
    return cast(GeneratingModel, model)


def generating_models(plane: DataPlane) -> list[str]:
    """The names of the served generating models, each once."""
    names: list[str] = []
    for m in plane.registry.served():
        if isinstance(m, Generator) and m.name not in names:
            names.append(m.name)
    return names


def encoded(model: Generator, text: str, field: str, special_tokens: bool = True) -> list[int]:
    """`text` as the model's tokenizer encodes it; InvalidArgument naming `field` for a text far longer than
    any prompt the model takes, before it is encoded."""
    limit = model.defaults.max_prompt_tokens * CHARS_PER_TOKEN
    if len(text) > limit:
        raise InvalidArgument(
            f"field '{field}' has {len(text):,} characters: far more than the model's "
            f"{model.defaults.max_prompt_tokens} prompt tokens hold"
        )
    return model.encode(text, special_tokens)


@dataclass(frozen=True)
class Sampling:
    """The fields of a request that choose its tokens, as its body gave them (None: left out). Each field's
    name in error messages is the wire's: `names` maps ours to the body's (max_tokens: max_completion_tokens)."""

    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    num_beams: Any = None
    length_penalty: Any = None
    names: Mapping[str, str] | None = None

    @classmethod
    def of(cls, doc: Mapping[str, Any], names: Mapping[str, str] | None = None) -> Sampling:
        fields = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop",
                  "stop_token_ids", "ignore_eos", "num_beams", "length_penalty")  # fmt: skip
        return cls(**{f: doc.get((names or {}).get(f, f)) for f in fields}, names=names)

    def name(self, field: str) -> str:
        return (self.names or {}).get(field, field)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"field '{name}' must be a number, got {_what(value)}")
    return float(value)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, float) and value.is_integer():  # JSON clients may send 16.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"field '{name}' must be an integer, got {_what(value)}")
    return value


def _what(value: Any) -> str:
    if isinstance(value, bool):
        return repr(value)
    names: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _stops(value: Any, name: str) -> tuple[str, ...]:
    """A stop string or a list of them."""
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"field '{name}' must be a string or a list of strings, got {_what(value)}")
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(f"field '{name}' has {len(stops)} stop strings, the limit is {MAX_STOPS}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"field '{name}': a stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _stop_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidArgument(f"field '{name}' must be a list of token ids, got {_what(value)}")
    if len(value) > MAX_STOPS:
        raise InvalidArgument(f"field '{name}' has {len(value)} token ids, the limit is {MAX_STOPS}")
    ids = tuple(_integer(v, name) for v in value)
    if any(not 0 <= i < 2**31 for i in ids):
        raise InvalidArgument(f"field '{name}' holds a token id outside [0, 2^31)")
    return ids


def generation_request(
    model: Generator,
    prompt_ids: list[int] | tuple[int, ...],
    sampling: Sampling,
    prompt_field: str = "prompt",
    deadline: float | None = None,
    seed_offset: int = 0,
) -> GenerationRequest:
    """The request of one prompt, every field checked (InvalidArgument naming it) and every field left out
    taken from the model's defaults. Sampling is on when the body sets temperature above 0, top_p or top_k;
    off at temperature 0; and as generation_config.json says when it sets none of them. A prompt longer than
    the model takes is refused; a max_tokens the model's positions cannot hold is refused when given, and cut
    to what they hold when left out. `seed_offset`: choice i of n samples with the seed + i."""
    d = model.defaults
    if not prompt_ids:
        raise InvalidArgument(f"field '{prompt_field}' is empty: give at least one token")
    if len(prompt_ids) > d.max_prompt_tokens:
        raise InvalidArgument(
            f"field '{prompt_field}' has {len(prompt_ids)} tokens, the model takes {d.max_prompt_tokens} at most"
        )
    room = d.max_positions - len(prompt_ids) if d.max_positions else None
    if room is not None and room < 1:
        raise InvalidArgument(
            f"field '{prompt_field}' has {len(prompt_ids)} tokens: the model's {d.max_positions} positions leave "
            "no room for an output token"
        )
    name = sampling.name("max_tokens")
    if sampling.max_tokens is None:
        max_tokens = d.max_new_tokens if room is None else min(d.max_new_tokens, room)
    else:
        max_tokens = _integer(sampling.max_tokens, name)
        if max_tokens < 1:
            raise InvalidArgument(f"field '{name}' must be at least 1, got {max_tokens}")
        if room is not None and max_tokens > room:
            raise InvalidArgument(
                f"field '{name}' is {max_tokens}: with the prompt's {len(prompt_ids)} tokens that is over the "
                f"model's {d.max_positions} positions (at most {room})"
            )
    temperature, top_p, top_k = d.temperature, d.top_p, d.top_k
    do_sample = d.do_sample
    if sampling.temperature is not None:
        temperature = _number(sampling.temperature, sampling.name("temperature"))
        if not 0 <= temperature <= 100:
            raise InvalidArgument(f"field '{sampling.name('temperature')}' must be in [0, 100], got {temperature}")
    if sampling.top_p is not None:
        top_p = _number(sampling.top_p, sampling.name("top_p"))
        if not 0 < top_p <= 1:
            raise InvalidArgument(f"field '{sampling.name('top_p')}' must be in (0, 1], got {top_p}")
    if sampling.top_k is not None:
        top_k = _integer(sampling.top_k, sampling.name("top_k"))
        if top_k == -1:  # vLLM's "no top-k"
            top_k = 0
        if top_k < 0:
            raise InvalidArgument(f"field '{sampling.name('top_k')}' must be -1, 0 (no filter) or more, got {top_k}")
    if sampling.temperature is not None or sampling.top_p is not None or sampling.top_k is not None:
        do_sample = True
    if temperature == 0:
        do_sample, temperature = False, 1.0
    seed = None
    if sampling.seed is not None:
        seed = _integer(sampling.seed, sampling.name("seed"))
        if not -MAX_SEED <= seed < MAX_SEED:
            raise InvalidArgument(f"field '{sampling.name('seed')}' must fit in 64 bits")
        seed += seed_offset
    penalty = d.repetition_penalty
    if sampling.repetition_penalty is not None:
        penalty = _number(sampling.repetition_penalty, sampling.name("repetition_penalty"))
        if not 0 < penalty <= 100:
            raise InvalidArgument(f"field '{sampling.name('repetition_penalty')}' must be in (0, 100], got {penalty}")
    stop = () if sampling.stop is None else _stops(sampling.stop, sampling.name("stop"))
    stop_ids = (
        () if sampling.stop_token_ids is None else _stop_ids(sampling.stop_token_ids, sampling.name("stop_token_ids"))
    )
    num_beams, length_penalty = _beams(sampling, d.length_penalty)
    if num_beams > 1:
        if sampling.temperature or sampling.top_p is not None or sampling.top_k is not None:
            raise InvalidArgument(
                f"field '{sampling.name('num_beams')}' is {num_beams}: beam search does not sample (leave "
                "temperature, top_p and top_k out, or temperature 0)"
            )
        if stop:
            raise InvalidArgument(
                f"field '{sampling.name('stop')}': beam search takes stop_token_ids, not stop strings"
            )
        do_sample, temperature = False, 1.0
    ignore_eos = False
    if sampling.ignore_eos is not None:
        if not isinstance(sampling.ignore_eos, bool):
            raise InvalidArgument(f"field '{sampling.name('ignore_eos')}' must be true or false")
        ignore_eos = sampling.ignore_eos
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        num_beams=num_beams,  # 1 unless the body asks: a beam search answers at its end, in one chunk
        length_penalty=length_penalty,
        early_stopping=d.early_stopping,
        repetition_penalty=penalty,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        deadline=deadline,
    )


def _beams(sampling: Sampling, length_penalty: float) -> tuple[int, float]:
    """The body's num_beams (1 when left out, whatever generation_config.json says: these interfaces stream
    token by token) and length_penalty (the model's when left out)."""
    num_beams = 1
    if sampling.num_beams is not None:
        num_beams = _integer(sampling.num_beams, sampling.name("num_beams"))
        if not 1 <= num_beams <= MAX_BEAMS:
            raise InvalidArgument(
                f"field '{sampling.name('num_beams')}' must be from 1 to {MAX_BEAMS}, got {num_beams}"
            )
    if sampling.length_penalty is not None:
        length_penalty = _number(sampling.length_penalty, sampling.name("length_penalty"))
        if not -100 <= length_penalty <= 100:
            raise InvalidArgument(f"field '{sampling.name('length_penalty')}' must be in [-100, 100]")
    return num_beams, length_penalty


async def chunks(
    plane: DataPlane, model: GeneratingModel, request: GenerationRequest
) -> AsyncGenerator[GenerationChunk]:
    """The model's answer to `request`, chunk by chunk: refused while the server drains, the version held
    until the stream ends (an unload waits for it), and counted in its statistics. Closing this stream
    closes the model's: the engine frees the sequence's cache."""
    if plane.draining:
        raise Unavailable("the server is shutting down")
    start = time.perf_counter()
    ok = False
    model.in_flight.enter()  # a drain and an unload wait for the stream to end
    plane.active += 1
    plane.last_arrival = time.monotonic()
    answer = model.generate(request)
    try:
        async for chunk in answer:
            yield chunk
            if chunk.finish_reason is not None:
                ok = True
    finally:
        try:
            close = getattr(answer, "aclose", None)  # the engine frees the sequence's cache
            if close is not None:
                await close()
        finally:
            model.stats.answered(ok, int((time.perf_counter() - start) * 1e9))
            plane.active -= 1
            model.in_flight.leave()
