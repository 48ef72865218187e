"""Session key extraction order, and that per-request ids never become keys."""

from __future__ import annotations

from splitserve.router.session import SessionKey, prefix_key, session_key

SYSTEM = {"role": "system", "content": "You are a coding agent."}
FIRST = {"role": "user", "content": "Fix the failing test."}


def chat(*more: dict, **fields) -> dict:
    return {"model": "m", "messages": [SYSTEM, FIRST, *more], **fields}


def test_header_wins_over_body_fields():
    key = session_key({"X-Session-Id": "h1"}, chat(session_id="b1", user="u1"))
    assert key == SessionKey("h1", "header")


def test_header_name_is_case_insensitive():
    assert session_key({"x-session-id": "h1"}, chat()) == SessionKey("h1", "header")


def test_body_session_id_then_user():
    assert session_key({}, chat(session_id="b1", user="u1")) == SessionKey("b1", "session_id")
    assert session_key({}, chat(user="u1")) == SessionKey("u1", "user")
    assert session_key({}, chat(session_id=42)) == SessionKey("42", "session_id")


def test_empty_or_odd_values_fall_through():
    body = chat(session_id="", user=True)
    assert session_key({"X-Session-Id": "  "}, body).source == "prefix"


def test_request_ids_are_never_the_key():
    a = session_key({"X-Request-Id": "r1"}, chat(request_id="r1"))
    b = session_key({"X-Request-Id": "r2"}, chat(request_id="r2"))
    assert a.source == "prefix"
    assert a == b
    assert "r1" not in a.key


def test_conversation_hash_is_the_same_on_every_turn():
    turn1 = session_key({}, chat())
    turn3 = session_key(
        {},
        chat({"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}),
    )
    assert turn1 == turn3
    assert turn1.source == "prefix"


def test_conversations_with_different_first_messages_differ():
    other = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Other task."}]}
    assert session_key({}, chat()) != session_key({}, other)


def test_content_parts_hash_like_plain_text():
    parts = {"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}
    assert session_key({}, {"messages": [SYSTEM, parts]}) == session_key({}, chat())


def test_completion_prompt_uses_its_first_characters():
    base = "x" * 600
    a = session_key({}, {"prompt": base + " turn one"}, prefix_chars=512)
    b = session_key({}, {"prompt": base + " turn two, longer"}, prefix_chars=512)
    assert a == b
    assert session_key({}, {"prompt": ["only one"]}) == session_key({}, {"prompt": "only one"})


def test_completion_token_prompt_uses_its_first_tokens():
    a = session_key({}, {"prompt": list(range(200))}, prefix_tokens=128)
    b = session_key({}, {"prompt": list(range(128)) + [7] * 90}, prefix_tokens=128)
    assert a == b


def test_nothing_to_hash_gives_no_key():
    assert session_key({}, {"prompt": ""}) is None
    assert session_key({}, {"messages": []}) is None


def test_prefix_key_is_the_system_prompt():
    other_user = {"messages": [SYSTEM, {"role": "user", "content": "Something else"}]}
    assert prefix_key(chat()) == prefix_key(other_user)
    assert prefix_key({"messages": [FIRST]}) != prefix_key(chat())
    assert prefix_key({"prompt": "abc"}) is not None
    assert prefix_key({}) is None
