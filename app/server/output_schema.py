"""What the answer must be: ``response_format`` (and llama.cpp's ``json_schema`` /
``grammar``, and ``regex``) as an `engine.Constraint`, checked into a 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable

from app.server.errors import invalid
from app.server.values import string
from engine.constraint import Constraint
from engine.errors import RequestError

CONSTRAINTS = ("response_format", "json_schema", "grammar", "regex")


def _make(make: Callable[[], Constraint | None], name: str) -> Constraint | None:
    try:
        return make()
    except RequestError as e:
        raise invalid(str(e), name) from None


def response_format(name: str, value) -> Constraint | None:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Constraint("json_object")
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
            raise invalid("response_format.json_schema must be an object with name, schema, "
                          "strict and description", f"{name}.json_schema")
        if spec.get("schema") is None:  # no schema: any JSON object
            return Constraint("json_object")
        return _make(lambda: Constraint.json_schema(spec["schema"]),
                     f"{name}.json_schema.schema")
    raise invalid('response_format must be {"type": "text"}, {"type": "json_object"} or '
                  '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', name)


def local_constraint(kind: str) -> Callable[[str, object], Constraint]:
    """llama.cpp's top-level ``json_schema`` and ``grammar`` (GBNF or Lark), and ``regex``."""
    def check(name: str, value) -> Constraint:
        if kind == "json_schema":
            return _make(lambda: Constraint.json_schema(value), name)
        return _make(lambda: Constraint(kind, string(name, value)), name)
    return check
