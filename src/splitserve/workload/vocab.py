"""Synthetic text whose length in tokens is known without a tokenizer.

Chat workloads write their messages with these words: each is one token of the default
model's tokenizer with or without a leading space, so ``n`` space-joined words are ``n``
tokens (checked against the real tokenizer by the end-to-end test). A word's token-view id is
``TEXT_ID_BASE + its index``, which makes text and synthetic ids a bijection: equal id runs are
equal text, the property the simulator's cache accounting relies on.
"""

from __future__ import annotations

from collections.abc import Sequence

WORDS = tuple(
    """the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there been one all we their has would when if so
    no will can more other its what out up time some into only new most may also any these two
    about first then over after such like people them very way well should just could even
    many because those now work life world both must though make year last while own same part
    here take three great place house where much long high still every day never under might
    state power case good point give find fact think thing each group small next end hand form
    name show back line real side need number order right word""".split()
)
TEXT_ID_BASE = 1000


def text_of(token_ids: Sequence[int]) -> str:
    """The text for token-view ids drawn from ``text_ids`` ranges."""
    return " ".join(WORDS[(t - TEXT_ID_BASE) % len(WORDS)] for t in token_ids)
