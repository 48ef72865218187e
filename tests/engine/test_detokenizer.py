from __future__ import annotations

import random

import pytest

from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.models.loader import default_model_path

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


class WholeDecode(IncrementalDetokenizer):
    """The reference: every update decodes the whole output."""

    def _windowed(self, ids: list[int]) -> str | None:
        return None


def _sentencepiece_like():
    """A Llama-style tokenizer trained here: "▁" for spaces, byte fallback, one leading space
    stripped on decode."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    t = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    t.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return t


TEXT = "é, 中文, emoji 🙂🙂, tabs\tand\nnewlines\r\n<|im_start|>user\nhi<|im_end|> {'a': [1]}  x "


@pytest.fixture(scope="module", params=["default model", "sentencepiece-like"])
def backend(request):
    if request.param == "default model":
        return Tokenizer.from_gguf(default_model_path()).backend
    return _sentencepiece_like()


@pytest.mark.parametrize("seed", range(3))
def test_windowed_updates_give_the_whole_decodes_deltas(backend, seed):
    """Real tokenizers, ids from real text, random ids (partial characters that never
    complete, special tokens) and stop strings: each update's delta is the one decoding the
    whole output gives."""
    rng = random.Random(seed)
    vocab, ids_of_text = backend.get_vocab_size(), backend.encode(TEXT * 3).ids

    def decode(ids):
        return backend.decode(ids, skip_special_tokens=True)

    for case in range(300):
        if case % 3 == 0:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        elif case % 3 == 1:
            start = rng.randrange(len(ids_of_text))
            ids = ids_of_text[start : start + rng.randrange(1, 60)]
        else:
            ids = [
                rng.choice(ids_of_text) if rng.random() < 0.5 else rng.randrange(vocab)
                for _ in range(40)
            ]
        stop = rng.choice([[], [" "], ["中"], ["\n\n", "ab"]])
        windowed, whole = (
            IncrementalDetokenizer(decode, list(stop)),
            WholeDecode(decode, list(stop)),
        )
        for i in range(1, len(ids) + 1):
            final = i == len(ids) and case % 2 == 1
            assert windowed.update(ids[:i], final) == whole.update(ids[:i], final), (ids, i)
            assert windowed.stopped == whole.stopped
            if whole.stopped:
                break
        assert windowed.text == whole.text


def test_an_update_decodes_a_few_ids_however_long_the_output():
    backend = Tokenizer.from_gguf(default_model_path()).backend
    ids = backend.encode(TEXT * 60).ids[:2000]
    decoded = []

    def decode(part):
        decoded.append(len(part))
        return backend.decode(part, skip_special_tokens=True)

    d = IncrementalDetokenizer(decode)
    for i in range(1, len(ids) + 1):
        d.update(ids[:i])
    assert d.text == backend.decode(ids, skip_special_tokens=True)
    assert max(decoded[2:]) <= 8  # whole-output decoding would reach 2,000
