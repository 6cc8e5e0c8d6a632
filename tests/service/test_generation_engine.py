"""The generation engine on a tiny GPT-2 and a tiny T5 as optimum exports them (tests/service/generation_models.py):
greedy answers under concurrency are transformers' generate's, token for token, streamed in process and
through a served v2 infer; sequences join and leave a running batch; a closed stream frees its cache within a
step; the cache budget makes a request wait or refuses it; bad input is INVALID_ARGUMENT naming the field.
Needs the hf extra (skipped without it)."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException

from service.decoding.choosing import Chooser
from service.decoding.detokenize import Detokenizer
from service.decoding.engine import Sequence
from service.errors import InvalidArgument, ResourceExhausted
from service.models.catalog import recognised
from service.models.generation.capability import GenerationChunk, GenerationRequest, Generator
from service.models.generation.graphs import Seq2SeqGraphs
from service.models.generation.model import GenerationModel
from service.repository.layout import load_model_config
from tests.conftest import RunningServer
from tests.service.generation_models import (
    GREEDY_TOKENS,
    LONG_PROMPT,
    PROMPTS,
    causal_folder,
    greedy_answers,
    seq2seq_folder,
)
from tests.service.onnx_models import metric, serving

ARCHITECTURES = ("gpt2", "t5")
MAX_TOKENS = GREEDY_TOKENS


def _folder(architecture: str) -> Path:
    pytest.importorskip("optimum.exporters.onnx", reason="needs the hf extra")
    return causal_folder() if architecture == "gpt2" else seq2seq_folder()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("generation") / "models"
    for architecture in ARCHITECTURES:
        shutil.copytree(_folder(architecture) / "onnx", models / architecture / "1")
    return models


@pytest.fixture(scope="module")
def expected() -> dict[str, list[list[int]]]:
    """transformers' greedy answers (batch 1, no padding) to every prompt, kept with each build; under
    'ARCHITECTURE-long', to LONG_PROMPT."""
    answers = {a: greedy_answers(_folder(a)) for a in ARCHITECTURES}
    return {a: v[: len(PROMPTS)] for a, v in answers.items()} | {
        f"{a}-long": v[len(PROMPTS) :] for a, v in answers.items()
    }


def _model(repo: Path, architecture: str, **limits: Any) -> GenerationModel:
    config = recognised(load_model_config(repo / architecture))
    if limits:
        from dataclasses import replace

        config = replace(config, limits=limits)
    model = GenerationModel(config, ["CPUExecutionProvider"], None)
    model.warm_up()
    return model


def _running_sizes(model: GenerationModel) -> list[int]:
    """The running batch's size at each step the engine takes from now on."""
    sizes: list[int] = []
    step = model.engine.step

    def counted() -> Any:
        sizes.append(len(model.engine.running))
        return step()

    model.engine.step = counted  # type: ignore[method-assign]
    return sizes


async def _collect(model: GenerationModel, request: GenerationRequest) -> list[GenerationChunk]:
    return [c async for c in model.generate(request)]


def test_an_exported_folder_with_a_tokenizer_is_a_generation_model(repo: Path, tmp_path: Path) -> None:
    for architecture in ARCHITECTURES:
        assert recognised(load_model_config(repo / architecture)).kind == "generation"
    bare = tmp_path / "gpt2"  # the graph alone (no tokenizer): a tensor model, as before
    (bare / "1").mkdir(parents=True)
    shutil.copy(repo / "gpt2" / "1" / "model.onnx", bare / "1" / "model.onnx")
    assert recognised(load_model_config(bare)).kind == "tensor"


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_streams_equal_transformers_under_concurrency(
    repo: Path, expected: dict[str, list[list[int]]], architecture: str
) -> None:
    model = _model(repo, architecture)
    assert isinstance(model, Generator)  # what the streaming front ends look up
    sizes = _running_sizes(model)

    async def run() -> list[list[GenerationChunk]]:
        model.start()
        window = asyncio.Semaphore(16)

        async def one(prompt: str) -> list[GenerationChunk]:
            async with window:
                return await _collect(model, GenerationRequest(tuple(model.encode(prompt)), MAX_TOKENS))

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await model.close()

    answers = asyncio.run(run())
    wanted = expected[architecture]
    for prompt, chunks, tokens in zip(PROMPTS, answers, wanted, strict=True):
        got = [t for c in chunks for t in c.token_ids]
        assert got == tokens, prompt
        assert chunks[-1].completion_tokens == len(tokens)  # EOS counted, as generate returns it
        assert "".join(c.text for c in chunks) == model.decode(tokens), prompt
        assert chunks[-1].finish_reason == ("length" if len(tokens) == MAX_TOKENS and tokens[-1] not in
                                            model.defaults.eos_token_ids else "stop")  # fmt: skip
        assert all(c.finish_reason is None for c in chunks[:-1])
    assert len({len(t) for t in wanted}) > 8  # the answers end at many different lengths
    assert max(sizes) == 16  # sequences ran together...
    assert len(set(sizes)) > 4  # ...joining and leaving the running batch between steps


