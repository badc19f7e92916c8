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
    """What one value of a config may be: its JSON type (int, float, bool, str, dict or
    list), an inclusive range for numbers (for a list: for its number of items),
    whether null (or absence) is allowed, for a dict the fields inside it, and for a
    list what each item must be, and for a string the values it may take (any when empty)."""
    kind: type
    low: float | None = None
    high: float | None = None
    required: bool = False
    null: bool = False
    fields: dict | None = None
    items: "Field | None" = None
    choices: tuple = ()


def count(high: int, low: int = 1, required: bool = True, null: bool = False) -> Field:
    """A whole number from `low` to `high`."""
    return Field(int, low, high, required=required, null=null)


_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
          dict: "an object", list: "a list"}


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
        out += value_problems(name, value, field)
    return out


def value_problems(name: str, value, field: Field) -> list[str]:
    """What in one value (not null) breaks `field`: its kind, its range (a list's
    length), then the fields of an object or each item of a list."""
    if not _is(field.kind, value):
        return [f"{name} is {str(value)[:40]!r} ({type(value).__name__}), not "
                f"{_KINDS[field.kind]}"]
    size = len(value) if field.kind is list else value if field.kind in (int, float) else None
    if size is not None and not ((field.low is None or size >= field.low)
                                 and (field.high is None or size <= field.high)):
        what = f"{name} has {size:,} items, a number" if field.kind is list else f"{name}={value} is"
        return [f"{what} outside {_bound(field.low, '-inf')}..{_bound(field.high, 'inf')}"]
    if field.choices and value not in field.choices:
        return [f"{name} is {str(value)[:40]!r}, not one of {', '.join(map(str, field.choices))}"]
    if field.fields:
        return config_problems(value, field.fields, prefix=f"{name}.")
    out = []
    for i, item in enumerate(value if field.items else ()):
        if item is None:
            out += [] if field.items.null else [f"{name}[{i}] is null"]
        else:
            out += value_problems(f"{name}[{i}]", item, field.items)
    return out


def first_problems(problems: list[str], shown: int = 4) -> str:
    """The first few problems of a file, joined for one error line."""
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more
