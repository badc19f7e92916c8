"""The project's own error type.

Everything a user can get wrong (a config key, a path, a prompt, a checkpoint) raises
an AttnlabError whose message says what happened and what to do. The scripts print
that message without a traceback; set ATTNLAB_DEBUG=1 to see the traceback too.
"""
from __future__ import annotations

import difflib
import os
import sys
from contextlib import contextmanager


class AttnlabError(Exception):
    """A mistake in input or environment, explained in its message."""


class ConfigError(AttnlabError, ValueError):
    """A configuration value or combination that cannot work."""


class CheckpointError(AttnlabError):
    """A checkpoint or run directory that is missing, corrupt or mismatched."""


class DataError(AttnlabError):
    """A corpus that is missing, empty or too short."""


class TokenizerError(AttnlabError, ValueError):
    """Text the tokenizer cannot encode, or a tokenizer file it cannot read."""


def choices_hint(name: str, valid) -> str:
    """'did you mean' text listing the valid choices for a misspelt name."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; valid choices: {', '.join(valid)}"


@contextmanager
def friendly_errors(*also: type[Exception]):
    """Turn AttnlabError (and the exception types in `also`, such as the model's own
    ModelError, which cannot derive from this floor's type) into one clear line on
    stderr and exit status 2."""
    try:
        yield
    except (AttnlabError, *also) as err:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