def test_a_closed_stream_frees_its_cache_within_one_step(repo: Path) -> None:
    model = _model(repo, "gpt2")

    async def run() -> Sequence:
        model.start()
        stream = model.generate(GenerationRequest(tuple(model.encode(PROMPTS[3])), 1000, ignore_eos=True))
        other = GenerationRequest(tuple(model.encode(PROMPTS[5])), 400, ignore_eos=True)
        going_on = asyncio.create_task(_collect(model, other))
        for _ in range(3):
            await anext(stream)
        [sequence] = [s for s in model.engine.running if len(s.prompt) == len(model.encode(PROMPTS[3]))]
        await stream.aclose()
        while sequence.freed_at < 0:
            await asyncio.sleep(0.001)
        assert model.engine.reserved == model.engine.reservation(other)  # the other's alone
        assert (await going_on)[-1].completion_tokens == 400  # the other went on
        await model.close()
        return sequence

    sequence = asyncio.run(run())
    assert sequence.cancelled_at >= 0 and sequence.freed_at - sequence.cancelled_at <= 1
    assert sequence.cache == [] and len(sequence.output) < 1000


def test_the_cache_budget_queues_what_does_not_fit_and_refuses_what_never_can(repo: Path) -> None:
    probe = _model(repo, "gpt2")
    prompt = tuple(probe.encode(PROMPTS[10]))
    one = probe.engine.reservation(GenerationRequest(prompt, 40))
    model = _model(repo, "gpt2", cache_bytes=one + one // 2)  # room for one such request at a time

    async def run() -> list[int]:
        model.start()
        seen = _running_sizes(model)
        request = GenerationRequest(prompt, 40, ignore_eos=True)
        answers = await asyncio.gather(*(_collect(model, request) for _ in range(3)))
        assert all(a[-1].completion_tokens == 40 for a in answers)
        with pytest.raises(ResourceExhausted, match="cache budget"):
            await _collect(model, GenerationRequest(prompt, 2000))
        await model.close()
        return seen

    assert max(asyncio.run(run())) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt_ids": ()}, "prompt"),
        ({"prompt_ids": (5,) * 2048}, "prompt"),  # GPT-2's 2,048 positions
        ({"prompt_ids": (99999,)}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": 0.0, "do_sample": True}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_bad_requests_are_invalid_arguments_naming_the_field(repo: Path, change: dict[str, Any], field: str) -> None:
    model = _model(repo, "gpt2")
    fields: dict[str, Any] = {"prompt_ids": (5, 6), "max_tokens": 4} | change

    async def run() -> None:
        with pytest.raises(InvalidArgument, match=field):
            await _collect(model, GenerationRequest(**fields))

    asyncio.run(run())


# --- served: a plain v2 infer with tritonclient ------------------------------------------------------------


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[RunningServer]:
    yield from serving(repo)


def _infer(client: g.InferenceServerClient, model: str, text: str, **params: Any) -> dict[str, Any]:
    t = g.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    answer = client.infer(model, [t], parameters=params)
    return {
        "text": answer.as_numpy("text_output")[0].decode(),
        "finish_reason": answer.as_numpy("finish_reason")[0].decode(),
        "completion_tokens": int(answer.as_numpy("completion_tokens")[0]),
    }


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_v2_infer_answers_as_transformers(
    served: RunningServer, repo: Path, expected: dict[str, list[list[int]]], architecture: str
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repo / architecture / "1" / "tokenizer.json"))
    with g.InferenceServerClient(served.url) as client:
        assert [i.name for i in client.get_model_metadata(architecture).inputs] == ["text_input"]
        for i in range(0, 64, 8):
            answer = _infer(client, architecture, PROMPTS[i], max_tokens=MAX_TOKENS)
            tokens = expected[architecture][i]
            assert answer["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
            assert answer["completion_tokens"] == len(tokens)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"stop": 7}, "stop"),  # a stop that is neither a string nor a list of them
        ({"stop": '["ok", 3]'}, "stop"),
        ({"num_beams": 0}, "num_beams"),
    ],
)
def test_a_v2_infer_with_bad_parameters_is_invalid_argument(
    served: RunningServer, params: dict[str, Any], field: str
) -> None:
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException, match=field) as e:
            _infer(client, "gpt2", "The quick brown fox", **params)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert _infer(client, "gpt2", "The quick", max_tokens=2)["completion_tokens"] <= 2  # still serving


