"""Twenty JSON Schemas of the shapes agents ask for: plans, tool arguments, extractions,
classifications. Nested objects, enums, arrays and required fields; strings and arrays are
bounded the way production schemas bound them (``maxLength``, ``maxItems``), so that a reply
fits a finite token budget. Used by benchmarks/grammar_masks.py and
benchmarks/structured_output.py (imported from this directory)."""

from __future__ import annotations

from typing import Any


def _s(n: int = 40) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _arr(items: dict[str, Any], n: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": n}


SCHEMAS: dict[str, dict[str, Any]] = {
    "weather_args": _obj({"city": _s(), "unit": _enum("celsius", "fahrenheit")}),
    "search_args": _obj(
        {"query": _s(60), "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        ["query"],
    ),
    "calendar_event": _obj(
        {
            "title": _s(),
            "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "attendees": _arr(_s(30), 3),
        }
    ),
    "sentiment": _obj(
        {
            "label": _enum("positive", "negative", "neutral"),
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "plan": _obj(
        {
            "goal": _s(),
            "steps": _arr(_obj({"action": _s(), "tool": _enum("search", "code", "none")}), 3),
        }
    ),
    "contact": _obj(
        {
            "name": _s(),
            "email": _s(),
            "address": _obj({"street": _s(), "city": _s(), "country": _s(20)}, ["city"]),
        },
        ["name", "address"],
    ),
    "file_edit": _obj(
        {
            "path": _s(60),
            "operation": _enum("create", "replace", "delete"),
            "content": _s(80),
        },
        ["path", "operation"],
    ),
    "shell_command": _obj(
        {"command": _s(60), "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}}
    ),
    "ticket_triage": _obj(
        {
            "priority": _enum("low", "medium", "high", "urgent"),
            "team": _enum("billing", "infra", "product", "security"),
            "summary": _s(60),
        }
    ),
    "entities": _obj(
        {"entities": _arr(_obj({"text": _s(30), "type": _enum("person", "org", "place")}), 3)}
    ),
    "product": _obj(
        {
            "name": _s(),
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
            "tags": _arr(_s(15), 3),
        }
    ),
    "sql_query": _obj({"sql": _s(100), "read_only": {"type": "boolean"}}),
    "email_draft": _obj({"to": _arr(_s(), 2), "subject": _s(), "body": _s(120)}),
    "recipe": _obj(
        {
            "dish": _s(),
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": _arr(_obj({"item": _s(20), "grams": {"type": "integer"}}), 3),
        }
    ),
    "code_review": _obj(
        {
            "verdict": _enum("approve", "request_changes", "comment"),
            "comments": _arr(_obj({"line": {"type": "integer", "minimum": 1}, "text": _s(60)}), 2),
        }
    ),
    "travel": _obj(
        {
            "origin": _s(20),
            "destination": _s(20),
            "class": _enum("economy", "business", "first"),
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        }
    ),
    "classification": _obj(
        {
            "category": _enum("question", "request", "complaint", "other"),
            "language": _enum("en", "fr", "de", "es"),
        }
    ),
    "memory_write": _obj(
        {
            "key": {"type": "string", "pattern": "^[a-z_]{1,20}$"},
            "value": _s(60),
            "ttl_days": {"type": ["integer", "null"]},
        },
        ["key", "value"],
    ),
    "answer_with_sources": _obj(
        {
            "answer": _s(80),
            "sources": _arr(_obj({"title": _s(30), "url": _s(50)}), 2),
        }
    ),
    "handoff": _obj(
        {
            "agent": _enum("researcher", "coder", "reviewer"),
            "reason": _s(60),
            "context": _obj({"task_id": {"type": "integer"}, "urgent": {"type": "boolean"}}),
        }
    ),
}

assert len(SCHEMAS) == 20


def tool_of(name: str) -> dict[str, Any]:
    """The schema as an OpenAI function tool of the same name."""
    return {
        "type": "function",
        "function": {"name": name, "description": f"Record a {name}", "parameters": SCHEMAS[name]},
    }
