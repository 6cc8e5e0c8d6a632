"""`qkv attention` on whatever `qkv infer` accepts, against a real server: 200 ordinary and hostile texts
(words, numbers, symbols, emoji, scripts the model cannot spell, long words, nothing at all), none of
which crashes it; each word read gets its map, and `--out` draws every one of them."""

from __future__ import annotations

import random
import string
import struct
from pathlib import Path

import pytest

from service import cli
from service.tools.client import Client, g2p_outputs, g2p_request
from tests.conftest import RunningServer

ORDINARY = [
    "attention", "transformer", "hello", "hello world", "the transformer, explained", "I", "a", "don't",
    "rock'n'roll", "co-operate", "Dr. Smith paid $5 on 3/4", "$5", "£3.50", "100%", "12:30", "1st", "2024",
    "3.14159", "-5", "+1", "e.g.", "naïve café", "Straße", "ÆSIR", "MMXXIV", "ALLCAPS", "camelCase",
    "supercalifragilisticexpialidocious", "pneumonoultramicroscopicsilicovolcanoconiosis", "o'clock", "'tis",
]  # fmt: skip
HOSTILE = [
    "", " ", "\t", "!!!", "...", "?", "&", "'", "''", '"quoted"', "(paren)", "[b]", "{c}", "a/b", "a\\b", "---",
    "a-", "-a", "@home", "C++", "#hashtag", "user@example.com", "http://example.com/a?b=c", "1,000,000", "0",
    "007", "snake_case", "x\u200by", "e\u0301", "ﬁ", "½", "²", "∞", "™", "😀", "hello 😀", "👍🏽", "🇬🇧",
    "😀😀😀 😀", "中文", "日本語 text", "مرحبا", "Привет", "a" * 40, "x" * 300, "ab" * 100 + " cd", "h\x1bllo",
    "\x00", "1e10", "$$$", "5$", "$", "%%", "3/0", "1/2/3/4", "99999999999999999999", "-0.0", "¥1000",
]  # fmt: skip
POOLS = [string.ascii_letters, string.digits, string.punctuation, " ", "😀🎉👍🏽🇬🇧", "中文日本語", "éüøß\u0301",
         "\u200b\u00ad", "€£¥$%"]  # fmt: skip


def texts(count: int = 200) -> list[str]:
    """The fixed ones, then random mixes of the pools (seeded: the same every run)."""
    rng = random.Random(47)
    out = ORDINARY + HOSTILE
    while len(out) < count:
        pools = rng.sample(POOLS, rng.randint(1, 4))
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 30))))
    return out[:count]


def words_read(client: Client, text: str) -> list[str]:
    """The words the server reads from `text` (its WORDS output), asked apart from the command and as it asks:
    with `lexicon` false (a hyphenated word the lexicon holds, co-operate, is read whole only with it)."""
    request = g2p_request([text], lexicon=False)
    request.outputs.add(name="WORDS")
    return g2p_outputs(client.infer(request))["WORDS"]  # type: ignore[no-any-return]


def test_200_ordinary_and_hostile_texts_crash_nothing(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each answered: exit 0 with one map (or reason) a word read, or exit 1 with one line saying why (a
    control character refused by the server, a text with no word). No exception, no traceback."""
    outcomes = {0: 0, 1: 0}
    with Client(server.url, timeout=60) as client:
        for text in texts():
            code = cli.main(["attention", "--url", server.url, "--timeout", "60", "--", text])
            out, err = capsys.readouterr()
            assert code in (0, 1), (text, code, err)
            outcomes[code] += 1
            if code == 1:
                line = err.strip()
                why = ("qkv attention: INVALID_ARGUMENT", "qkv attention: no word to map")
                assert len(line.splitlines()) == 1 and line.startswith(why), (text, err)
                continue
            words = words_read(client, text)
            blocks = out.split("\n", 1)[1].split("\n\n")  # after the text and its phonemes, a block a word
            assert len(blocks) == len(words) >= 1, (text, words, out)
            for word, block in zip(words, blocks, strict=True):
                first = block.splitlines()[0]
                letters = first.split() == list(word)  # a table's header, or the reason for no table
                assert first.startswith(f"{word}: ") or letters, (text, word, block)
    assert outcomes[0] >= 150, outcomes  # most texts hold a word


def test_a_word_table_is_as_before(server: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["attention", "--url", server.url, "attention"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "attention\tAH0 T EH1 N SH AH0 N"
    assert lines[1].split() == list("attention")
    assert [row.split()[0] for row in lines[2:]] == ["AH0", "T", "EH1", "N", "SH", "AH0", "N"]
    assert all(0 <= int(x) <= 100 for row in lines[2:] for x in row.split()[1:])


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("text", ["hello", "hello world $5 😀", "a" * 40 + " 中文", " ".join(["word"] * 9)])
def test_out_draws_a_panel_for_every_word(
    server: RunningServer, text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "attention.png"
    assert cli.main(["attention", "--url", server.url, "--out", str(png), "--", text]) == 0
    with Client(server.url, timeout=60) as client:
        words = words_read(client, text)
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(words)} word{'s' if len(words) > 1 else ''} -> {png}"
    width, height = _png_size(png)
    one = tmp_path / "one.png"
    assert cli.main(["attention", "--url", server.url, "--out", str(one), "hello"]) == 0
    if len(words) > 1:  # the panels side by side (four a row), then in rows
        assert width > _png_size(one)[0], (text, width)
    if len(words) > 4:
        assert height > _png_size(one)[1], (text, height)