def test_a_v2_prompt_over_the_model_positions_is_invalid_argument(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException, match="prompt") as e:
            _infer(client, "gpt2", " ".join(["fox"] * 2100), max_tokens=4)  # GPT-2's 2,048 positions
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


# --- decoding options ---------------------------------------------------------------------------------------


def _answer(model: GenerationModel, prompt: str, **fields: Any) -> list[GenerationChunk]:
    async def run() -> list[GenerationChunk]:
        model.start()
        try:
            return await _collect(model, GenerationRequest(tuple(model.encode(prompt)), **fields))
        finally:
            await model.close()

    return asyncio.run(run())


def test_a_long_prompt_prefilled_in_chunks_answers_as_transformers(
    repo: Path, expected: dict[str, list[list[int]]]
) -> None:
    model = _model(repo, "gpt2")
    prompt = tuple(model.encode(LONG_PROMPT))
    assert len(prompt) > 3 * model.engine.step_tokens
    model.engine.step_tokens = 100
    chunks = _answer(model, LONG_PROMPT, max_tokens=MAX_TOKENS)
    assert [t for c in chunks for t in c.token_ids] == expected["gpt2-long"][0]
    assert model.engine.steps >= len(prompt) // 100  # the prompt ran in chunks, not at once


def test_sampling_repeats_for_a_seed_and_varies_without_one(repo: Path) -> None:
    model = _model(repo, "gpt2")
    fields = {"max_tokens": 24, "do_sample": True, "temperature": 1.5, "top_p": 0.9, "top_k": 40, "ignore_eos": True}

    def tokens(seed: int | None) -> list[int]:
        return [t for c in _answer(model, PROMPTS[7], seed=seed, **fields) for t in c.token_ids]

    assert tokens(5) == tokens(5)
    assert len({tuple(tokens(s)) for s in (1, 2, 3)}) == 3
    greedy = [t for c in _answer(model, PROMPTS[7], max_tokens=24, ignore_eos=True) for t in c.token_ids]
    assert tokens(5) != greedy


