from __future__ import annotations

from splitserve.engine.detokenizer import IncrementalDetokenizer

# A toy vocabulary where token 9 is the first half of a multi-byte character.
VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " E", 7: "ND", 8: "\u00e9"}


def decode(ids: list[int]) -> str:
    text = "".join(VOCAB.get(i, "") for i in ids)
    if ids and ids[-1] == 9:
        text += "\ufffd"
    return text


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.update(ids[: i + 1], final=i == len(ids) - 1) for i in range(len(ids))]


def test_deltas_concatenate_to_the_text():
    d = IncrementalDetokenizer(decode)
    deltas = feed(d, [1, 2, 3, 4, 5])
    assert deltas == ["Hel", "lo", " wor", "ld", "!"]
    assert d.text == "Hello world!" and not d.stopped


def test_incomplete_character_is_held_back():
    d = IncrementalDetokenizer(decode)
    assert d.update([1, 9]) == "Hel"
    assert d.update([1, 9, 8]) == "\u00e9"


def test_stop_string_cuts_text_before_it():
    d = IncrementalDetokenizer(decode, stop=["wor"])
    deltas = [d.update([1, 2]), d.update([1, 2, 3])]
    assert "".join(deltas) == "Hello " and d.stopped


def test_stop_string_spanning_tokens():
    d = IncrementalDetokenizer(decode, stop=[" END"])
    assert d.update([1, 6]) == "Hel"  # " E" might start " END": held back
    assert d.update([1, 6, 7]) == "" and d.stopped
    assert d.text == "Hel"


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    d = IncrementalDetokenizer(decode, stop=[" END"])
    d.update([1, 6])
    assert d.update([1, 6, 5]) == " E!"


def test_final_flushes_everything():
    d = IncrementalDetokenizer(decode, stop=[" END"])
    assert d.update([1, 6], final=True) == "Hel E"
