"""Commands the project prints for a learner to paste.

A run's folder or a corpus can be any path (a space, a quote, a `$`); each one goes
into a printed command as a single shell word, so pasting the command does what it says.
"""
from __future__ import annotations

import shlex


def word(value) -> str:
    """`value` (a path, or an option such as --data.path=PATH) as one shell word: bare
    where that is safe, quoted where not."""
    return shlex.quote(str(value))


def options(overrides: dict[str, dict[str, str]], leave=()) -> list[str]:
    """The command line's --section.key=value options, each one shell word, but those
    named in `leave` (as "--section.key")."""
    return [word(f"--{s}.{k}={v}") for s, values in overrides.items()
            for k, v in values.items() if f"--{s}.{k}" not in leave]
