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
    """

    decode: Callable[[list[int]], str]
    stop: list[str] = field(default_factory=list)
    text: str = ""  # settled text emitted so far
    stopped: bool = False

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """Return the newly settled text for ``output_ids``; sets ``stopped`` on a stop string."""
        full = self.decode(output_ids)
        if not final and full.endswith(REPLACEMENT_CHAR):
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
