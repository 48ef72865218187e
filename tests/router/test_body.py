"""The forwarded body: the client's bytes with the router's fields appended."""

from __future__ import annotations

import json

import pytest

from splitserve.router.body import forwarded, parse
from splitserve.router.errors import RouterError


def test_fields_are_appended_to_the_clients_own_bytes():
    raw = b'{"messages": [{"role": "user", "content": "h\\u00e9"}], "n": 12345678901234567890}\n'
    out = forwarded(raw, parse(raw), {"return_token_ids": True}, rewrite=False)
    assert out.startswith(raw.rstrip()[:-1])  # untouched, escapes and big integers included
    assert json.loads(out) == {**json.loads(raw), "return_token_ids": True}


def test_a_body_without_added_fields_goes_as_it_came():
    raw = b'{"model": "m",  "stream": false}'
    assert forwarded(raw, parse(raw), {}, rewrite=False) is raw


@pytest.mark.parametrize(
    ("raw", "added", "rewrite"),
    [
        (b'{"return_token_ids": false, "x": 1}', {"return_token_ids": True}, False),  # duplicate
        (b'{"kv_peer": "http://evil", "x": 1}', {}, True),  # the router removed a field
        ('{"x": 1}'.encode("utf-16"), {"y": 2}, False),  # not UTF-8 text
        (b"\xef\xbb\xbf" + b'{"x": 1}', {"y": 2}, False),  # a byte-order mark
        (b"{}", {"y": 2}, False),  # nothing to append a comma to
    ],
)
def test_other_bodies_are_serialised_again(raw, added, rewrite):
    body = parse(raw)
    body.pop("kv_peer", None)
    out = forwarded(raw, body, added, rewrite)
    assert json.loads(out) == {**body, **added}
    assert out.count(b'"return_token_ids"') <= 1


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{", b"\xff"])
def test_a_body_that_is_not_a_json_object_is_a_400(raw):
    with pytest.raises(RouterError) as e:
        parse(raw)
    assert e.value.status == 400
