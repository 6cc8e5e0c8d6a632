"""Beam search in the generation engine, on the tiny GPT-2 and T5 of generation_models.py: a beam request's
answer is transformers' `generate(num_beams=4, do_sample=False)`, token for token, while greedy requests run
in the same batch (in process, over a v2 infer and over OpenAI's completions, streamed and not); length_penalty
and early_stopping choose as transformers' do; a beam request reserves num_beams caches and a closed one frees
them all within a step; bad input is INVALID_ARGUMENT naming the field. Needs the hf extra (skipped without)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.errors import ResourceExhausted
from service.models.generation.capability import GenerationChunk, GenerationRequest
from service.models.generation.model import GenerationModel
from tests.conftest import RunningServer
from tests.service.generation_models import GREEDY_TOKENS, PROMPTS, greedy_answers
from tests.service.onnx_models import serving
from tests.service.test_generation_engine import _collect, _folder, _model
from tests.service.text_models import repository

ARCHITECTURES = ("gpt2", "t5")
BEAMS = 4
MAX_TOKENS = 24
BEAM_PROMPTS = PROMPTS[::4]  # 16 prompts of mixed lengths


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both models, as served: models/gpt2/1, models/t5/1 (links to the builds)."""
    return repository(tmp_path_factory.mktemp("beams"), {name: _folder(name) / "onnx" for name in ARCHITECTURES})


@cache
def _reference(architecture: str) -> tuple[Any, Any]:
    """(transformers model, tokenizer) of the build's torch/ folder."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = _folder(architecture) / "torch"
    kind = AutoModelForCausalLM if architecture == "gpt2" else AutoModelForSeq2SeqLM
    return kind.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def _generate(architecture: str, prompt: str, max_tokens: int, num_beams: int, **options: Any) -> list[int]:
    """transformers' generate, greedy (num_beams 1) or beam search: the new tokens, EOS included."""
    import torch

    hf, tokenizer = _reference(architecture)
    ids = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: some 5 x faster on a busy machine than a thread per core
    try:
        with torch.no_grad():
            out = hf.generate(**ids, max_new_tokens=max_tokens, num_beams=num_beams, do_sample=False,
                              pad_token_id=pad, **options)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return list(out[0, ids.input_ids.shape[1] if architecture == "gpt2" else 1 :].tolist())


@cache
def _beams(architecture: str, prompt: str, max_tokens: int = MAX_TOKENS, num_beams: int = BEAMS,
           length_penalty: float = 1.0, early_stopping: bool | str = False) -> tuple[int, ...]:  # fmt: skip
    """transformers' beam search: the new tokens of its best hypothesis (EOS included, as generate returns it)."""
    return tuple(_generate(architecture, prompt, max_tokens, num_beams, length_penalty=length_penalty,
                           early_stopping=early_stopping))  # fmt: skip


def _rows_per_step(model: GenerationModel) -> list[tuple[int, int]]:
    """At each step the engine takes from now on: (beam rows, other rows) of its running batch."""
    seen: list[tuple[int, int]] = []
    step = model.engine.step

    def counted() -> Any:
        beams = sum(s.lead is not None for s in model.engine.running)
        seen.append((beams, len(model.engine.running) - beams))
        return step()

    model.engine.step = counted  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_beam_search_equals_transformers_with_greedy_requests_in_the_batch(repo: Path, architecture: str) -> None:
    model = _model(repo, architecture)
    greedy = greedy_answers(_folder(architecture))
    seen = _rows_per_step(model)

    async def run() -> tuple[list[list[GenerationChunk]], list[list[GenerationChunk]]]:
        model.start()
        try:
            beams = [GenerationRequest(tuple(model.encode(p)), MAX_TOKENS, num_beams=BEAMS) for p in BEAM_PROMPTS]
            plain = [GenerationRequest(tuple(model.encode(p)), GREEDY_TOKENS) for p in PROMPTS[:24]]
            answers = await asyncio.gather(*(_collect(model, r) for r in beams + plain))
            return answers[: len(beams)], answers[len(beams) :]
        finally:
            await model.close()

    beamed, plain = asyncio.run(run())
    for prompt, chunks in zip(BEAM_PROMPTS, beamed, strict=True):
        wanted = _beams(architecture, prompt)
        assert len(chunks) == 1, prompt  # a beam search answers once, at its end
        [chunk] = chunks
        assert chunk.token_ids == wanted, prompt
        assert chunk.completion_tokens == len(wanted) and chunk.prompt_tokens == len(model.encode(prompt))
        assert chunk.text == model.decode(list(wanted)), prompt
        ended = wanted[-1] in model.defaults.eos_token_ids
        assert chunk.finish_reason == ("stop" if ended else "length")
    for chunks, tokens in zip(plain, greedy, strict=False):
        assert [t for c in chunks for t in c.token_ids] == tokens  # the greedy ones are untouched
    assert any(beams >= 2 * BEAMS and others > 0 for beams, others in seen)  # beams and greedy rows, one batch
    assert len({len(_beams(architecture, p)) for p in BEAM_PROMPTS}) > 1 or architecture == "t5"


