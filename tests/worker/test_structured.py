"""Grammars from request fields (``worker/structured.py``): the schema tightenings."""

from __future__ import annotations

import pytest

from splitserve.worker.structured import GrammarError, json_grammar, tightened


def test_objects_are_closed_and_integers_bounded_unless_the_schema_says_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "m": {"type": ["integer", "null"], "minimum": 0},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
        },
        "$defs": {"x": {"anyOf": [{"type": "object", "properties": {"b": {}}}]}},
    }
    out = tightened(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (-(2**53 - 1), 2**53 - 1)
    assert (props["m"]["minimum"], props["m"]["maximum"]) == (0, 2**53 - 1)
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["x"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left alone


def test_a_schema_llguidance_cannot_compile_is_a_grammar_error():
    with pytest.raises(GrammarError, match="cannot be enforced"):
        json_grammar({"type": "wat"})
    with pytest.raises(GrammarError, match="must be an object"):
        json_grammar(["not", "a", "schema"])  # type: ignore[arg-type]
