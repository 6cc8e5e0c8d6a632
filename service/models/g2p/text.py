# Over 500 lines: English reading rules: their tables and the rules that read them go together.
"""Text as people write it -> the words a g2p model spells, by English reading rules.

`spoken_words("Dr. Smith paid $5 on 3/4")` is `["doctor", "smith", "paid", "five", "dollars", "on",
"three", "quarters"]`. Numbers, currency, times, fractions, percentages and common abbreviations are
read out; accented Latin letters fold to their base letters; a word longer than the model can take is
cut into pieces it can. What the rules cannot turn into Latin letters (Chinese, emoji) is left as it is:
the model decides what it can spell and says why not (service/models/g2p/model.py).

The rules are versioned (`RULES`): a change that alters any answer gets a new version, which the model
card names, so an answer can be reproduced; a server reads by every version it has (`VERSIONS`), so a
model card or a request that pins an older one is answered as before. `en-2` adds to `en-1`: telephone
numbers read digit by digit, web addresses and e-mail addresses read as spoken ("example dot com"), and,
given the words a pronouncing lexicon knows (`known`), an unknown word that is a compound of known ones
split into them (github: git hub), hyphenated and over-long words split at known parts before any
fixed-length cut. docs/model.md, "Text normalisation", tabulates them.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache

__all__ = [
    "RULES",
    "SILENT_ASCII",
    "SILENT_WIDE",
    "VERSIONS",
    "Known",
    "cardinal",
    "fold",
    "is_symbol",
    "ordinal",
    "spoken_words",
    "year",
]

RULES = "en-2"  # the newest: what a model card that names none is read by
VERSIONS = ("en-1", "en-2")
Known = Callable[[Sequence[str]], list[bool]]  # which of some words a lexicon knows

# Letters NFKD leaves whole: their usual English spelling.
_LETTERS = {"ß": "ss", "æ": "ae", "œ": "oe", "ø": "o", "ð": "d", "þ": "th", "đ": "d", "ł": "l", "ı": "i", "ħ": "h"}
_LETTERS |= {k.upper(): v.capitalize() for k, v in _LETTERS.items() if k.upper() != k}
_TYPOGRAPHY = {"’": "'", "‘": "'", "ʼ": "'", "′": "'", "⁄": "/", "−": "-", "‐": "-", "‑": "-"}
_INVISIBLE = {"\u00ad", "\u200b", "\u2060", "\ufeff"}  # soft hyphen, zero-width spaces: not there for a reader

# Punctuation that is not read: stripped around words, and a word's separator inside one. Every
# character of Unicode class P is, but the apostrophe (part of words: 'bout, james'), the period and
# hyphen (numbers, abbreviations, compounds; handled where they stand) and the symbols that are read.
_READ = {"&": "and", "@": "at", "+": "plus", "=": "equals", "%": "percent"}
SILENT_ASCII = '!"(),:;?[\\]{}_*/#<>|~^`-.'  # what count_words, on raw bytes, may treat as no word
SILENT_WIDE = "“”„«»‹›…–—¡¿、。，：；！？（）「」『』【】·•"  # some of the wide ones, for count_words likewise

_CURRENCY = {  # symbol: (unit, units, hundredth, hundredths)
    "$": ("dollar", "dollars", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "€": ("euro", "euros", "cent", "cents"),
    "¥": ("yen", "yen", "", ""),
}
_SCALES = ("thousand", "million", "billion", "trillion")

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")  # fmt: skip
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
            "twelve": "twelfth"}  # fmt: skip

# Abbreviations, looked up lowercased; a key without its period also matches the word written with one.
_ABBREVIATIONS = {
    "mr": "mister", "mrs": "missus", "ms": "miz", "prof.": "professor", "jr": "junior", "sr": "senior",
    "vs": "versus", "etc.": "et cetera", "e.g.": "for example", "i.e.": "that is", "approx.": "approximately",
    "mt.": "mount", "ave.": "avenue", "inc.": "incorporated", "ltd.": "limited", "dept.": "department",
    "jan.": "january", "feb.": "february", "aug.": "august", "sept.": "september", "oct.": "october",
    "nov.": "november", "dec.": "december",
}  # fmt: skip
# Words of letters that a rule reads (an abbreviation, with its period or without): the rest go as they are.
_RULED_WORDS = frozenset({"dr", "st", "no", *(k.rstrip(".") for k in _ABBREVIATIONS)})
_MERIDIEM = {"am": "a.m.", "a.m": "a.m.", "a.m.": "a.m.", "pm": "p.m.", "p.m": "p.m.", "p.m.": "p.m."}
_MERIDIEM_RE = r"(am|pm|a\.m\.?|p\.m\.?)"

_AMOUNT = r"(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?"
_NUMBER = re.compile(r"([-+]?)" + _AMOUNT)
_BARE_DECIMAL = re.compile(r"([-+]?)\.(\d+)")
_MONEY_BEFORE = re.compile(r"(-?)([$£€¥])" + _AMOUNT)
_MONEY_AFTER = re.compile(_AMOUNT + r"([$£€¥])")
_PERCENT = re.compile(r"([-+]?)" + _AMOUNT + "%")
_TIME = re.compile(r"(\d{1,2}):(\d{2})" + _MERIDIEM_RE + "?")
_HOUR = re.compile(r"(\d{1,2})" + _MERIDIEM_RE)
_ORDINAL_NUMBER = re.compile(r"(\d{1,3}(?:,\d{3}){1,4}|\d{1,15})(st|nd|rd|th)")
_FRACTION = re.compile(r"(\d{1,3})/(\d{1,3})")
_DECADE = re.compile(r"'?(\d{1,3}0)s")
_HASH = re.compile(r"#(\d+)")
_PLAIN = re.compile(r"[a-z'.-]+")
# Inside a token no rule reads whole: numbers, Latin letter runs, runs of other letters, runs of the rest.
_PIECES = re.compile(r"[$£€¥]?\d[\d,.:/]*(?:st|nd|rd|th|%)?|[a-z'.-]+|[^\W\d_a-z]+|[^\w\s]+", re.IGNORECASE)


def _is_silent(c: str) -> bool:
    return c in SILENT_ASCII or (unicodedata.category(c).startswith("P") and c not in "'&@%")


@lru_cache(maxsize=4096)
def _fold_char(c: str) -> str:
    if c.isascii():
        return c
    if c in _LETTERS or c in _TYPOGRAPHY:
        return _LETTERS.get(c) or _TYPOGRAPHY[c]
    if c in _INVISIBLE:
        return ""
    parts = unicodedata.normalize("NFKD", c)
    base = "".join(p for p in parts if not unicodedata.combining(p))
    if base and (base[0].isascii() or base[0] in _TYPOGRAPHY):  # Latin with marks, ligatures, ½, full width
        return "".join(_TYPOGRAPHY.get(p, p) for p in base)
    return c  # another script, a symbol, an emoji: left for the model to refuse by name


def fold(text: str) -> str:
    """Accented Latin letters to their base letters (NFKD, marks dropped; ß -> ss, æ -> ae, ø -> o),
    typographic apostrophes and dashes to ASCII, compatibility forms (½, ², ﬁ, full width) to theirs."""
    return text if text.isascii() else "".join(map(_fold_char, text))


def cardinal(n: int) -> list[str]:
    """42 -> forty two; 1200 -> one thousand two hundred (American: no "and")."""
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        return [_ONES[n // 100], "hundred"] + (cardinal(n % 100) if n % 100 else [])
    for power, name in reversed(list(enumerate(_SCALES, 1))):
        unit = 1000**power
        if n >= unit:
            return cardinal(n // unit) + [name] + (cardinal(n % unit) if n % unit else [])
    raise AssertionError(n)


def ordinal(n: int) -> list[str]:
    """3 -> third; 21 -> twenty first; 100 -> one hundredth."""
    words = cardinal(n)
    last = words[-1]
    if last in _ORDINAL:
        words[-1] = _ORDINAL[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return words


def year(n: int) -> list[str]:
    """1999 -> nineteen ninety nine; 1905 -> nineteen oh five; 1900 -> nineteen hundred;
    2005 -> two thousand five; 2024 -> twenty twenty four."""
    high, low = divmod(n, 100)
    if 2000 <= n < 2010 or n % 1000 == 0:
        return cardinal(n)
    if low == 0:
        return [*cardinal(high), "hundred"]
    return [*cardinal(high), *(["oh"] if low < 10 else []), *cardinal(low)]


def _digits(text: str) -> list[str]:
    return [_ONES[int(d)] for d in text]


def _integer(text: str) -> list[str]:
    """An integer as written: commas allowed; a leading zero or more than 15 digits read digit by digit."""
    digits = text.replace(",", "")
    if len(digits) > 15 or (len(digits) > 1 and digits[0] == "0" and "," not in text):
        return _digits(digits)
    return cardinal(int(digits))


def _number(sign: str, whole: str, fraction: str | None, as_year: bool = True) -> list[str]:
    words = {"-": ["minus"], "+": ["plus"]}.get(sign, [])
    if as_year and not sign and fraction is None and re.fullmatch(r"\d{4}", whole) and _is_year(int(whole)):
        return year(int(whole))
    words += _integer(whole)
    if fraction is not None:
        words += ["point", *_digits(fraction)]
    return words


def _is_year(n: int) -> bool:
    """Four digits, no comma, 1100-1999 or 2000-2099: read as a year (write 1,999 for a count)."""
    return 1100 <= n <= 2099


def _value(whole: str) -> int:
    """An integer's value; -1 past 15 digits (read digit by digit, and no int() of a huge string)."""
    digits = whole.replace(",", "")
    return int(digits) if len(digits) <= 15 else -1


