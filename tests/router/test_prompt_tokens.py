"""The router's token ids of a request are the worker's, id for id (``worker/prepare.py``
over the transformers tokenizer is the reference)."""

from __future__ import annotations

import json

import pytest
from tool_chat import WEATHER_TOOL

from splitserve.common.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.router.prompt_tokens import ChatTokenizer
from splitserve.worker.prepare import ModelInfo, chat_input, completion_input

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
}
CHATS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Sum 2 and 3.\nThen stop."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "  and é, 中文, emoji 🙂  "},
    ],
    [
        {"role": "developer", "content": "Act as a shell."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "ls"}, {"type": "text", "text": "-la"}],
        },
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The router's tokenizer and the worker's, from the same files (what the model cache
    holds for the default model)."""
    from splitserve.common.tokenizer import Tokenizer
    from splitserve.models.loader import default_model_path

    worker = Tokenizer.from_gguf(default_model_path())
    path = tmp_path_factory.mktemp("tokenizer")
    worker.save(path)
    model = ModelInfo("m", worker, max_model_len=8192, vocab_size=worker.vocab_size)
    return ChatTokenizer.from_dir(str(path)), model


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_chat_ids_are_the_workers(tokenizers, messages, tools):
    router, model = tokenizers
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    expected = chat_input(ChatCompletionRequest.model_validate(body), model).prompt_token_ids
    assert router.request_ids(body) == expected


@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon a time"], [5, 6, 7], [[5, 6]]])
def test_completion_ids_are_the_workers(tokenizers, prompt):
    router, model = tokenizers
    body = {"prompt": prompt}
    expected = completion_input(CompletionRequest.model_validate(body), model).prompt_token_ids
    assert router.request_ids(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": "not a list"},
        {"prompt": ["two", "prompts"]},
        {"prompt": ""},
        {},
    ],
)
def test_requests_the_worker_would_reject_have_no_ids(tokenizers, body):
    assert tokenizers[0].request_ids(body) is None


def test_named_templates_and_special_tokens_from_the_config(tmp_path, tokenizers):
    router, _ = tokenizers
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "{{ eos_token }}{{ tools | tojson }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    router.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    named = ChatTokenizer.from_dir(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert named.chat_ids(messages) == router.tokenizer.encode(
        "<|im_start|>hi", add_special_tokens=False
    )
    tools = [{"name": "é"}]
    text = '<|im_end|>[{"name": "é"}]'  # tojson keeps non-ASCII, as transformers' does
    assert named.chat_ids(messages, tools) == router.tokenizer.encode(
        text, add_special_tokens=False
    )


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        ChatTokenizer.from_dir(str(tmp_path))


def test_router_and_worker_split_a_public_prefix_alike(tokenizers, tmp_path):
    # The router's KV-event index must name the blocks the worker hashes: both derive the
    # same split salt from the keys file, each with its own tokenizer.
    from splitserve.common.tenants import Tenants
    from splitserve.router.app import _salts
    from splitserve.worker.auth import WorkerAuth

    router, model = tokenizers
    system = "You are the assistant of a small rocket company; be brief and exact."
    keys = {
        "keys": [{"key": "sk-1", "tenant": "acme", "share_public_prefix": True}],
        "tenants": {
            "acme": {
                "public_prefixes": [
                    {"messages": [{"role": "system", "content": system}]},
                    "Transcript of a support call between Acme and a customer.",
                ]
            }
        },
    }
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    tenants = Tenants.load(tmp_path / "keys.json")
    principal = tenants.identify("Bearer sk-1").principal
    at_router = _salts(tenants, b"secret", router)
    at_worker = WorkerAuth.for_model(tenants, b"secret", model.tokenizer).salts
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    text = {"prompt": "Transcript of a support call between Acme and a customer. Agent: hello"}
    chat_ids = chat_input(ChatCompletionRequest.model_validate(chat), model).prompt_token_ids
    text_ids = completion_input(CompletionRequest.model_validate(text), model).prompt_token_ids
    for body, ids in ((chat, chat_ids), (text, text_ids)):
        salt = at_worker.salt(principal, None, ids)
        assert salt.startswith("\0")  # split: the prefix is shared
        assert at_router.salt(principal, None, router.request_ids(body)) == salt