def test_a_repetition_penalty_changes_a_repeating_answer(repo: Path, expected: dict[str, list[list[int]]]) -> None:
    model = _model(repo, "gpt2")
    i = next(i for i, t in enumerate(expected["gpt2"]) if len(t) == MAX_TOKENS and len(set(t)) < len(t) // 2)
    plain = [t for c in _answer(model, PROMPTS[i], max_tokens=MAX_TOKENS) for t in c.token_ids]
    penalised = [t for c in _answer(model, PROMPTS[i], max_tokens=MAX_TOKENS, repetition_penalty=3.0,
                                    ignore_eos=True) for t in c.token_ids]  # fmt: skip
    assert plain == expected["gpt2"][i]
    assert len(set(penalised)) > len(set(plain))
    # transformers' rule: a seen token's logit divided by the penalty if positive, multiplied if negative
    chooser = Chooser(False, 1.0, 0, 1.0, 2.0, None)
    logits = np.array([2.0, -2.0, 3.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(chooser.scores(logits, [0, 1, 1]), [1.0, -4.0, 3.0, -1.0])


def test_stop_strings_and_stop_token_ids_end_the_answer_with_finish_reason_stop(
    repo: Path, expected: dict[str, list[list[int]]]
) -> None:
    model = _model(repo, "gpt2")
    i = next(i for i, t in enumerate(expected["gpt2"]) if len(t) == MAX_TOKENS and len(model.decode(t)) > 20)
    whole = model.decode(expected["gpt2"][i])
    stop = whole[10:13]
    chunks = _answer(model, PROMPTS[i], max_tokens=MAX_TOKENS, stop=(stop, "never there"))
    text = "".join(c.text for c in chunks)
    assert text == whole[: whole.index(stop)] and chunks[-1].finish_reason == "stop"
    assert stop not in text
    token = expected["gpt2"][i][5]
    chunks = _answer(model, PROMPTS[i], max_tokens=MAX_TOKENS, stop_token_ids=(token,))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == expected["gpt2"][i][: expected["gpt2"][i].index(token) + 1]  # the stop token counted
    assert chunks[-1].finish_reason == "stop" and chunks[-1].completion_tokens == len(tokens)
    chunks = _answer(model, PROMPTS[i], max_tokens=4)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 4


def test_text_deltas_never_split_a_character(repo: Path) -> None:
    model = _model(repo, "gpt2")
    text = "Café, naïve, façade; Zürich, São Paulo and Kraków"
    ids = model.encode(text)
    assert any(model.decode([t]).endswith("\ufffd") for t in ids)  # characters split over tokens
    detokenizer = Detokenizer(model.decode)
    deltas = [detokenizer.add(t) for t in ids]
    assert "".join(deltas) + detokenizer.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    held = Detokenizer(model.decode, stop=("São P",))  # a stop string's start is held back, then cut
    shown = "".join(held.add(t) for t in ids) + held.flush()
    assert shown == text[: text.index("São P")] and held.stopped
    chunks = _answer(model, text, max_tokens=48, do_sample=True, seed=3, ignore_eos=True)
    tokens = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == model.decode(tokens)


def test_the_generation_metrics_count_what_was_served(served: RunningServer) -> None:
    with g.InferenceServerClient(served.url) as client:
        answers = [_infer(client, "t5", p, max_tokens=8) for p in PROMPTS[:4]]
    text = urllib.request.urlopen(served.metrics_url).read().decode()
    labels = {"model": "t5", "version": "1"}
    assert metric(text, "qkv_generation_tokens_total", kind="output", **labels) >= sum(
        a["completion_tokens"] for a in answers
    )
    assert metric(text, "qkv_generation_time_to_first_token_seconds_count", **labels) >= 4
    assert metric(text, "qkv_generation_queue_wait_seconds_count", **labels) >= 4
    assert metric(text, "qkv_generation_time_per_output_token_seconds_count", prompt_tokens="128", **labels) >= 1
    assert metric(text, "qkv_generation_kv_cache_budget_bytes", **labels) > 0
    assert metric(text, "qkv_generation_step_seconds_count", **labels) >= 8
    assert "qkv_generation_running_sequences{" in text and "qkv_generation_kv_cache_bytes{" in text


# --- how rows run together ------------------------------------------------------------------------------


def _sequence(length: int = 0, prompt: tuple[int, ...] = (5, 6)) -> Sequence:
    s = Sequence(
        GenerationRequest(prompt, 4), Chooser(False, 1.0, 0, 1.0, 1.0, None), Detokenizer(str), asyncio.Queue()
    )
    s.cache = [np.zeros((1, length, 1), dtype=np.float32)] if length else []
    return s


def test_decoding_rows_far_apart_in_length_run_in_separate_calls() -> None:
    from service.decoding.engine import PAD_SLACK, _by_length

    rows = [_sequence(n) for n in (200, 2000, 230, 180, 250, 90)]
    groups = [[s.length for s in g] for g in _by_length(rows)]
    assert groups == [[90, 180, 200, 230], [250], [2000]]  # 250 is over 2 x 90 + PAD_SLACK (64)
    assert all(max(g) <= 2 * min(g) + PAD_SLACK for g in groups)


def _decoder_calls(model: GenerationModel) -> list[list[int]]:
    """The self-attention cache lengths (pads left out) of the rows of each decoder-with-past call from now on."""
    graph = model.engine.graph
    assert isinstance(graph, Seq2SeqGraphs)
    calls: list[list[int]] = []
    step = graph.step

    def recorded(ids: Any, mask: Any, past: Any, self_mask: Any = None) -> Any:
        own = past[graph.past.self_attention.index(True)]
        calls.append([int(n) - 1 for n in self_mask.sum(axis=1)] if graph.masked else [own.shape[2]] * len(ids))
        return step(ids, mask, past, self_mask)

    graph.step = recorded  # type: ignore[method-assign]
    return calls


def _greedy_under_concurrency(model: GenerationModel, prompts: tuple[str, ...]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        model.start()
        window = asyncio.Semaphore(16)

        async def one(prompt: str) -> list[int]:
            async with window:
                chunks = await _collect(model, GenerationRequest(tuple(model.encode(prompt)), MAX_TOKENS))
                return [t for c in chunks for t in c.token_ids]

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await model.close()

    return asyncio.run(run())


def test_t5_decoder_rows_of_different_lengths_share_a_call(repo: Path, expected: dict[str, list[list[int]]]) -> None:
    model = _model(repo, "t5")
    graph = model.engine.graph
    assert isinstance(graph, Seq2SeqGraphs) and graph.masked  # the decoder was given a self-attention mask
    calls = _decoder_calls(model)
    assert _greedy_under_concurrency(model, PROMPTS[:32]) == expected["t5"][:32]
    mixed = [c for c in calls if len(set(c)) > 1]
    assert mixed and max(len(c) for c in mixed) > 8  # rows that joined at different steps decoded together
    assert max(max(c) - min(c) for c in mixed) > 8


def _unmasked_t5(repo: Path, root: Path) -> Path:
    """The T5 folder with the two decoders and no merged one, the decoder with past's self-attention
    scores put through a Mul by 1 before their Softmax: a graph whose softmaxes masking.py does not know."""
    import onnx
    from onnx import helper, numpy_helper

    folder = root / "t5-unmasked"
    shutil.copytree(repo / "t5", folder)
    (folder / "1" / "decoder_model_merged.onnx").unlink()
    path = folder / "1" / "decoder_with_past_model.onnx"
    model = onnx.load(path)
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(1.0, dtype=np.float32), "qkv_test_one"))
    nodes = []
    for node in graph.node:
        if node.op_type == "Softmax" and "SelfAttention" in node.name:
            scaled = node.input[0] + "/times_one"
            nodes.append(helper.make_node("Mul", [node.input[0], "qkv_test_one"], [scaled], name=scaled))
            node.input[0] = scaled
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, path)
    return folder


def test_a_decoder_whose_softmax_is_not_recognised_runs_rows_of_equal_length(
    repo: Path, expected: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    model = _model(_unmasked_t5(repo, tmp_path).parent, "t5-unmasked")
    graph = model.engine.graph
    assert isinstance(graph, Seq2SeqGraphs) and not graph.masked and not graph.merged
    calls = _decoder_calls(model)
    assert _greedy_under_concurrency(model, PROMPTS[:24]) == expected["t5"][:24]
    assert calls and all(len(set(c)) == 1 for c in calls)  # every call's rows of one length


def test_new_encoder_decoder_sequences_join_together_only_where_rows_run_by_length(repo: Path, tmp_path: Path) -> None:
    engine = _model(_unmasked_t5(repo, tmp_path).parent, "t5-unmasked").engine
    engine.running = [_sequence()]
    engine.waiting = [_sequence(), _sequence()]
    engine._admit()
    assert len(engine.running) == 1  # two of the 8 it waits for, and not yet its 20 ms
    engine.waiting[0].arrived -= 1.0
    engine._admit()
    assert len(engine.running) == 3 and not engine.waiting  # the oldest waited long enough: both join
    engine.running, engine.waiting = [], [_sequence()]
    engine._admit()
    assert len(engine.running) == 1  # an idle engine starts a request at once
    masked = _model(repo, "t5").engine  # rows of any length decode together: nothing waits for company
    masked.running, masked.waiting = [_sequence()], [_sequence()]
    masked._admit()
    assert len(masked.running) == 2 and not masked.waiting
