"""A config field that carries its own documentation, so the command line, --help and
error messages are generated from the dataclasses instead of written by hand."""
from __future__ import annotations

from dataclasses import field


def opt(default, help: str, registry: str | None = None, choices: tuple | None = None):
    """A dataclass field with its one-line doc (shown by --help) and, for a field that
    names a variant, either the registry that lists the valid names or a fixed tuple
    of choices."""
    return field(default=default, metadata={"help": help, "registry": registry,
                                            "choices": choices})
