"""The g2p kind: TEXT -> PHONEMES (and ATTENTION, WORDS, REASONS, SOURCES, VARIANTS on request): text read
into words by service/models/g2p/text.py; each word a pronouncing lexicon holds answered from it
(service/models/g2p/lexicon.py), each other one decoded on the shared continuous batch."""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from service.datatypes import InputLimits
from service.decoding.words import greedy_decode
from service.errors import InvalidArgument, ServingError, quote
from service.models.common import Metadata, ModelStats, Result, check_inputs, check_outputs
from service.models.g2p.lexicon import Lexicon
from service.models.g2p.runtime import G2PRuntime
from service.models.g2p.text import RULES, SILENT_ASCII, SILENT_WIDE, VERSIONS, Known, is_symbol, spoken_words
from service.models.response_cache import ResponseCache, deep_size
from service.models.response_cache import key as cache_key
from service.models.runtime import TensorSpec
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import WorkItem
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.scheduling.leases import InFlight
from service.seq2seq.generation import Hypothesis
from service.seq2seq.vocab import SPECIALS

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["G2PModel", "count_words", "normalize_word"]

log = logging.getLogger("qkv.models")

# A g2p request with more text than this is read into words on a worker thread (the text rules take up
# to some 3 us a byte: a few KiB are read on the event loop in well under the time of a decoding step).
THREAD_TEXT_BYTES = 1 << 12
# Words a g2p request's text may read as, per word written (max_words): "$3.50" is four, "1999" three.
SPOKEN_PER_WORD = 4
SEED_RUNS = 3  # timed full batches at warm-up: admission's first capacity is the fastest


# Words counted on the raw bytes, before any is decoded or normalized (count_words): whitespace as
# str.split sees it, and punctuation the text rules do not read (a token of it alone is no word).
_ASCII_STRIP = SILENT_ASCII.encode()
_WIDE_STRIP = [c.encode() for c in SILENT_WIDE]
_WIDE_SPACES = [chr(c).encode() for c in range(0x80, 0x3001) if chr(c).isspace()]
_SPACE_OR_LETTER = bytes(0x20 if chr(b).isspace() else 0x61 for b in range(0x80)) + b"a" * 0x80


def count_words(text: bytes) -> int:
    """The words written in `text` (UTF-8), as the text rules see them before reading them out (a token
    of punctuation alone is none), counted by C-level passes over the bytes: no Python object per word,
    so a flood of words is refused before any is built."""
    if not text.isascii():  # wide spaces and marks are more than a byte
        for space in _WIDE_SPACES:
            if space in text:
                text = text.replace(space, b" ")
        for mark in _WIDE_STRIP:
            if mark in text:
                text = text.replace(mark, b"")
    letters = text.translate(_SPACE_OR_LETTER, _ASCII_STRIP)  # " " between words, "a" inside one
    return letters.count(b" a") + letters.startswith(b"a")


def normalize_word(token: str) -> str:
    """What one written word reads as, the spoken words space-separated ("$5" -> "five dollars",
    "Hello," -> "hello", "c.o.d." -> "c.o.d."; "" for punctuation alone): service/models/g2p/text.py."""
    return " ".join(spoken_words(token))


def _control_character(text: str) -> str | None:
    """The first control character in `text` that is not whitespace: no text rule reads one."""
    if text.isprintable():
        return None
    return next((c for c in text if unicodedata.category(c) == "Cc" and not c.isspace()), None)


def _text(element: object) -> str:
    """A BYTES element as text (bytes that are not UTF-8 replaced)."""
    return element.decode(errors="replace") if isinstance(element, bytes) else str(element)


def _kept(h: Hypothesis) -> Hypothesis:
    """A word's answer as the cache keeps it: no caller's handle, and attention rows of their own (a beam's
    rows are views of the whole beam's history, which a kept row would hold)."""
    return replace(h, tag=None, attention=[a if a.base is None else a.copy() for a in h.attention])