def _plural(word: str) -> str:
    return word[:-1] + "ies" if word.endswith("y") else word + "s"


def _money(sign: str, symbol: str, whole: str, cents: str | None, scale: str | None) -> list[str]:
    unit, units, hundredth, hundredths = _CURRENCY[symbol]
    words = ["minus"] if sign else []
    value = _value(whole)
    if scale is not None:  # $5 million -> five million dollars
        return words + _number("", whole, cents, as_year=False) + [scale, units]
    if cents is not None and (len(cents) != 2 or not hundredth):
        return words + _number("", whole, cents, as_year=False) + [units]
    if value or not cents:
        words += [*_integer(whole), unit if value == 1 else units]
    if cents and int(cents):
        words += [*cardinal(int(cents)), hundredth if int(cents) == 1 else hundredths]
    return words


def _fraction(numerator: int, denominator: int) -> list[str]:
    """3/4 -> three quarters; 1/2 -> one half; 5/8 -> five eighths; 1/0 -> one over zero."""
    if denominator < 2:
        return [*cardinal(numerator), "over", *cardinal(denominator)]
    name = {2: ["half"], 4: ["quarter"]}.get(denominator) or ordinal(denominator)
    if numerator != 1:
        name[-1] = "halves" if name[-1] == "half" else name[-1] + "s"
    return [*cardinal(numerator), *name]


