"""A JSON object read from a file checked against a schema before any value is used:
each field's JSON type, an inclusive range for numbers, whether it may be null or
absent, and the fields of a nested object. One rule for every JSON file the project
reads (a transformers config.json, a shard folder's meta.json, a run's state.json), so
a damaged or hostile file is one error line naming it, never a KeyError or TypeError
from deep inside the code that trusted it."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """What one value of a config may be: its JSON type (int, float, bool, str or
    dict), an inclusive range for numbers, whether null (or absence) is allowed, and
    for a dict the fields inside it."""
    kind: type
    low: float | None = None
    high: float | None = None
    required: bool = False
    null: bool = False
    fields: dict | None = None


def count(high: int, low: int = 1, required: bool = True, null: bool = False) -> Field:
    """A whole number from `low` to `high`."""
    return Field(int, low, high, required=required, null=null)


_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
          dict: "an object"}


def _is(kind: type, value) -> bool:
    if kind is int:
        return type(value) is int                                 # bool is not a count
    if kind is float:
        return type(value) in (int, float) and math.isfinite(value)
    return type(value) is kind


def _bound(value, none: str) -> str:
    return none if value is None else f"{value:,g}" if isinstance(value, float) else f"{value:,}"


def config_problems(config: dict, schema: dict[str, Field], prefix: str = "") -> list[str]:
    """What in `config` breaks `schema`, one phrase each (empty: nothing)."""
    out = []
    for key, field in schema.items():
        name, value = prefix + key, config.get(key)
        if value is None:
            if field.required or (key in config and not field.null):
                out.append(f"{name} is {'missing' if key not in config else 'null'}")
            continue
        if not _is(field.kind, value):
            out.append(f"{name} is {str(value)[:40]!r} ({type(value).__name__}), not "
                       f"{_KINDS[field.kind]}")
        elif field.kind in (int, float) and not (
                (field.low is None or value >= field.low) and (field.high is None or value <= field.high)):
            out.append(f"{name}={value} is outside {_bound(field.low, '-inf')}.."
                       f"{_bound(field.high, 'inf')}")
        elif field.fields:
            out += config_problems(value, field.fields, prefix=f"{name}.")
    return out


def first_problems(problems: list[str], shown: int = 4) -> str:
    """The first few problems of a file, joined for one error line."""
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more