@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(0.0, True), (2.0, "never"), (-1.0, False)])
def test_length_penalty_and_early_stopping_choose_as_transformers(
    repo: Path, length_penalty: float, early_stopping: bool | str
) -> None:
    model = _model(repo, "gpt2")
    prompts = BEAM_PROMPTS[:6]

    async def run() -> list[list[GenerationChunk]]:
        model.start()
        try:
            return await asyncio.gather(*(
                _collect(model, GenerationRequest(tuple(model.encode(p)), MAX_TOKENS, num_beams=3,
                                                  length_penalty=length_penalty, early_stopping=early_stopping))
                for p in prompts
            ))  # fmt: skip
        finally:
            await model.close()

    for prompt, [chunk] in zip(prompts, asyncio.run(run()), strict=True):
        assert chunk.token_ids == _beams("gpt2", prompt, MAX_TOKENS, 3, length_penalty, early_stopping), prompt


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_stop_token_ids_and_the_repetition_penalty_choose_as_transformers(repo: Path, architecture: str) -> None:
    """A stop token id ends a hypothesis as an EOS id does (transformers: eos_token_id [EOS, stop]); the repetition
    penalty covers what transformers' covers (its decoder's input ids), greedy and beams alike."""
    model = _model(repo, architecture)
    _, tokenizer = _reference(architecture)
    prompts = BEAM_PROMPTS[1:5]
    stop = _beams(architecture, prompts[0])[2]  # a token the first answer has: it ends sooner

    async def run() -> list[list[GenerationChunk]]:
        model.start()
        try:
            return await asyncio.gather(*(
                _collect(model, GenerationRequest(tuple(model.encode(p)), 16, num_beams=n, **fields))
                for p in prompts for n in (1, BEAMS)
                for fields in ({"stop_token_ids": (stop,)}, {"repetition_penalty": 1.8})
            ))  # fmt: skip
        finally:
            await model.close()

    answers = iter(asyncio.run(run()))
    for p in prompts:
        for n in (1, BEAMS):
            stopped, penalised = ([t for c in next(answers) for t in c.token_ids] for _ in range(2))
            assert stopped == _generate(architecture, p, 16, n, eos_token_id=[tokenizer.eos_token_id, stop]), p
            assert penalised == _generate(architecture, p, 16, n, repetition_penalty=1.8), p


def test_a_beam_request_reserves_its_beams_caches_and_a_closed_one_frees_them(repo: Path) -> None:
    probe = _model(repo, "gpt2")
    prompt = tuple(probe.encode(PROMPTS[10]))
    one = probe.engine.reservation(GenerationRequest(prompt, 40))
    assert probe.engine.reservation(GenerationRequest(prompt, 40, num_beams=BEAMS)) == BEAMS * one
    model = _model(repo, "gpt2", cache_bytes=2 * one)  # a greedy request fits, four beams never do

    async def refused() -> None:
        model.start()
        assert (await _collect(model, GenerationRequest(prompt, 40, ignore_eos=True)))[-1].completion_tokens == 40
        with pytest.raises(ResourceExhausted, match="cache budget"):
            await _collect(model, GenerationRequest(prompt, 40, num_beams=BEAMS))
        await model.close()

    asyncio.run(refused())

    model = _model(repo, "gpt2")

    async def closed() -> tuple[int, int]:
        model.start()
        task = asyncio.create_task(_collect(model, GenerationRequest(prompt, 1000, num_beams=BEAMS, ignore_eos=True)))
        while sum(s.lead is not None for s in model.engine.running) < BEAMS:
            await asyncio.sleep(0.001)
        [lead] = {s.lead for s in model.engine.running}
        assert lead is not None and model.engine.reserved == lead.reserved == BEAMS * model.engine.reservation(
            GenerationRequest(prompt, 1000)
        )
        task.cancel()  # the client went away
        while lead.freed_at < 0:
            await asyncio.sleep(0.001)
        assert lead.freed_at - lead.cancelled_at <= 1
        while model.engine.running:  # every beam left with it
            await asyncio.sleep(0.001)
        reserved = model.engine.reserved
        await model.close()
        return reserved, model.engine.steps

    reserved, steps = asyncio.run(closed())
    assert reserved == 0 and steps < 1000


