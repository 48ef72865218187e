"""The tokenizer (``common/tokenizer.py``: ``tokenizers`` and jinja2, no ``transformers``)
gives the ids, text and chat prompts ``transformers`` gives for the bundled model, whether it
reads a directory ``transformers`` wrote or one it wrote itself."""

from __future__ import annotations

import random

import pytest
from tool_chat import WEATHER_TOOL

from splitserve.common.tokenizer import Tokenizer
from splitserve.models.loader import default_model_path

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "é, 中文, emoji 🙂, tabs\tand\nnewlines\r\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # code",
]
CHATS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Sum 2 and 3.\nThen stop."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "  and é, 中文  "},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ],
]


@pytest.fixture(scope="module")
def reference():
    """``transformers``' tokenizer of the bundled GGUF."""
    import os

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    directory, name = os.path.split(default_model_path())
    return TokenizersBackend.from_pretrained(directory, gguf_file=name, local_files_only=True)


@pytest.fixture(scope="module", params=["written by transformers", "written by splitserve"])
def ours(request, reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    if request.param == "written by transformers":
        reference.save_pretrained(path)
    else:
        Tokenizer.from_gguf(default_model_path()).save(path)
    return Tokenizer.from_hf_dir(str(path))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_ids_are_transformers(ours, reference, text, special):
    assert ours.encode(text, add_special_tokens=special) == reference.encode(
        text, add_special_tokens=special
    )


@pytest.mark.parametrize("skip", [True, False])
def test_text_is_transformers(ours, reference, skip):
    rng = random.Random(0)
    samples = [reference.encode(t) for t in TEXTS]
    samples += [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)
    ]
    samples += [[0, 1, 2, 3, 17, 2]]  # special tokens among the others
    for ids in samples:
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_chat_prompts_are_transformers(ours, reference, messages, tools):
    expected = reference.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours.chat_prompt(messages, tools) == expected
    assert ours.apply_chat_template(messages, tools) == reference.encode(
        expected, add_special_tokens=False
    )


def test_vocabulary_and_end_of_sequence_are_transformers(ours, reference):
    assert ours.vocab_size == len(reference) == 49152
    assert ours.eos_token_id == reference.eos_token_id and ours.eos_token_ids == [2]


def test_a_directory_with_no_template_says_so_when_asked_for_a_chat(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    bare = Tokenizer.from_hf_dir(str(tmp_path))
    assert bare.encode("hi") == ours.encode("hi") and bare.eos_token_ids == []
    with pytest.raises(ValueError, match="no chat template"):
        bare.chat_prompt([{"role": "user", "content": "hi"}])


def test_a_corrupt_tokenizer_file_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer from"):
        Tokenizer.from_hf_dir(str(tmp_path))
