"""Incremental decoding with the key/value cache as implicit state: g2p's graphs wrapped as a stateful model
(export/stateful_decoder.py), driven one token a request by tritonclient, answer as g2p does in one request.

And what it needs of the sequence batcher: a state that grows a position a step, and batches whose rows
share their shapes (rows of another shape wait for the next batch, as Triton batches them).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from export import data
from export.stateful_decoder import MODEL_NAME, write_model
from service.scheduling.sequence import SequenceBatcher, SequenceStep
from service.scheduling.sequence_config import Control, InitialState, SequenceConfig, StateSpec
from service.seq2seq.graphs import GRAPH_POSITIONS
from service.seq2seq.vocab import Vocabulary
from service.tools.incremental import IncrementalG2P, compare_with_g2p, one_shot
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.figures import FIGURES

# --- the batcher: a growing state, rows batched only with rows of their shapes --------------------------------


class Appender:
    """A stateful model in numpy: PRESENT = PAST with X appended (the state grows by X's width a step),
    Y = PRESENT's sum. Records each batch's rows as (id, width of PAST, width of X, ready); the first batch
    holds until `gate` opens, so that the requests behind it queue up."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.batches: list[list[tuple[int, int, int, bool]]] = []

    def __call__(self, steps: list[SequenceStep], instance: int) -> list[dict[str, np.ndarray]]:
        self.gate.wait(10)
        self.batches.append([(int(s.sequence_id), s.feeds["PAST"].shape[1], s.feeds["X"].shape[1], s.ready)
                             for s in steps])  # fmt: skip
        past = np.concatenate([s.feeds["PAST"] for s in steps])  # fails unless the rows share their shapes
        present = np.concatenate([past, np.concatenate([s.feeds["X"] for s in steps])], axis=1)
        rows = [present[i : i + 1] for i in range(len(steps))]
        return [{"PRESENT": row, "Y": row.sum(1, keepdims=True)} for row in rows]


def _config(strategy: str) -> SequenceConfig:
    growing = StateSpec("PAST", "PRESENT", "INT32", (-1,), InitialState("INT32", (0,)))
    controls = (Control("START", "START", "INT32", (0, 1)), Control("READY", "READY", "INT32", (0, 1)))
    return SequenceConfig(strategy=strategy, controls=controls, states=(growing,))


@pytest.mark.parametrize("strategy", ["oldest", "direct"])
def test_a_state_grows_a_step_and_only_rows_of_equal_shapes_share_a_batch(strategy: str) -> None:
    """Three sequences with words of widths 1, 2 and 1 (then one value a step), queued behind a held batch:
    each answer is the running sum, every batch's rows share their shapes, and the rows of the two width-1
    sequences still run together."""
    model = Appender()

    async def run() -> list[list[int]]:
        batcher = SequenceBatcher("appender", _config(strategy), model, max_batch_size=4)
        batcher.start()
        loop = asyncio.get_running_loop()

        async def sequence(sid: int, steps: int, width: int) -> list[int]:
            out = []
            for t in range(steps):
                x = np.full((1, width if t == 0 else 1), sid, np.int32)
                step = SequenceStep(sid, t == 0, t == steps - 1, {"X": x}, loop.create_future())
                out.append(int((await batcher.submit(step))["Y"][0, 0]))
            return out

        held = asyncio.ensure_future(sequence(9, 1, 1))  # the held batch, then everyone queues behind it
        await asyncio.sleep(0.05)
        others = asyncio.gather(sequence(1, 3, 1), sequence(2, 4, 2), sequence(3, 2, 1))
        await asyncio.sleep(0.05)
        model.gate.set()
        answers = await others
        await held
        assert batcher.live == {} and batcher.state_bytes == 0  # every sequence ended and its state freed
        await batcher.close()
        return answers

    assert asyncio.run(run()) == [[1, 2, 3], [4, 6, 8, 10], [3, 6]]
    for rows in model.batches:
        ready = [(past, x) for _, past, x, is_ready in rows if is_ready]
        assert len(set(ready)) == 1, rows  # one shape a batch (filler rows take that shape)
    firsts = [sorted(sid for sid, past, _, ready in rows if ready and past == 0) for rows in model.batches[1:]]
    assert [1, 3] in firsts and [2] in firsts  # 1 and 3 started together; 2's wider word alone


# --- the model on a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """g2p (the shipped one) and g2p_decoder built from its version 2; `g2p_decoder_small`: the same graph
    with max_state_bytes that holds one word of 9 letters and 6 cached tokens."""
    repo = tmp_path_factory.mktemp("kv") / "models"
    repo.mkdir()
    (repo / "g2p").symlink_to(MODELS / "g2p")
    write_model(MODELS / "g2p" / "2", repo / MODEL_NAME)
    small = repo / "g2p_decoder_small"
    (small / "2").mkdir(parents=True)
    (small / "2" / "model.onnx").symlink_to(repo / MODEL_NAME / "2" / "model.onnx")
    config = json.loads((repo / MODEL_NAME / "config.json").read_text())
    word, slot = 9 * 2 * 4 * 4 * 64 * 4 + 9 * 8, 2 * 4 * 4 * 64 * 4  # bytes: the encoded word, a cache slot
    config["name"] = small.name
    config["sequence_batching"]["max_state_bytes"] = word + 6 * slot
    (small / "config.json").write_text(json.dumps(config))
    # a generous bound on a hang: the wrapped graphs take a loaded machine long to load
    s = start_server(["--model-repository", str(repo)], repo.parent / "server.log", timeout=300)
    yield s
    stop_server(s)


def _inputs(ids: list[int], token: int) -> list[grpcclient.InferInput]:
    word = grpcclient.InferInput("input_ids", [1, len(ids)], "INT64")
    word.set_data_from_numpy(np.array([ids], dtype=np.int64))
    previous = grpcclient.InferInput("token", [1, 1], "INT64")
    previous.set_data_from_numpy(np.array([[token]], dtype=np.int64))
    return [word, previous]


def test_incremental_answers_equal_g2p_one_shot_on_a_test_split_sample(decoder_server: RunningServer) -> None:
    words = random.Random(5).sample(data.read_split("test"), 200)
    result = compare_with_g2p(decoder_server.url, words, concurrency=4)
    FIGURES["incremental decoding"] = {"g2p_decoder vs one-shot g2p, 200 test words": str(result)}
    assert result.equal == result.words == 200, result.differing[:5]


def test_one_request_a_token_and_the_state_stays_on_the_server(decoder_server: RunningServer) -> None:
    decoder = IncrementalG2P(decoder_server.url)
    try:
        tokens = decoder.tokens("attention")
        # a request per output token, one that answers </s>, one that ends the sequence
        assert decoder.requests == len(tokens) + 2
        reference = grpcclient.InferenceServerClient(decoder_server.url)
        assert one_shot(reference, "attention") == (["attention"], " ".join(decoder.phonemes_vocabulary.decode(tokens)))
        metadata = reference.get_model_metadata(MODEL_NAME, as_json=True)
        assert [i["name"] for i in metadata["inputs"]] == ["input_ids", "token"]  # START and the state are the server's
        reference.close()
    finally:
        decoder.close()


def test_bad_input_is_refused_by_name_and_the_sequence_goes_on(decoder_server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(decoder_server.url)
    decoder = IncrementalG2P(decoder_server.url)
    ids = decoder.graphemes.encode("attention")
    try:
        first = client.infer(MODEL_NAME, _inputs(ids, 1), sequence_id=41, sequence_start=True)
        refused: dict[str, str] = {}
        for what, inputs in {
            "token": _inputs([0], 73),
            "input_ids": _inputs([40], 5),
            "length": _inputs([7] * 33, 5),
        }.items():
            with pytest.raises(InferenceServerException) as e:
                client.infer(MODEL_NAME, inputs, sequence_id=41)
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
            refused[what] = e.value.message()
        assert "input 'token': token id 73 outside the vocabulary [0, 73)" in refused["token"]
        assert "input 'input_ids': token id 40 outside the vocabulary [0, 33)" in refused["input_ids"]
        assert "sequence length 33 exceeds model 'g2p_decoder' limit of 32" in refused["length"]
        state = grpcclient.InferInput("past_keys", [1, 4, 4, 1, 64], "FP32")
        state.set_data_from_numpy(np.zeros((1, 4, 4, 1, 64), np.float32))
        with pytest.raises(InferenceServerException, match="has no input 'past_keys' \\(inputs: input_ids, token\\)"):
            client.infer(MODEL_NAME, [*_inputs([0], 1), state], sequence_id=41)
        # The refusals left the sequence where it was: its next step answers as an undisturbed decoder's.
        token = int(first.as_numpy("log_probs").argmax())
        second = client.infer(MODEL_NAME, _inputs([0], token), sequence_id=41, sequence_end=True)
        assert decoder.tokens("attention")[:2] == [token, int(second.as_numpy("log_probs").argmax())]
    finally:
        client.close()
        decoder.close()


def test_the_growing_cache_is_bounded_by_max_state_bytes(decoder_server: RunningServer) -> None:
    """The small copy holds a 9-letter word's encoding and 6 cache slots: the start holds 1 slot, each step
    adds one, so the sixth request's state passes the bound and the sequence ends there."""
    client = grpcclient.InferenceServerClient(decoder_server.url)
    ids = Vocabulary.load(MODELS / "g2p" / "2" / "graphemes.json").encode("attention")
    answers: list[Any] = []
    try:
        with pytest.raises(InferenceServerException) as e:
            for t in range(10):
                answers.append(client.infer("g2p_decoder_small", _inputs(ids if t == 0 else [0], 1), sequence_id=7,
                                            sequence_start=t == 0))  # fmt: skip
        assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "max_state_bytes" in e.value.message() and "the sequence is ended" in e.value.message()
        assert len(answers) == 5
        with pytest.raises(InferenceServerException, match="sequence 7 is not live"):
            client.infer("g2p_decoder_small", _inputs([0], 1), sequence_id=7)
    finally:
        client.close()


def test_decoding_past_the_graphs_positions_is_refused_by_name_and_ends_the_word(decoder_server: RunningServer) -> None:
    """Request n runs with n cache slots; the graphs cover GRAPH_POSITIONS. A client that decodes on past
    </s> gets every request up to that many answered, then INVALID_ARGUMENT naming the bound (not
    onnxruntime's failure inside the graph), and the word is ended."""
    client = grpcclient.InferenceServerClient(decoder_server.url)
    ids = Vocabulary.load(MODELS / "g2p" / "2" / "graphemes.json").encode("attention")
    try:
        for t in range(GRAPH_POSITIONS):
            client.infer(MODEL_NAME, _inputs(ids if t == 0 else [0], 1), sequence_id=9, sequence_start=t == 0)
        with pytest.raises(InferenceServerException) as e:
            client.infer(MODEL_NAME, _inputs([0], 1), sequence_id=9)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"has had {GRAPH_POSITIONS} requests, sequence_batching.max_sequence_requests" in e.value.message()
        with pytest.raises(InferenceServerException, match="sequence 9 is not live"):
            client.infer(MODEL_NAME, _inputs([0], 1), sequence_id=9, sequence_end=True)
    finally:
        client.close()
