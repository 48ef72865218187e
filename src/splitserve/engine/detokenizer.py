"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, emitting only settled characters.

    A token can end mid-way through a multi-byte character; the decoder then yields U+FFFD.
    Such a tail is held back until the next token completes it, so a stream never shows it.
    Stop strings are searched in the text; on a match the text is cut before the stop string.

    The first and the final update decode the whole output. Those in between decode a window:
    the chunk of ids settled last, then the ids after it; the window's text less the chunk's
    own is what the new ids add. So an update costs the same at any output length, and its
    text is the whole decode's (tested on real tokenizers, partial characters and special
    tokens included).
    """

    decode: Callable[[list[int]], str]
    stop: list[str] = field(default_factory=list)
    text: str = ""  # settled text emitted so far
    stopped: bool = False
    _settled: str = ""  # the decode of ids[:_read]
    _start: int = 0  # the window starts here: ids[_start:_read] decode to _last
    _read: int = 0
    _last: str = ""

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """Return the newly settled text for ``output_ids``; sets ``stopped`` on a stop string."""
        full = None if final else self._windowed(output_ids)
        if full is None:
            full = self.decode(output_ids)
            if not final and full and not full.endswith(REPLACEMENT_CHAR):
                self._settled, self._start, self._read, self._last = full, 0, len(output_ids), full
            elif not final:
                full = full.rstrip(REPLACEMENT_CHAR)
        cut = self._stop_index(full)
        if cut is not None:
            full, self.stopped = full[:cut], True
        elif not final:
            # Hold back a tail that might be the start of a stop string.
            full = full[: len(full) - self._partial_stop_len(full)]
        if not full.startswith(self.text):
            return ""  # the decoder revised earlier text (rare); keep what was emitted
        delta = full[len(self.text) :]
        self.text = full
        return delta

    def _windowed(self, ids: list[int]) -> str | None:
        """The decode of ``ids`` less a held-back tail, from the window; None where the whole
        must be decoded (no settled point yet, fewer ids than before, a window that does not
        start with its settled chunk's text)."""
        if self._read == 0 or len(ids) < self._read:
            return None
        window = self.decode(ids[self._start :])
        if not window.startswith(self._last):
            return None
        tail = window[len(self._last) :]
        if not tail or tail.endswith(REPLACEMENT_CHAR):
            return self._settled + tail.rstrip(REPLACEMENT_CHAR)
        self._settled += tail
        self._start, self._read = self._read, len(ids)
        self._last = self.decode(ids[self._start :])
        return self._settled

    def _stop_index(self, text: str) -> int | None:
        # Only the region that can contain a new match needs searching.
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, text: str) -> int:
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
