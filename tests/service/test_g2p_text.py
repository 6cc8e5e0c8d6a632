"""Text as people write it: the reading rules (service/models/g2p/text.py) on a corpus of awkward
sentences, then the same sentences through a real server over gRPC and HTTP, every one answered, with a
pronunciation or a reason per word."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as g
import tritonclient.http as h
from hypothesis import given, settings
from hypothesis import strategies as st

from service.models.g2p.lexicon import LEXICON_FILE, Lexicon
from service.models.g2p.model import THREAD_TEXT_BYTES, count_words, normalize_word
from service.models.g2p.text import RULES, _Reader, _strip, cardinal, fold, is_symbol, ordinal, spoken_words, year
from service.tools.bench.servers import variant
from tests.conftest import MODELS, RunningServer, start_server, stop_server
from tests.service.test_http import post

EN_1 = {"text_normalization": "en-1"}  # the request parameter that pins the rules en-1
# Awkward sentences and the words they read as (docs/model.md, "Text normalisation"), by en-1 and en-2 alike.
CORPUS = [
    ("Dr. Smith paid $5 on 3/4", "doctor smith paid five dollars on three quarters"),
    ("naïve café", "naive cafe"),
    ("Straße, Æsop and Øresund", "strasse aesop and oresund"),
    ("Müller’s crème brûlée", "muller's creme brulee"),
    ("I was born in 1999; she in 2005.", "i was born in nineteen ninety nine she in two thousand five"),
    ("It was 1905, then 1900, then 2024", "it was nineteen oh five then nineteen hundred then twenty twenty four"),
    ("1,999 people and 1000 cats", "one thousand nine hundred ninety nine people and one thousand cats"),
    ("He came 3rd, she 21st, they 100th", "he came third she twenty first they one hundredth"),
    ("$3.50, £1.01 and €2", "three dollars fifty cents one pound one penny and two euros"),
    ("It cost $0.05, or ¥500", "it cost five cents or five hundred yen"),
    ("a $5 million deal, $1.5 billion", "a five million dollars deal one point five billion dollars"),
    ("42 and 1,234,567", "forty two and one million two hundred thirty four thousand five hundred sixty seven"),
    ("pi is 3.14, not .5 or -7", "pi is three point one four not point five or minus seven"),
    ("Add 1/2 cup, then 1 1/2, then 5/8", "add one half cup then one and one half then five eighths"),
    ("Meet at 3:30 pm, not 3:00 or 3:05", "meet at three thirty p.m. not three o'clock or three oh five"),
    ("At 15:00, 7pm and 9 a.m.", "at fifteen hundred seven p.m. and nine a.m."),
    ("Up 50% or 3.5 %", "up fifty percent or three point five percent"),
    ("Mr. & Mrs. Jones vs. the rest", "mister and missus jones versus the rest"),
    ("St. Louis is not Main St.", "saint louis is not main street"),
    ("I live on Elm Dr., Springfield", "i live on elm drive springfield"),
    ("apples, pears, etc.", "apples pears et cetera"),
    ("No. 5 is #1", "number five is number one"),
    ("the 1990s and the '80s", "the nineteen nineties and the eighties"),
    ("Bond, 007", "bond zero zero seven"),
    ("AT&T and/or mp3", "at and t and or mp three"),
    ("“Hello,” she said — (quietly)!", "hello she said quietly"),
    ("c.o.d. is fine. So is state-of-the-art", "c.o.d. is fine so is state-of-the-art"),
    ("½ ² ﬁne ＡＢＣ", "one half two fine abc"),
    ("pneumonoultramicroscopicsilicovolcanoconiosis", "pneumonoultramicroscopi csilicovolcanoconiosis"),
    ("I love 中文 food 🍕", "i love 中文 food 🍕"),
]


@pytest.mark.parametrize(("text", "words"), CORPUS)
def test_sentences_read_as_english_words(text: str, words: str) -> None:
    assert spoken_words(text) == words.split()


@pytest.mark.parametrize(
    ("n", "cardinal_words", "ordinal_words"),
    [
        (0, "zero", "zeroth"),
        (7, "seven", "seventh"),
        (12, "twelve", "twelfth"),
        (40, "forty", "fortieth"),
        (42, "forty two", "forty second"),
        (100, "one hundred", "one hundredth"),
        (1001, "one thousand one", "one thousand first"),
        (2_000_000, "two million", "two millionth"),
    ],
)
def test_cardinals_and_ordinals(n: int, cardinal_words: str, ordinal_words: str) -> None:
    assert " ".join(cardinal(n)) == cardinal_words
    assert " ".join(ordinal(n)) == ordinal_words


@pytest.mark.parametrize(
    ("n", "words"),
    [(1999, "nineteen ninety nine"), (2005, "two thousand five"), (2000, "two thousand"), (1100, "eleven hundred"),
     (1905, "nineteen oh five"), (2010, "twenty ten")],
)  # fmt: skip
def test_years(n: int, words: str) -> None:
    assert " ".join(year(n)) == words


@pytest.mark.parametrize(
    ("text", "folded"),
    [("naïve", "naive"), ("ß", "ss"), ("æ", "ae"), ("Ø", "O"), ("ł", "l"), ("’", "'"), ("中文", "中文"), ("🍕", "🍕")],
)
def test_folding_keeps_what_is_not_latin(text: str, folded: str) -> None:
    assert fold(text) == folded


def test_long_words_are_cut_to_the_limit_at_hyphens_first() -> None:
    assert spoken_words("a" * 70, max_letters=32) == ["a" * 24, "a" * 24, "a" * 22]
    assert spoken_words("x" * 20 + "-" + "y" * 20, max_letters=32) == ["x" * 20, "y" * 20]
    assert spoken_words("x" * 20 + "-" + "y" * 5, max_letters=32) == ["x" * 20 + "-" + "y" * 5]
    assert spoken_words("1" * 40) == ["one"] * 40  # past 15 digits, digit by digit


def test_reading_stops_past_the_word_limit() -> None:
    """A text that reads as too many words is read no further than the token that crosses the limit."""
    assert spoken_words("1 2 3 4 5 6", max_words=3) == ["one", "two", "three", "four"]
    assert spoken_words("1" * 1000 + " more", max_words=10) == ["one"] * 11


def test_normalize_word_reads_one_written_word() -> None:
    assert normalize_word("$5") == "five dollars"
    assert normalize_word("Hello,") == "hello" and normalize_word("--") == ""


@pytest.mark.parametrize(("text", "words"), CORPUS)
def test_the_raw_count_counts_each_written_word_once(text: str, words: str) -> None:
    """The limit checked before any work counts words as written, one per token that reads as any."""
    written = [t for t in text.split() if spoken_words(t)]
    assert count_words(text.encode()) == len(written)


def test_the_card_names_the_rules() -> None:
    card = json.loads((MODELS / "g2p" / "config.json").read_text())["model_card"]
    assert card["text_normalization"] == RULES
    assert all(v["text_normalization"] == RULES for v in card["versions"].values())


# --- a real server ------------------------------------------------------------------------------------------


def _text(sentences: list[str], client: type[g.InferInput] | type[h.InferInput]) -> g.InferInput | h.InferInput:
    text = client("TEXT", [len(sentences)], "BYTES")
    text.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=object))
    return text


def _decoded(result: g.InferResult | h.InferResult, name: str) -> list[str]:
    return [x.decode() for x in result.as_numpy(name)]


def _answers(client: g.InferenceServerClient | h.InferenceServerClient) -> tuple[list[str], list[str], list[str]]:
    """The corpus in requests of 4 sentences (max_words counts words as written): PHONEMES, WORDS, REASONS,
    read by the rules `en-1` as a client that pins them asks (the corpus is theirs)."""
    grpc = isinstance(client, g.InferenceServerClient)
    tensor, output = (g.InferInput, g.InferRequestedOutput) if grpc else (h.InferInput, h.InferRequestedOutput)
    names = ("PHONEMES", "WORDS", "REASONS")
    out: tuple[list[str], list[str], list[str]] = ([], [], [])
    for i in range(0, len(CORPUS), 4):
        sentences = [s for s, _ in CORPUS[i : i + 4]]
        wanted = [output(n) for n in names]
        result = client.infer("g2p", [_text(sentences, tensor)], outputs=wanted, parameters=EN_1)
        for answers, name in zip(out, names, strict=True):
            answers += _decoded(result, name)
    return out


def test_the_corpus_is_answered_over_grpc_word_for_word(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    phonemes, words, reasons = _answers(client)
    assert words == [w for _, ws in CORPUS for w in ws.split()]
    assert len(reasons) == len(words)
    k = 0
    for (sentence, expected), said in zip(CORPUS, phonemes, strict=True):
        parts = said.split(" | ")
        assert len(parts) == len(expected.split()), sentence
        for part, why in zip(parts, reasons[k : k + len(parts)], strict=True):
            assert bool(part) != bool(why), (sentence, part, why)  # a pronunciation, or a reason
        k += len(parts)
    unspelled = {w: r for w, r in zip(words, reasons, strict=True) if r}
    assert unspelled == {
        "中文": "the model cannot spell character '中' (U+4E2D) in '中文'",
        "🍕": "the model cannot spell character '🍕' (U+1F355) in '🍕'",
    }
    # A word's phonemes do not depend on the text around it: "food" beside the unspellable, and alone.
    alone = _decoded(client.infer("g2p", [_text(["food"], g.InferInput)]), "PHONEMES")
    assert phonemes[-1].split(" | ")[3] == alone[0]


def test_clients_that_ask_for_nothing_new_get_the_old_outputs(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    result = client.infer("g2p", [_text(["I love 中文 food"], g.InferInput)])
    assert [o.name for o in result.get_response().outputs] == ["PHONEMES"]
    said = _decoded(result, "PHONEMES")[0].split(" | ")
    assert len(said) == 4 and said[2] == "" and all(said[i] for i in (0, 1, 3))


def test_only_unspellable_words_are_answered_without_decoding(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    wanted = [g.InferRequestedOutput(n) for n in ("PHONEMES", "REASONS", "ATTENTION")]
    decoded = {**EN_1, "lexicon": False}  # "ok" decoded, not looked up: its attention
    result = client.infer("g2p", [_text(["中文 🍕", "ok"], g.InferInput)], outputs=wanted, parameters=decoded)
    assert _decoded(result, "PHONEMES")[0] == " | "
    assert all("cannot spell character" in r for r in _decoded(result, "REASONS")[:2])
    attention = result.as_numpy("ATTENTION")
    assert attention.shape[0] == 3 and not attention[:2].any() and attention[2].any()  # a row per word


def test_http_answers_as_grpc_does(server: RunningServer) -> None:
    assert _answers(h.InferenceServerClient(server.http_url)) == _answers(g.InferenceServerClient(server.url))


def test_generate_reads_the_text_before_decoding(server: RunningServer) -> None:
    body = json.dumps({"text_input": "Dr. Smith paid $5 on 3/4"}).encode()
    status, _, answer = post(server.http_url, "/v2/models/g2p/generate", body)
    assert status == 200
    assert len(json.loads(answer)["text_output"].split(" | ")) == 8


def test_the_rules_version_is_in_the_model_config(server: RunningServer) -> None:
    config = g.InferenceServerClient(server.url).get_model_config("g2p").config
    assert config.parameters["text_normalization"].string_value == RULES


def test_a_card_pinning_other_rules_is_not_served(tmp_path: Path) -> None:
    """Answers are reproducible: a model whose card names rules this server does not have is refused."""
    repo = variant(MODELS, tmp_path / "models", {"g2p": {"model_card": {"text_normalization": "en-0"}}})
    with pytest.raises(RuntimeError) as refused:
        stop_server(start_server(["--model-repository", str(repo)], tmp_path / "server.log"))
    why = "model card asks for text_normalization 'en-0', this server reads text by rules 'en-1', 'en-2'"
    assert why in str(refused.value)


@settings(max_examples=2000, deadline=None, database=None)
@given(st.text(max_size=80) | st.text(alphabet="0123456789$£.,:/%-#&' amp", max_size=30))
def test_any_text_reads_as_words_within_the_limit(text: str) -> None:
    words = spoken_words(text, max_letters=8)
    assert all(w and len(w) <= 8 and not any(c.isspace() for c in w) for w in words), words


class RulesOnly(_Reader):
    """Every token through the rules: the reading that plain words skip to their answer."""

    def read(self) -> Iterator[str]:
        while self.index < len(self.tokens):
            core, period = _strip(self.tokens[self.index])
            if core:
                yield from self._token(core, period)
            self.index += 1


PUNCTUATION = st.text(alphabet=".,;:!?()\"'-#$", max_size=2)
WORDS = st.text(alphabet="abcXYZ", min_size=1, max_size=5) | st.sampled_from(
    ["Dr", "st", "No", "mr", "Jan", "vs", "pm", "am", "million", "e.g", "5", "1999", "3/4", "7:30", "Smith"]
)


@settings(max_examples=3000, deadline=None, database=None)
@given(st.lists(st.tuples(PUNCTUATION, WORDS, PUNCTUATION).map("".join), max_size=6))
def test_plain_words_read_as_the_rules_read_them(tokens: list[str]) -> None:
    """Plain words skip the rules (most of real text) to what the rules would make of them."""
    assert list(_Reader(tokens).read()) == list(RulesOnly(tokens).read())


def test_a_large_text_is_read_off_the_event_loop_and_answers_the_same(server: RunningServer) -> None:
    """Over 4 KiB of text (THREAD_TEXT_BYTES) is read on a worker thread: the same words, the same answer."""
    client = g.InferenceServerClient(server.url)
    shouted = ["Hello" + "!" * 995, "£3.50" + "?" * 995] * 3
    assert sum(map(len, shouted)) > THREAD_TEXT_BYTES
    big = client.infer("g2p", [_text(shouted, g.InferInput)], outputs=[g.InferRequestedOutput("PHONEMES")])
    small = client.infer("g2p", [_text(["hello", "£3.50"] * 3, g.InferInput)])
    assert _decoded(big, "PHONEMES") == _decoded(small, "PHONEMES")
    assert [len(p.split(" | ")) for p in _decoded(big, "PHONEMES")] == [1, 4] * 3


# --- en-2: read with the pronouncing lexicon -----------------------------------------------------------------

# en-2's additions, with the words the shipped lexicon knows; and how en-1 reads the same (unchanged).
EN_2 = [
    ("naïve café", "naive cafe", "naive cafe"),
    ("In 1999, the 1980s", "in nineteen ninety nine the nineteen eighties",
     "in nineteen ninety nine the nineteen eighties"),
    ("1st and 22nd", "first and twenty second", "first and twenty second"),
    ("call 555-0123", "call five five five zero one two three", "call five hundred fifty five zero one two three"),
    ("(555) 123-4567 or 555.123.4567", "five five five one two three four five six seven or five five five one two "
     "three four five six seven", "five hundred fifty five one hundred twenty three four thousand five hundred "
     "sixty seven or five hundred fifty five one hundred twenty three four thousand five hundred sixty seven"),
    ("+1-555-123-4567", "one five five five one two three four five six seven",
     "plus one five hundred fifty five one hundred twenty three four thousand five hundred sixty seven"),
    ("see https://example.com", "see example dot com", "see https example.com"),
    ("mail bob.smith@example.org", "mail bob dot smith at example dot org", "mail bob.smith at example.org"),
    ("www.example.co.uk/docs/page_2", "w w w dot example dot co dot uk slash docs slash page underscore two",
     "www.example.co.uk docs page two"),
    ("ftp://files.example.net:8080", "f t p files dot example dot net colon eight thousand eighty",
     "ftp files.example.net eight thousand eighty"),
    ("e.g. node.js, 3.14 and c.o.d.", "for example node.js three point one four and c.o.d.",
     "for example node.js three point one four and c.o.d."),
    ("state-of-the-art deep-learning", "state-of-the-art deep learning", "state-of-the-art deep-learning"),
    ("antidisestablishmentarianismwhatever", "antidisestablishmentarianism whatever",
     "antidisestablishme ntarianismwhatever"),
    ("Meet at 3:30 pm on 3/4", "meet at three thirty p.m. on three quarters",
     "meet at three thirty p.m. on three quarters"),
    ("I love 🍕", "i love 🍕", "i love 🍕"),
]  # fmt: skip


@pytest.fixture(scope="module")
def known() -> Lexicon:
    return Lexicon.load(MODELS / "g2p" / "2" / LEXICON_FILE)


@pytest.mark.parametrize(("text", "en_2", "en_1"), EN_2)
def test_en_2_reads_numbers_addresses_and_compounds_as_spoken(known: Lexicon, text: str, en_2: str, en_1: str) -> None:
    assert spoken_words(text, known=known.known) == en_2.split()
    assert spoken_words(text, rules="en-1", known=known.known) == en_1.split()  # en-1 as it was, lexicon or not


def test_en_2_splits_only_words_the_lexicon_lacks(known: Lexicon) -> None:
    """A compound: at most two known words of four letters or more; a word the lexicon has stays whole."""
    assert spoken_words("bookshelf xylophonebookshelf dataset pizzaboxes") == [
        "bookshelf", "xylophonebookshelf", "dataset", "pizzaboxes"
    ]  # fmt: skip
    assert spoken_words("bookshelf xylophonebookshelf qwzzbix", known=known.known) == [
        "bookshelf", "xylophone", "bookshelf", "qwzzbix"
    ]  # fmt: skip
    too_long = "x" * 40
    assert spoken_words(too_long, known=known.known) == ["x" * 20, "x" * 20]  # no known parts: cut as before


@pytest.mark.parametrize(("word", "symbol"), [("🍕", True), ("👍🏽", True), ("❤️", True), ("→", True), ("€", True),
                                              ("中文", False), ("a", False), ("", False), ("🍕a", False)])  # fmt: skip
def test_symbols_are_what_en_2_drops(word: str, symbol: bool) -> None:
    assert is_symbol(word) is symbol


def test_en_2_answers_the_issue_examples_over_grpc(server: RunningServer) -> None:
    client = g.InferenceServerClient(server.url)
    names = ("PHONEMES", "WORDS", "REASONS", "SOURCES")
    texts = ["naïve café", "In 1999", "call 555-0123", "see https://example.com", "I love 🍕 pizza"]
    result = client.infer("g2p", [_text(texts, g.InferInput)], outputs=[g.InferRequestedOutput(n) for n in names])
    phonemes, words, reasons, sources = (_decoded(result, n) for n in names)
    assert " ".join(words) == (
        "naive cafe in nineteen ninety nine call five five five zero one two three see example dot com i love 🍕 pizza"
    )
    assert (
        phonemes[0] == "N AY2 IY1 V | K AH0 F EY1"
        and phonemes[3] == "S IY1 | IH0 G Z AE1 M P AH0 L | D AA1 T | K AA1 M"
    )
    assert phonemes[4] == "AY1 | L AH1 V | P IY1 T S AH0"  # the emoji dropped, no separator left
    assert reasons[-2] == "symbol '🍕' is not read: dropped, with no separator in PHONEMES" and sources[-2] == "rule"
    assert set(sources) - {"rule"} == {"lexicon"}
    pinned = client.infer("g2p", [_text(texts[-1:], g.InferInput)], parameters=EN_1)
    assert _decoded(pinned, "PHONEMES") == ["AY1 | L AH1 V |  | P IY1 T S AH0"]  # en-1: as it answered


def test_a_card_pinning_en_1_is_served_by_en_1(tmp_path: Path) -> None:
    """A model card that pins en-1 keeps its reading: its config says so and its answers are en-1's."""
    pin = {"text_normalization": "en-1", "versions": {"1": {"text_normalization": "en-1"}}}
    repo = variant(MODELS, tmp_path / "models", {"g2p": {"model_card": pin}})
    s = start_server(["--model-repository", str(repo)], tmp_path / "server.log")
    try:
        client = g.InferenceServerClient(s.url)
        assert client.get_model_config("g2p").config.parameters["text_normalization"].string_value == "en-1"
        result = client.infer("g2p", [_text(["see https://example.com"], g.InferInput)],
                              outputs=[g.InferRequestedOutput("WORDS")])  # fmt: skip
        assert _decoded(result, "WORDS") == ["see", "https", "example.com"]
    finally:
        stop_server(s)
