"""The converted-model cache: a GGUF read once, then loaded from its conversion."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_files import write_gguf_model

from splitserve.models import gguf_cache, gguf_loader, loader
from splitserve.models.loader import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.ENV_VAR, str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path, hf_model_factory):
    path = tmp_path / "tiny.gguf"
    write_gguf_model(hf_model_factory("qwen2", seed=3), "qwen2", path)
    return path


def no_gguf_reading(monkeypatch):
    def refuse(path):
        raise AssertionError(f"read {path} although the cache holds it")

    monkeypatch.setattr(gguf_loader, "open_gguf", refuse)


def weights(loaded) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in loaded.model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def entries(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_the_second_load_reads_the_conversion_and_gets_the_same_model(
    cache, tiny_gguf, monkeypatch
):
    first = load_model(str(tiny_gguf), load_tokenizer=False)
    (name,) = entries(cache)
    assert name == f"{gguf_cache.FORMAT}-{gguf_cache.file_digest(str(tiny_gguf))}"
    entry = cache / name
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors"]

    no_gguf_reading(monkeypatch)
    second = load_model(str(tiny_gguf), load_tokenizer=False)
    assert second.config == first.config
    assert_same(weights(first), weights(second))
    # A copy of the file under another name is the same entry, with its own model id.
    copy = tiny_gguf.with_name("renamed.gguf")
    copy.write_bytes(tiny_gguf.read_bytes())
    third = load_model(str(copy), load_tokenizer=False)
    assert third.config.model_id == "renamed.gguf"
    assert entries(cache) == [name]


def test_an_edited_file_is_a_new_entry(cache, tiny_gguf, tmp_path, hf_model_factory):
    load_model(str(tiny_gguf), load_tokenizer=False)
    write_gguf_model(hf_model_factory("qwen2", seed=4), "qwen2", tiny_gguf)
    other = load_model(str(tiny_gguf), load_tokenizer=False)
    assert len(entries(cache)) == 2
    fresh_copy = tmp_path / "fresh.gguf"
    fresh_copy.write_bytes(tiny_gguf.read_bytes())
    gguf_cache_off = load_model(str(fresh_copy), load_tokenizer=False)
    assert_same(weights(other), weights(gguf_cache_off))


def test_a_damaged_entry_is_converted_again(cache, tiny_gguf, caplog):
    first = load_model(str(tiny_gguf), load_tokenizer=False)
    (name,) = entries(cache)
    tensors = cache / name / "model.safetensors"
    size = tensors.stat().st_size
    tensors.write_bytes(tensors.read_bytes()[: size // 2])
    with caplog.at_level(logging.WARNING, logger="splitserve.models.loader"):
        again = load_model(str(tiny_gguf), load_tokenizer=False)
    assert "unreadable" in caplog.text
    assert_same(weights(first), weights(again))
    assert tensors.stat().st_size == size


def test_a_cache_that_cannot_be_written_leaves_the_load_as_it_was(
    tmp_path, tiny_gguf, monkeypatch, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(gguf_cache.ENV_VAR, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="splitserve.models.gguf_cache"):
        loaded = load_model(str(tiny_gguf), load_tokenizer=False)
    assert "not writable" in caplog.text
    assert loaded.config.architecture == "qwen2"


def test_off_writes_nothing(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setenv(gguf_cache.ENV_VAR, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.cache_dir() is None
    load_model(str(tiny_gguf), load_tokenizer=False)
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()
    monkeypatch.delenv(gguf_cache.ENV_VAR)
    assert gguf_cache.cache_dir() == tmp_path / "xdg" / "splitserve" / "models"


def test_two_writers_of_one_entry_leave_one_whole_entry(cache, tiny_gguf):
    reader = gguf_loader.open_gguf(str(tiny_gguf))
    config = gguf_loader.read_config(reader, "tiny.gguf")
    tensors = dict(gguf_loader.gguf_weights(reader, config))
    entry = gguf_cache.Entry(cache, gguf_cache.file_digest(str(tiny_gguf)))
    entry.write(config, tensors, None)
    entry.write(config, tensors, None)  # loses the rename to the first: discarded
    assert entries(cache) == [entry.path.name]  # no temporary directory left behind
    assert_same(dict(entry.read_weights()), tensors)


def test_the_default_models_tokenizer_comes_back_the_same(cache, monkeypatch):
    path = loader.default_model_path()
    first = load_model(path)
    no_gguf_reading(monkeypatch)
    monkeypatch.setattr(
        loader.Tokenizer, "from_gguf", lambda *a: pytest.fail("tokenizer rebuilt from GGUF")
    )
    second = load_model(path)
    assert second.config == first.config
    a, b = first.tokenizer, second.tokenizer
    assert b.eos_token_ids == a.eos_token_ids == [2]
    assert b.vocab_size == a.vocab_size
    text = "Hello  world!\n\tdef f(x): return 12345 # café 日本語 <|im_start|>"
    assert b.encode(text) == a.encode(text)
    assert b.decode(a.encode(text)) == a.decode(a.encode(text))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert b.chat_prompt(messages) == a.chat_prompt(messages)
    assert b.apply_chat_template(messages) == a.apply_chat_template(messages)
    assert_same(weights(first), weights(second))
