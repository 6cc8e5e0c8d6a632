"""Incremental detokenization: the text each new token adds, never half a character, with stop strings.

A byte-level tokenizer may split one character over several tokens; decoding a token alone then gives
U+FFFD. `Detokenizer` decodes a short window of recent tokens and hands out only text that ends in a whole
character (the window's text minus what it gave before). Stop strings: the text held back is the longest
tail that could still begin a stop string, so a delta never shows part of one.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Detokenizer"]

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of one answer, token by token."""

    __slots__ = ("decode", "ids", "pending", "prefix", "read", "stop", "stopped", "text")

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token: decoded for context only
        self.read = 0  # tokens whose text has been taken
        self.text = ""  # the whole text so far (before any stop string)
        self.pending = ""  # text held back: it may begin a stop string
        self.stop = stop
        self.stopped = False  # a stop string was found: the text ends before it

    def add(self, token: int) -> str:
        """The text `token` adds that can be shown now."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before):
            return ""  # a character not yet whole (or no text at all)
        self.prefix, self.read = self.read, len(self.ids)
        return self._shown(after[len(before) :])

    def flush(self) -> str:
        """The rest, at the end of the answer (a dangling partial character shown as U+FFFD)."""
        rest = ""
        if not self.stopped and self.read < len(self.ids):
            before = self.decode(self.ids[self.prefix : self.read])
            rest = self.decode(self.ids[self.prefix :])[len(before) :]
            self.read = len(self.ids)
        shown = self._shown(rest) if rest else ""
        if self.stopped:
            return shown
        shown, self.pending = shown + self.pending, ""
        self.text += shown
        return shown

    def _shown(self, new: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            self.text += new
            return new
        held = self.pending + new
        cut = min((i for s in self.stop if (i := held.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            shown, self.pending = held[:cut], ""
            self.text += shown
            return shown
        keep = max((k for s in self.stop for k in range(min(len(s) - 1, len(held)), 0, -1)
                    if held.endswith(s[:k])), default=0)  # fmt: skip
        shown, self.pending = held[: len(held) - keep], held[len(held) - keep :]
        self.text += shown
        return shown
