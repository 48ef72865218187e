"""Grammars for structured output and forced tool calls, from the OpenAI request fields.

Each is an llguidance grammar (Lark syntax with ``%json`` schemas) that the model runner's
matchers enforce token by token (``engine/grammar.py``):

- ``response_format: {"type": "json_object"}``: one JSON object;
- ``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}``: one JSON value
  valid under the schema;
- ``tool_choice: "required"`` or a named function: the reply is Hermes-format calls,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each call's arguments valid
  under its tool's ``parameters`` (one call when ``parallel_tool_calls`` is false);
- ``tool_choice: "auto"``: the text is free, but once the model opens a ``<tool_call>`` the
  call's body is constrained the same way (the trigger of ``tool_call_body``).

JSON is generated with fixed separators and no free whitespace, so a reply cannot run on in
blank lines. Two more tightenings keep a small model from wandering while every output stays
valid under the schema as given: objects get no properties beyond those their schema names
(unless it sets ``additionalProperties`` itself; xgrammar's and vLLM's ``strict_mode``), and
integers without bounds stay within I-JSON's exactly representable range, +-(2**53 - 1)
(RFC 7493), so a reply cannot run on in digits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from splitserve.worker.tool_calls import CLOSE, OPEN

# The separators models see in their tool-call examples, and no other whitespace.
_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Grammar:
    """An llguidance grammar and, if it only applies after a marker, that marker."""

    grammar: str
    trigger: str | None = None


class GrammarError(ValueError):
    """The request's schema or tools make no usable grammar."""


def json_grammar(schema: dict[str, Any] | None) -> Grammar:
    """One JSON value under ``schema`` (None: any JSON object)."""
    return Grammar(_lark(f"start: {_json(schema or {'type': 'object'})}\n"))


def tool_calls_grammar(tools: list[dict[str, Any]], parallel: bool) -> Grammar:
    """The reply is only calls to ``tools`` (OpenAI function definitions)."""
    more = f' ("\\n" {_quote(OPEN)} body {_quote(CLOSE)})*' if parallel else ""
    lark = f"start: {_quote(OPEN)} body {_quote(CLOSE)}{more}\nbody: {_json(_call_schema(tools))}\n"
    return Grammar(_lark(lark))


def tool_call_body(tools: list[dict[str, Any]]) -> Grammar:
    """Free text, but what follows each ``<tool_call>`` is a valid call to one of ``tools``."""
    lark = f"start: body {_quote(CLOSE)}\nbody: {_json(_call_schema(tools))}\n"
    return Grammar(_lark(lark), trigger=OPEN)


def json_or_tool_calls(schema: dict[str, Any] | None, tools: list[dict[str, Any]]) -> Grammar:
    """Either the JSON answer of ``json_grammar(schema)`` or calls to ``tools``."""
    call = f"{_quote(OPEN)} body {_quote(CLOSE)}"
    lark = (
        f'start: answer | {call} ("\\n" {call})*\n'
        f"answer: {_json(schema or {'type': 'object'})}\nbody: {_json(_call_schema(tools))}\n"
    )
    return Grammar(_lark(lark))


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    options = []
    for tool in tools:
        fn = tool["function"]
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: dict[str, Any]) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        return "%json " + json.dumps({**tightened(schema), "x-guidance": _JSON_FORMAT})
    except RecursionError as e:
        raise GrammarError("the schema is nested too deeply") from e


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


_SAFE_INTEGER = 2**53 - 1


def tightened(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that names
    properties and says nothing about others, and I-JSON bounds on unbounded integers."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: tightened(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [tightened(v) for v in out[key]]
    if isinstance(out.get("items"), dict):
        out["items"] = tightened(out["items"])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    types = out.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_SAFE_INTEGER
    return out


def _quote(text: str) -> str:
    return json.dumps(text)


def _lark(lark: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # the library's own checks; any failure is the schema's
        raise GrammarError(f"the schema cannot be enforced: {e}") from e
    if is_error:
        raise GrammarError(f"the schema cannot be enforced: {messages[0].splitlines()[0]}")
    return grammar