def test_beams_count_as_rows_of_the_running_batch(repo: Path) -> None:
    model = _model(repo, "gpt2")
    model.engine.max_running = BEAMS + 1  # a beam request and one greedy row, or a wider search alone
    seen = _rows_per_step(model)
    prompt = tuple(model.encode(PROMPTS[3]))

    async def run() -> list[list[GenerationChunk]]:
        model.start()
        try:
            return await asyncio.gather(
                _collect(model, GenerationRequest(prompt, 12, num_beams=BEAMS, ignore_eos=True)),
                _collect(model, GenerationRequest(prompt, 12, num_beams=BEAMS, ignore_eos=True)),
                _collect(model, GenerationRequest(prompt, 12, num_beams=8, ignore_eos=True)),
                _collect(model, GenerationRequest(prompt, 12, ignore_eos=True)),
            )
        finally:
            await model.close()

    answers = asyncio.run(run())
    assert [a[-1].completion_tokens for a in answers] == [12] * 4
    assert answers[0][0].token_ids == answers[1][0].token_ids  # the same search, whichever rows it ran beside
    assert max(b + o for b, o in seen) == 8  # the 8-beam search ran alone; the others never passed 5 rows
    assert all(b + o <= BEAMS + 1 for b, o in seen if b != 8)


# --- served: a v2 infer (tritonclient) and OpenAI's completions (the openai client) --------------------------


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


def _infer(client: g.InferenceServerClient, model: str, text: str, **params: Any) -> tuple[str, str, int]:
    t = g.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    answer = client.infer(model, [t], parameters=params)
    return (answer.as_numpy("text_output")[0].decode(), answer.as_numpy("finish_reason")[0].decode(),
            int(answer.as_numpy("completion_tokens")[0]))  # fmt: skip


def _expected(architecture: str, prompt: str) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of transformers' beam search."""
    _, tokenizer = _reference(architecture)
    tokens = _beams(architecture, prompt)
    ended = tokens[-1] == tokenizer.eos_token_id
    return tokenizer.decode(list(tokens), skip_special_tokens=True), "stop" if ended else "length", len(tokens)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_served_beam_search_over_v2_and_openai_equals_transformers(served: RunningServer, architecture: str) -> None:
    openai = pytest.importorskip("openai")
    prompts = BEAM_PROMPTS[:8]
    wanted = {p: _expected(architecture, p) for p in prompts}
    stop = threading.Event()
    greedy: list[int] = []

    def keep_greedy_running() -> None:
        with g.InferenceServerClient(served.url) as client:
            while not stop.is_set():
                greedy.append(_infer(client, architecture, PROMPTS[len(greedy) % 64], max_tokens=16)[2])

    workers = [threading.Thread(target=keep_greedy_running) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        with g.InferenceServerClient(served.url) as client:
            for p in prompts:
                assert _infer(client, architecture, p, max_tokens=MAX_TOKENS, num_beams=BEAMS) == wanted[p], p
        with openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="none", max_retries=0) as client:
            for p in prompts:
                answer = client.completions.create(model=architecture, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"num_beams": BEAMS})  # fmt: skip
                choice = answer.choices[0]
                assert (choice.text, choice.finish_reason, answer.usage.completion_tokens) == wanted[p], p
                events = list(client.completions.create(model=architecture, prompt=p, max_tokens=MAX_TOKENS,
                                                        stream=True, extra_body={"num_beams": BEAMS}))  # fmt: skip
                texts = [e.choices[0].text for e in events if e.choices and e.choices[0].text]
                assert texts == ([wanted[p][0]] if wanted[p][0] else [])  # the whole answer in one chunk
                assert events[-1].choices[0].finish_reason == wanted[p][1]
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert len(greedy) >= 4  # greedy requests ran beside the beams


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 17}, "num_beams"),
        ({"num_beams": BEAMS, "temperature": 0.7}, "num_beams"),
        ({"num_beams": BEAMS, "stop": "fox"}, "stop"),
        ({"num_beams": BEAMS, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_beam_requests_are_invalid_arguments_naming_the_field(
    served: RunningServer, params: dict[str, Any], field: str
) -> None:
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException, match=field) as e:
            _infer(client, "gpt2", "The quick brown fox", max_tokens=4, **params)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    if field == "early_stopping":  # a v2 parameter only; OpenAI's bodies take the model's
        return
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="none", max_retries=0) as client:
        body = {k: v for k, v in params.items() if k != "temperature"}
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="gpt2", prompt="The quick brown fox", max_tokens=4,
                                      temperature=params.get("temperature", 0), extra_body=body)  # fmt: skip
        assert bad.value.status_code == 400 and bad.value.body["param"] == field  # type: ignore[index]
        assert client.completions.create(model="gpt2", prompt="The quick", max_tokens=2).usage.completion_tokens <= 2