# Where a word's answer came from (output SOURCES): a text rule (a symbol dropped), the pronouncing
# lexicon, or the model; "" for a word without one (REASONS says why).
SOURCE_RULE, SOURCE_LEXICON, SOURCE_MODEL = "rule", "lexicon", "model"
_DROPPED = "symbol {} is not read: dropped, with no separator in PHONEMES"


class G2PModel:
    kind = "g2p"
    platform = "qkv_g2p"
    compute_span = "qkv.decode"
    inputs: ClassVar[list[TensorSpec]] = [TensorSpec("TEXT", "BYTES", (-1,), ("batch",))]
    outputs: ClassVar[list[TensorSpec]] = [
        TensorSpec("PHONEMES", "BYTES", (-1,), ("batch",)),
        TensorSpec("ATTENTION", "FP32", (-1, -1, -1), ("word", "phoneme", "grapheme")),
        TensorSpec("WORDS", "BYTES", (-1,), ("word",)),  # the words read from TEXT, all elements in order
        TensorSpec("REASONS", "BYTES", (-1,), ("word",)),  # why a word has no phonemes; empty when it has
        TensorSpec("SOURCES", "BYTES", (-1,), ("word",)),  # where each word's answer came from (SOURCE_*)
        TensorSpec("VARIANTS", "BYTES", (-1, -1), ("word", "variant")),  # each word's pronunciations, "" padded
    ]
    text_rules = RULES  # the reading rules' version, which the model card may pin

    def __init__(
        self, config: ModelConfig, runtime: G2PRuntime, observer: ModelObserver, compute: ComputeThreads | None = None
    ) -> None:
        self.config, self.runtime = config, runtime
        self.name, self.version, self.provider = config.name, config.version, runtime.provider
        self.graphemes, self.phonemes = runtime.graphemes, runtime.phonemes
        self.letters = frozenset(self.graphemes.symbols[len(SPECIALS) :])  # what a word may be spelled with
        limits = config.limits
        self.max_word_length = int(limits.get("max_word_length", 32))
        self.max_output_length = int(limits.get("max_output_length", 40))
        self.max_words = int(limits.get("max_words", 64))
        self.max_element_bytes = int(limits.get("max_element_bytes", 1024))
        self.max_beam_size = int(limits.get("max_beam_size", 8))
        # Its outputs' dynamic axes, at most (an ensemble bounds a step's outputs before it runs): the words read
        # (each word written reads as SPOKEN_PER_WORD at most), a word's phonemes, a decoded word's letters.
        self.axis_limits = {
            "word": SPOKEN_PER_WORD * self.max_words,
            "phoneme": self.max_output_length,
            "grapheme": self.max_word_length,
        }
        self.max_batch_size = config.batching.max_batch_size
        pinned = config.card.get("text_normalization", RULES)
        if pinned not in VERSIONS:
            raise RepositoryError(
                f"model '{self.name}' version {self.version}: its model card asks for text_normalization "
                f"{quote(str(pinned))}, this server reads text by rules {', '.join(map(quote, VERSIONS))}"
            )
        self.text_rules = str(pinned)
        self.lexicon: Lexicon | None = runtime.lexicon  # the version's pronouncing lexicon, when it ships one
        self.stats = ModelStats()
        self.in_flight = InFlight()  # leases of requests between their lookup and their answer (the server's)
        self.scheduler = GenerationScheduler(self.name, config.batching, runtime.instances, observer, compute)
        self.admission = self.scheduler.admission
        # config.json response_cache: each word's answer kept (set by the registry when the server has a cache)
        self.cache: ResponseCache[Hypothesis] | None = None

    def warm_up(self) -> None:
        """One word decoded on each instance before serving: graphs that load but cannot run are refused
        here, and onnxruntime's first runs (which allocate) happen before any request waits on them.
        Then one full batch, timed, for admission."""
        try:
            source = [self.graphemes.encode("warm")]
            for instance in self.runtime.instances:
                greedy_decode(instance, source, self.max_output_length)
            # A full batch gives admission its first estimate of capacity, in word-steps per second
            # (a request's queued tokens are its words x their longest length, about the steps they take).
            # The fastest of SEED_RUNS: one run on a shared machine was off by up to 4x between replicas of one
            # image, and replicas' summed utilization (the autoscaling signal) with it.
            rows = max(1, self.max_batch_size)
            timings = []
            for _ in range(SEED_RUNS):
                started = time.perf_counter()
                hyps = greedy_decode(self.runtime.instances[0], source * rows, self.max_output_length, batch_size=rows)
                timings.append(time.perf_counter() - started)
            steps = max(len(h.tokens) - 1 for h in hyps)
            self.admission.seed(rows * steps, min(timings))
        except Exception as e:  # onnxruntime's own exception types
            raise RepositoryError(f"model '{self.name}' version {self.version}: warm-up failed: {e}") from e

    def batching(self) -> BatchingConfig:
        return self.config.batching

    def batching_sources(self) -> None:
        return None  # g2p's batching is config.json's, not tuned: not shown

    def text_words(self, text: str) -> list[tuple[str, str]]:
        """Each token of `text` that holds a word, with the word as `words` reads it."""
        known = self._known(self.text_rules, True)
        out = []
        for token in text.split():
            if word := " ".join(spoken_words(token, self.max_word_length, rules=self.text_rules, known=known)):
                out.append((token, word))
        return out

    def _known(self, rules: str, use_lexicon: bool) -> Known | None:
        """What the text rules may ask of the lexicon (en-2 splits words it lacks at words it has)."""
        return self.lexicon.known if self.lexicon is not None and use_lexicon and rules != "en-1" else None

    def max_text_words(self) -> int:
        return self.max_words

    def text_io(self, detailed: bool) -> tuple[str, tuple[str, ...]]:
        """generate's request: TEXT in, PHONEMES out, and each word's WORDS, REASONS and SOURCES if `detailed`."""
        return "TEXT", ("PHONEMES", "WORDS", "REASONS", "SOURCES") if detailed else ("PHONEMES",)

    def text_answer(self, outputs: Mapping[str, np.ndarray]) -> tuple[str, list[dict[str, str]] | None]:
        """generate's answer: the phonemes of the text, and each word as read ("$5": five, dollars), its
        phonemes, where they came from and why it has none, when the outputs hold them."""
        phonemes = _text(outputs["PHONEMES"].reshape(-1)[0])
        if "WORDS" not in outputs:
            return phonemes, None
        read, why, source = ([_text(x) for x in outputs[n]] for n in ("WORDS", "REASONS", "SOURCES"))
        said = iter(phonemes.split(" | ") if read else [])
        words = [  # a word the rules drop (source "rule": an emoji) has no place in the phonemes
            {"word": w, "phonemes": "" if s == SOURCE_RULE else next(said, "")}
            | ({"source": s} if s else {})
            | ({"reason": r} if r else {})
            for w, r, s in zip(read, why, source, strict=True)
        ]
        return phonemes, words

    def caches_parts(self) -> bool:
        """The response cache keeps each word's answer, not whole requests."""
        return True

    def config_parameters(self) -> dict[str, str]:
        lexicon = self.lexicon
        held = f"{len(lexicon)} words, {lexicon.entries} pronunciations" if lexicon is not None else "none"
        return {"text_normalization": self.text_rules, "lexicon": held}  # the rules that read text, the lexicon

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Decoding begins; `on_failure` hears if a decoding thread dies (the registry takes the version out)."""
        self.scheduler.tracer = tracer
        self.scheduler.on_failure = on_failure
        self.scheduler.start()

    async def close(self) -> None:
        """Take no new requests; return once the queued and decoding words are answered."""
        await self.scheduler.close()

    def release(self) -> None:
        """Free the sessions (after `close`)."""
        self.runtime.instances.clear()
        self.scheduler.models.clear()

    def input_limits(self, name: str) -> InputLimits:
        """TEXT holds at most max_words elements (each holds a word or more) of max_element_bytes each."""
        if name != "TEXT":
            return InputLimits()
        why = f"model '{self.name}' takes at most max_words {self.max_words} words, one or more an element"
        return InputLimits(self.max_words, self.max_element_bytes, why)

    def _raw_text(self, text: np.ndarray) -> list[bytes]:
        """TEXT's elements as bytes, their number and sizes checked before any is read."""
        elements = text.reshape(-1)
        if len(elements) > self.max_words:  # every element holds a word or more
            raise InvalidArgument(
                f"input 'TEXT': {len(elements)} elements, the limit is max_words {self.max_words} "
                "(each holds one word or more)"
            )
        out = []
        for i, raw in enumerate(elements):
            if not isinstance(raw, bytes):
                raw = str(raw).encode(errors="surrogatepass")
            if len(raw) > self.max_element_bytes:
                raise InvalidArgument(
                    f"input 'TEXT' element {i}: {len(raw)} bytes, the limit is {self.max_element_bytes}"
                )
            out.append(raw)
        total = count_words(b" ".join(out))  # on the bytes as received, before any word is built
        if total > self.max_words:
            raise InvalidArgument(f"input 'TEXT': {total} words in one request, the limit is {self.max_words}")
        return out

    def words(self, text: np.ndarray) -> list[list[str]]:
        """Each TEXT element -> its words, read by the text rules (service/models/g2p/text.py)."""
        return self._words(self._raw_text(text), self.text_rules, self._known(self.text_rules, True))

    def _words(self, elements: list[bytes], rules: str, known: Known | None) -> list[list[str]]:
        out = []
        total, limit = 0, SPOKEN_PER_WORD * self.max_words
        for i, raw in enumerate(elements):
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"input 'TEXT' element {i} is not valid UTF-8 (byte {e.start})") from None
            control = _control_character(s)
            if control is not None:  # not text a person writes: the whole request says so
                token = next(t for t in s.split() if control in t)
                raise InvalidArgument(
                    f"input 'TEXT' element {i}: the model cannot spell character {quote(control)} "
                    f"(U+{ord(control):04X}) in {quote(token, 40)}: a control character"
                )
            words = spoken_words(s, self.max_word_length, limit - total, rules, known)
            if not words:
                raise InvalidArgument(f"input 'TEXT' element {i} is empty: no word to convert")
            total += len(words)
            if total > limit:  # read no further than the limit
                raise InvalidArgument(
                    f"input 'TEXT': its words read as more than {limit} words (numbers spelled out), the limit "
                    f"is {limit} ({SPOKEN_PER_WORD} x max_words {self.max_words})"
                )
            out.append(words)
        return out

    def _unspellable(self, word: str) -> str:
        """Why the model cannot decode `word`, or "" when it can."""
        if len(word) <= self.max_word_length and self.letters.issuperset(word):
            return ""
        bad = next((c for c in word if c not in self.letters), None)
        if bad is not None:
            return f"the model cannot spell character {quote(bad)} (U+{ord(bad):04X}) in {quote(word, 40)}"
        if len(word) > self.max_word_length:  # the text rules cut long words: only a rule's fault gets here
            return f"word {quote(word, 40)} has {len(word)} letters, the limit is {self.max_word_length}"
        return ""

    def _int_param(self, params: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(f"parameter '{name}' must be an integer, got {got}")
        if not low <= value <= high:
            raise InvalidArgument(f"parameter '{name}' must be in [{low}, {high}], got {value}")
        return value

    def _bool_param(self, params: dict[str, Any], name: str, default: bool) -> bool:
        value = params.get(name, default)
        if not isinstance(value, bool):
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(f"parameter '{name}' must be a boolean, got {got}")
        return value

    def _rules_param(self, params: dict[str, Any]) -> str:
        """The text rules a request pins (parameter text_normalization), or the model card's."""
        value = params.get("text_normalization", self.text_rules)
        if value not in VERSIONS:
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(
                f"parameter 'text_normalization' must be one of {', '.join(map(quote, VERSIONS))}, got {got}"
            )
        return str(value)

    def _word_keys(self, words: list[str], max_out: int, beam: int, with_attention: bool) -> list[bytes]:
        """What determines each word's answer: this loaded version and the decoding asked for (one digest
        a request, of fixed length), then the word (letters of this version's graphemes only)."""
        asked = cache_key([self.name, self.version, id(self), max_out, beam, with_attention])
        return [asked + w.encode() for w in words]

    async def _answers(
        self,
        words: list[str],
        max_out: int,
        beam: int,
        with_attention: bool,
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> list[Hypothesis]:
        """Each word's hypothesis: kept ones from the response cache (when on), the others decoded, each
        word once however often the request holds it."""
        keys = self._word_keys(words, max_out, beam, with_attention) if self.cache else []
        hyps: list[Hypothesis | None] = (
            self.cache.get_many(keys, self.name, self.version) if self.cache else [None] * len(words)
        )
        todo: dict[str, int] = {}  # a word to decode -> its first place in the request
        for i, (word, h) in enumerate(zip(words, hyps, strict=True)):
            if h is None:
                todo.setdefault(word, i)
        if todo:
            firsts = list(todo.values())
            sources = [self.graphemes.encode(w) for w in todo]
            fresh = await self._decode(sources, max_out, beam, with_attention, deadline, trace)
            by_word = dict(zip(todo, fresh, strict=True))
            hyps = [h if h is not None else by_word[w] for w, h in zip(words, hyps, strict=True)]
            if self.cache is not None:
                for i, h in zip(firsts, fresh, strict=True):  # kept without its request (`tag`)
                    kept = _kept(h)
                    self.cache.put(keys[i], kept, deep_size(kept), self.name, self.version)
        return [h for h in hyps if h is not None]  # every word has its hypothesis now

    async def _decode(
        self,
        sources: list[list[int]],
        max_out: int,
        beam: int,
        with_attention: bool,
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> list[Hypothesis]:
        """`sources` decoded by the scheduler, in continuous batches shared with other requests' words."""
        item = WorkItem(
            rows=len(sources) * beam,  # a beam search decodes each word in `beam` rows: its cost
            length=max(map(len, sources)) + 1,
            payload=WordsRequest(sources, max_out, beam, with_attention),
            future=asyncio.get_running_loop().create_future(),
            deadline=deadline,
            trace=trace,
        )
        t0 = time.perf_counter_ns()
        hyps: list[Hypothesis] = await self.scheduler.submit(item)
        self.stats.account_request(item)
        # Its words decode in continuous batches shared with others: no batch size of its own.
        self.stats.executed(len(sources), time.perf_counter_ns() - t0, by_size=False)
        return hyps

    @cached_property
    def metadata(self) -> Metadata:
        """What the version is (ModelMetadata, ModelConfig): fixed once it is loaded."""
        return Metadata(
            self.kind, self.platform, self.provider, self.max_batch_size, self.inputs, self.outputs, self.compute_span
        )

    def admit_early(self, deadline: float | None) -> None:
        """Refused before its tensors are decoded when the queue cannot take it by `deadline`."""
        self.admission.check(0, deadline)

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result:
        check_inputs(["TEXT"], inputs, self.name)
        if "TEXT" not in inputs:
            raise InvalidArgument(f"model '{self.name}': missing input 'TEXT'")
        text = inputs["TEXT"]
        if text.dtype != np.object_:
            raise InvalidArgument(f"input 'TEXT': datatype must be BYTES, model '{self.name}' got a numeric tensor")
        if text.size == 0:
            raise InvalidArgument("input 'TEXT' has no elements")
        names = [o.name for o in self.outputs]
        check_outputs(names, outputs, self.name)
        beam = self._int_param(params, "beam_size", 1, 1, self.max_beam_size)
        max_out = self._int_param(params, "max_output_length", self.max_output_length, 1, self.max_output_length)
        use_lexicon = self._bool_param(params, "lexicon", True) and self.lexicon is not None
        rules = self._rules_param(params)
        known = self._known(rules, use_lexicon)
        raw = self._raw_text(text)
        if sum(map(len, raw)) > THREAD_TEXT_BYTES:  # a large legal request: its words built off the event loop
            elements = await asyncio.to_thread(self._words, raw, rules, known)
        else:
            elements = self._words(raw, rules, known)
        flat = [w for ws in elements for w in ws]
        dropped = [rules != "en-1" and is_symbol(w) for w in flat]  # emoji and other signs: not read (en-2)
        sources = [SOURCE_RULE if d else "" for d in dropped]
        answers: list[list[str]] = [[] for _ in flat]  # each word's pronunciations, its answer first
        if use_lexicon and self.lexicon is not None:  # looked up before anything is batched
            asked = [i for i, d in enumerate(dropped) if not d]
            for i, (at, first) in zip(asked, self.lexicon.answers([flat[i] for i in asked]), strict=True):
                if at >= 0:
                    sources[i] = SOURCE_LEXICON
                    answers[i] = self.lexicon.pronunciations(at) if "VARIANTS" in outputs else [first]
        reasons = [
            _DROPPED.format(quote(w, 40)) if d else "" if s else self._unspellable(w)
            for w, d, s in zip(flat, dropped, sources, strict=True)
        ]
        spelled = [i for i, why in enumerate(reasons) if not why]  # the words answered, by index in `flat`
        modelled = [i for i in spelled if sources[i] != SOURCE_LEXICON]  # the words decoded, by index
        modelled_words = [flat[i] for i in modelled]
        with_attention = "ATTENTION" in outputs
        longest = max((len(flat[i]) for i in spelled), default=0)
        hyps = await self._answers(modelled_words, max_out, beam, with_attention, deadline, trace)
        decoded: list[list[str]] = [[] for _ in flat]
        for i, h in zip(modelled, hyps, strict=True):
            decoded[i] = self.phonemes.decode(h.output)
            answers[i], sources[i] = [" ".join(decoded[i])], SOURCE_MODEL
        joined, k = [], 0
        for ws in elements:
            mine = range(k, k + len(ws))
            # en-1 separates every word read, en-2 those it does not drop.
            said = [answers[j][0] if answers[j] else "" for j in mine if rules == "en-1" or not dropped[j]]
            joined.append(" | ".join(said).encode())
            k += len(ws)
        result: dict[str, np.ndarray] = {}
        if not outputs or "PHONEMES" in outputs:
            result["PHONEMES"] = np.array(joined, dtype=np.object_).reshape(text.shape)
        if with_attention:  # a row per word read, zeros for one not decoded (the lexicon's among them)
            t = max(map(len, decoded)) or 1
            att = np.zeros((len(flat), t, max(longest, 1)), dtype=np.float32)
            for i, h in zip(modelled, hyps, strict=True):
                d = decoded[i]
                rows = np.array(h.attention[: len(d)], dtype=np.float32).reshape(len(d), -1)
                att[i, : len(d), : rows.shape[1]] = rows
            result["ATTENTION"] = att
        if "WORDS" in outputs:
            result["WORDS"] = np.array([w.encode() for w in flat], dtype=np.object_)
        if "REASONS" in outputs:
            result["REASONS"] = np.array([r.encode() for r in reasons], dtype=np.object_)
        if "SOURCES" in outputs:
            result["SOURCES"] = np.array([x.encode() for x in sources], dtype=np.object_)
        if "VARIANTS" in outputs:
            width = max(map(len, answers), default=0) or 1
            variants = np.full((len(flat), width), b"", dtype=np.object_)
            for i, a in enumerate(answers):
                variants[i, : len(a)] = [v.encode() for v in a]
            result["VARIANTS"] = variants
        decoded_in = sum(map(len, modelled_words))
        return Result(result, longest, decoded_in, sum(len(decoded[i]) for i in modelled))
