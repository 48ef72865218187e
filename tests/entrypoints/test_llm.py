"""The offline API on the bundled model: determinism, prefix caching, preemption, bad input."""

from __future__ import annotations

import random

import pytest

from splitserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_gb=0.25)


def mixed_prompts(llm: LLM, n: int = 16) -> list[list[int]]:
    rng = random.Random(0)
    topics = ["the sea", "compilers", "a cat", "prime numbers", "rain", "graph theory", "tea"]
    prompts = []
    for i in range(n):
        text = f"Tell me about {topics[i % len(topics)]}." + " Please be brief." * rng.randint(0, 8)
        prompts.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return prompts


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_generate_returns_vllm_shaped_outputs(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.tokenizer.encode("The capital of France is")
    assert len(out.outputs[0].token_ids) <= 8
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(msgs)
    assert out.outputs[0].text.strip()


def test_greedy_is_identical_alone_in_batch_and_with_prefix_hit(llm):
    prompts = mixed_prompts(llm)
    llm.engine.block_manager.reset_prefix_cache()
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts[:4]]
    llm.engine.block_manager.reset_prefix_cache()
    batch = tokens(llm.generate(prompts, GREEDY))
    assert batch[:4] == alone
    hits_before = llm.engine.block_manager.prefix_hits
    again = llm.generate(prompts[:4], GREEDY)
    assert tokens(again) == alone
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.block_manager.prefix_hits > hits_before


def test_greedy_is_identical_after_preemption(llm):
    prompts = mixed_prompts(llm, n=8)
    llm.engine.block_manager.reset_prefix_cache()
    expected = tokens(llm.generate(prompts, GREEDY))
    # ~27 blocks of 16 tokens for 8 requests of ~5 blocks each: some must be preempted.
    small = LLM(kv_cache_gb=0.019, max_model_len=256)
    got = tokens(small.generate(prompts, GREEDY))
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


def test_greedy_is_identical_under_shortest_prefill_scheduling(llm):
    prompts = mixed_prompts(llm, n=8)
    llm.engine.block_manager.reset_prefix_cache()
    expected = tokens(llm.generate(prompts, GREEDY))
    # A small step budget leaves most prompts waiting, to be admitted shortest first.
    sjf = LLM(kv_cache_gb=0.25, max_num_batched_tokens=64, scheduling_policy="shortest-prefill")
    assert sjf.engine.scheduler.config.policy == "shortest-prefill"
    assert tokens(sjf.generate(prompts, GREEDY)) == expected


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234)
    alone = tokens(llm.generate(["Once upon a time"], p))[0]
    others = SamplingParams(max_tokens=16, temperature=1.0)
    batch = llm.generate(["Once upon a time", "Hello", "Why is the sky blue?"], [p, others, others])
    assert tokens(batch)[0] == alone


def test_stop_string_and_stop_token(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert " 6" in base.text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop=[" 6"]))
    assert out[0].outputs[0].text == base.text[: base.text.index(" 6")]
    assert out[0].outputs[0].finish_reason == "stop"
    stop_tok = base.token_ids[1]
    out = llm.generate(
        "1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok])
    )
    assert out[0].outputs[0].token_ids == base.token_ids[:2]


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    too_long = [100] * (llm.engine.max_model_len + 5)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([too_long])
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        LLM(model=str(junk))
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(no_such_option=1)


def test_bad_engine_settings_are_clear_errors():
    with pytest.raises(ValueError, match="scheduling policy must be one of .*, got 'lifo'"):
        LLM(scheduling_policy="lifo")