def _time(hour: int, minute: int, meridiem: str | None) -> list[str]:
    """3:30 -> three thirty; 3:05 -> three oh five; 3:00 -> three o'clock; 15:00 -> fifteen hundred."""
    words = cardinal(hour)
    if minute == 0 and meridiem is None:
        words.append("o'clock" if 1 <= hour <= 12 else "hundred")
    elif minute:
        words += (["oh"] if minute < 10 else []) + cardinal(minute)
    return words + ([_MERIDIEM[meridiem]] if meridiem else [])


def _plain(core: str, period: bool) -> list[str]:
    """A word of letters: lowercased; an abbreviation (a period inside) keeps its final period (c.o.d.)."""
    word = core.lower().strip(".-")
    if "." in word and period:
        word += "."
    return [word] if any(c.isalpha() for c in word) else []


def _split_long(word: str, limit: int) -> Iterator[str]:
    """A word over `limit` letters: at its hyphens first, then into equal pieces of at most `limit`."""
    if len(word) <= limit:
        yield word
        return
    if "-" in word.strip("-"):
        for part in word.split("-"):
            if part:
                yield from _split_long(part, limit)
        return
    pieces = -(-len(word) // limit)
    size = -(-len(word) // pieces)
    for start in range(0, len(word), size):
        yield word[start : start + size]


class _Reader:
    """Reads a text's tokens in order; a rule may look at the neighbours and take the next token."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.index = 0

    def neighbour(self, offset: int) -> str:
        i = self.index + offset
        return _strip(self.tokens[i])[0] if 0 <= i < len(self.tokens) else ""

    def take_next_if(self, allowed: set[str] | tuple[str, ...] | dict[str, str]) -> str | None:
        nxt = self.neighbour(1).lower()
        if nxt in allowed:
            self.index += 1
            return nxt
        return None

    def read(self) -> Iterator[str]:
        while self.index < len(self.tokens):
            token = self.tokens[self.index]
            letters = token.strip(SILENT_ASCII) if token.isascii() else ""
            if letters.isalpha() and (low := letters.lower()) not in _RULED_WORDS:
                yield low  # most tokens: a word of letters no rule reads, what `_token` makes of it
            else:
                core, period = _strip(token)
                if core:
                    yield from self._token(core, period)
            self.index += 1

    def _token(self, core: str, period: bool) -> list[str]:
        low = core.lower()
        words = self._abbreviation(low, period) if low.replace(".", "").isalpha() else None
        if words is not None:
            return words
        if (m := _MONEY_BEFORE.fullmatch(core)) or (m := _MONEY_AFTER.fullmatch(core)):
            sign, symbol, whole, cents = m.groups() if m.re is _MONEY_BEFORE else ("", m[3], m[1], m[2])
            return _money(sign, symbol, whole, cents, self.take_next_if(_SCALES))
        if m := _PERCENT.fullmatch(core):
            return [*_number(m[1], m[2], m[3], as_year=False), "percent"]
        if m := _TIME.fullmatch(low):
            hour, minute = int(m[1]), int(m[2])
            if hour <= 24 and minute < 60:
                return _time(hour, minute, m[3] or self.take_next_if(_MERIDIEM))
        if (m := _HOUR.fullmatch(low)) and int(m[1]) <= 12:
            return [*cardinal(int(m[1])), _MERIDIEM[m[2]]]
        if m := _ORDINAL_NUMBER.fullmatch(low):
            return ordinal(_value(m[1]))
        if m := _FRACTION.fullmatch(core):
            mixed = bool(re.fullmatch(r"\d+", self.neighbour(-1)))  # 1 1/2: one and one half
            return (["and"] if mixed else []) + _fraction(int(m[1]), int(m[2]))
        if m := _DECADE.fullmatch(low):
            value = int(m[1])
            words = year(value) if len(m[1]) == 4 and _is_year(value) else cardinal(value)
            return [*words[:-1], _plural(words[-1])]
        if m := _NUMBER.fullmatch(core):
            hour = not m[1] and not m[3] and 1 <= _value(m[2]) <= 12
            meridiem = self.take_next_if(_MERIDIEM) if hour else None  # 3 pm
            return _number(m[1], m[2], m[3]) + ([_MERIDIEM[meridiem]] if meridiem else [])
        if m := _BARE_DECIMAL.fullmatch(core):
            return [*{"-": ["minus"], "+": ["plus"]}.get(m[1], []), "point", *_digits(m[2])]
        if m := _HASH.fullmatch(core):
            return ["number", *_integer(m[1])]
        if core in _READ:
            return [_READ[core]]
        if core in _CURRENCY:
            return [_CURRENCY[core][0]]
        if _PLAIN.fullmatch(low):
            return _plain(core, period)
        return self._pieces(core)

    def _abbreviation(self, low: str, period: bool) -> list[str] | None:
        dotted = low + "." if period else low
        bare = low.rstrip(".")
        if bare in ("dr", "st"):  # Dr. Smith, Elm Dr.; St. Louis, Main St.
            before, after = self.neighbour(-1), self.neighbour(1)
            names = after[:1].isupper(), before[:1].isupper()
            if bare == "dr":  # drive after a name, ending the text or a clause (Elm Dr., Springfield)
                ends = not after or self.tokens[self.index].rstrip(".")[-1:] in ",;:!?)"
                return ["drive"] if names[1] and ends else ["doctor"]
            return ["saint"] if names[0] else ["street"]
        if bare == "no" and period and re.fullmatch(r"\d[\d,]*", self.neighbour(1)):
            return ["number"]
        found = _ABBREVIATIONS.get(dotted) or _ABBREVIATIONS.get(bare)
        return found.split() if found else None

    def _pieces(self, core: str) -> list[str]:
        """A token no rule reads whole (mp3, and/or, AT&T, 中文food): its pieces, each read on its own."""
        words: list[str] = []
        for piece in _PIECES.findall(core):
            if piece[:2].lstrip("$£€¥")[:1].isdigit():  # a number, or an amount
                if piece == core:  # no rule reads it whole (3/4/2020, 1.2.3): its numbers one by one
                    words += [w for run in re.findall(r"\d+", piece) for w in _Reader([run]).read()]
                else:
                    words += _Reader([piece]).read()
            elif piece[0].isalpha() and not piece[0].isascii():
                words.append(piece)  # another script: left whole, for the model to refuse by name
            elif piece[0].isalpha() or piece[0] in "'.-":
                words += _plain(piece, False)
            elif kept := "".join(c for c in piece if not _is_silent(c)):  # a currency sign in a word: unread
                words.append(_READ.get(kept, kept))
        return words


def _strip(token: str) -> tuple[str, bool]:
    """A token without the punctuation around it, and whether it ended in a period. A sign or a
    decimal point before a digit stays (-5, .5, -$5)."""
    end = len(token)
    while end and _is_silent(token[end - 1]):
        end -= 1
    period = token[end:].startswith(".")
    start = 0
    while start < end and _is_silent(token[start]):
        if token[start] in "-.#" and start + 1 < end and (token[start + 1].isdigit() or token[start + 1] in _CURRENCY):
            break
        start += 1
    return token[start:end], period


def spoken_words(
    text: str, max_letters: int = 32, max_words: int | None = None, rules: str = RULES, known: Known | None = None
) -> list[str]:
    """`text` as the words to spell, in order: read by the rules of version `rules` (`en-1`, `en-2`),
    folded to Latin letters where it can be, and no word longer than `max_letters`. Reading stops once
    there are more than `max_words`: a text that reads as too many words costs no more than the limit's
    worth. With `known` (en-2), words a lexicon lacks are split into words it knows where they can be."""
    reader = _Reader(fold(text).split()) if rules == "en-1" else _Reader2(fold(text).split())
    cut = rules == "en-1" or known is None  # long words cut here, or at known parts below
    out: list[str] = []
    for word in reader.read():
        out.extend(_split_long(word, max_letters) if cut and len(word) > max_letters else (word,))
        if max_words is not None and len(out) > max_words:
            break
    return out if cut else _known_parts(out, max_letters, known)  # type: ignore[arg-type]


# A compound of lexicon words: parts of at least this many letters, at most this many parts (more for a
# word over max_letters, which must be cut anyway); words longer than _MAX_COMPOUND are cut, not searched.
_MIN_PART, _MAX_PARTS, _MAX_COMPOUND = 4, 2, 128


def _known_parts(words: list[str], max_letters: int, known: Known) -> list[str]:
    """en-2 with a lexicon: a word it lacks, hyphenated, over-long or a compound, as the known words it is
    made of; otherwise as it is (cut into pieces of `max_letters` when longer)."""

    def splittable(w: str) -> bool:  # the others stay as they are, known or not: no need to ask
        return "-" in w.strip("-") or len(w) > max_letters or (w.isalpha() and w.isascii() and len(w) >= 2 * _MIN_PART)

    asked = [w for w in words if splittable(w)]
    found = dict(zip(asked, known(asked), strict=True)) if asked else {}
    out: list[str] = []
    for w in words:
        if found.get(w, True):  # known, or too short to split
            out.append(w)
        elif "-" in w.strip("-"):  # a hyphenated word the lexicon lacks: its parts, each looked up
            out += _known_parts(_hyphen_parts(w), max_letters, known)
        elif w.isalpha() and w.isascii() and 2 * _MIN_PART <= len(w) <= _MAX_COMPOUND:
            parts = _compound(w, known, max_letters, _MAX_PARTS if len(w) <= max_letters else len(w))
            out += parts or list(_split_long(w, max_letters))
        else:
            out += _split_long(w, max_letters)
    return out


def _hyphen_parts(word: str) -> list[str]:
    return [p for p in word.split("-") if p]


def _compound(word: str, known: Known, max_letters: int, max_parts: int) -> list[str] | None:
    """`word` as the fewest lexicon words (each `_MIN_PART` to `max_letters` letters, at most `max_parts`)
    that spell it, or None. One lexicon call a position: each asks for every part that starts there."""
    n = len(word)
    best: list[tuple[int, int] | None] = [None] * (n + 1)  # position -> (parts so far, where the last began)
    best[0] = (0, 0)
    for i in range(n - _MIN_PART + 1):
        here = best[i]
        if here is None or here[0] >= max_parts:
            continue
        ends = range(i + _MIN_PART, min(n, i + max_letters) + 1)
        for j, ok in zip(ends, known([word[i:j] for j in ends]), strict=True):
            if ok and (best[j] is None or best[j][0] > here[0] + 1):  # type: ignore[index]
                best[j] = (here[0] + 1, i)
    if best[n] is None or best[n][0] < 2:  # type: ignore[index]
        return None
    parts, j = [], n
    while j:
        i = best[j][1]  # type: ignore[index]
        parts.append(word[i:j])
        j = i
    return parts[::-1]


def is_symbol(word: str) -> bool:
    """Whether `word` is symbols alone (emoji, arrows, math signs, with their joiners and modifiers):
    en-2 reads none of them, and drops them from the pronunciation."""
    return bool(word) and all(
        unicodedata.category(c)[0] == "S" or c in "\u200d\ufe0e\ufe0f\u20e3" or 0x1F3FB <= ord(c) <= 0x1F3FF
        or 0xE0020 <= ord(c) <= 0xE007F  # tag characters (flags of regions)
        for c in word
    )  # fmt: skip


# --- en-2: telephone numbers, web and e-mail addresses ----------------------------------------------------

_PHONE = re.compile(r"(\+\d{1,3}-)?(\d{3}-)?\d{3}-\d{4}|(\+\d{1,3}\.)?\d{3}\.\d{3}\.\d{4}")
_AREA = re.compile(r"\(\d{3}\)")
_LOCAL = re.compile(r"\d{3}-\d{4}")
_TLDS = frozenset({
    "com", "org", "net", "edu", "gov", "mil", "int", "io", "co", "uk", "us", "de", "fr", "es", "it", "nl", "eu",
    "ca", "au", "jp", "cn", "ru", "in", "br", "ch", "se", "no", "dk", "fi", "pl", "be", "at", "ie", "nz", "za",
    "info", "biz", "me", "tv", "ai", "dev", "app", "xyz", "tech", "online", "site", "blog", "cloud",
})  # fmt: skip
_HOST = r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)+"
_URL = re.compile(r"(?:([a-z][a-z0-9+.-]*)://)?(" + _HOST + r")(?::(\d{1,5}))?((?:[/?#]\S*)?)", re.IGNORECASE)
_EMAIL = re.compile(r"([a-z0-9][a-z0-9._%+-]*)@(" + _HOST + ")", re.IGNORECASE)
_SPOKEN_SIGNS = {".": "dot", "@": "at", "/": "slash", "-": "dash", "_": "underscore", ":": "colon", "?": "question",
                 "=": "equals", "&": "and", "#": "hash", "~": "tilde", "%": "percent", "+": "plus"}  # fmt: skip
_ADDRESS_PIECES = re.compile(r"[a-z]+|\d+|[^a-z\d]", re.IGNORECASE)


def _address(text: str) -> list[str]:
    """A host, user or path read as spoken: its words (www, and letters alone, spelled), its numbers
    digit by digit when they have a leading zero or more than four digits, its signs by name."""
    words: list[str] = []
    for piece in _ADDRESS_PIECES.findall(text):
        low = piece.lower()
        if low == "www":
            words += ["w", "w", "w"]
        elif low.isalpha():
            words.append(low)
        elif low.isdigit():
            words += _digits(low) if len(low) > 4 or (len(low) > 1 and low[0] == "0") else cardinal(int(low))
        elif low in _SPOKEN_SIGNS:
            words.append(_SPOKEN_SIGNS[low])
    return words


def _web(core: str) -> list[str] | None:
    """A web address (with its scheme, or www., or a known top-level domain) or an e-mail address, read
    as spoken: https://example.com/docs is example dot com slash docs (the http(s) scheme is not read;
    another, ftp://, is spelled: f t p)."""
    if m := _EMAIL.fullmatch(core):
        return [*_address(m[1]), "at", *_address(m[2])]
    m = _URL.fullmatch(core)
    if m is None:
        return None
    scheme, host, port, rest = m[1], m[2], m[3], m[4]
    if not (scheme or host.lower().startswith("www.") or host.rsplit(".", 1)[-1].lower() in _TLDS):
        return None
    if not scheme and not any(c.isalpha() for c in host.rsplit(".", 1)[-1]):
        return None
    words = [] if scheme is None or scheme.lower() in ("http", "https") else list(scheme.lower())
    words += _address(host)
    if port:
        words += ["colon", *cardinal(int(port))]
    return words + _address(rest)


class _Reader2(_Reader):
    """en-2: en-1's rules, and before them telephone numbers and web and e-mail addresses."""

    def _token(self, core: str, period: bool) -> list[str]:
        if _PHONE.fullmatch(core):  # 555-0123, 555-123-4567, +1-555-123-4567: digit by digit
            return [w for group in re.findall(r"\d+", core) for w in _digits(group)]
        if _AREA.fullmatch(self.tokens[self.index].rstrip(",;")) and _LOCAL.fullmatch(self.neighbour(1)):
            self.index += 1  # (555) 123-4567
            return [w for group in re.findall(r"\d+", core + " " + self.tokens[self.index]) for w in _digits(group)]
        if ("." in core or "@" in core) and (words := _web(core)) is not None:
            return words
        return super()._token(core, period)
