"""The project's own error type.

Everything a user can get wrong (a config key, a path, a prompt, a checkpoint) raises
an AttnlabError whose message says what happened and what to do. The scripts print
that message without a traceback; set ATTNLAB_DEBUG=1 to see the traceback too.
"""
from __future__ import annotations

import difflib
import os
import signal
import sys
import threading
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


def _in_order(letters: str, word: str) -> bool:
    rest = iter(word)
    return all(c in rest for c in letters)


def _swapped(name: str, word: str) -> bool:
    """`name` is `word` with two neighbouring letters swapped (mah, mha)."""
    return len(name) == len(word) and any(
        name[:i] + name[i + 1] + name[i] + name[i + 2:] == word for i in range(len(name) - 1))


def closest(name: str, valid) -> str | None:
    """The valid name a misspelling most likely meant: the same but for capitals (MHA,
    mha), the same with two neighbouring letters swapped (mah, mha: difflib rates a short
    name's swap below its cutoff), one it abbreviates (its letters in order from the
    first: attn, attention), else one difflib rates at least 0.7 alike (its own cutoff,
    0.6, matched 'bogus' to 'yours': three letters of five). model/registry.py keeps the
    same rule, as model/ imports nothing of the project's; tests/test_config.py holds the
    two to the same answers."""
    same = [v for v in valid if v.lower() == name.lower()]            # MHA, Rope
    swap = [v for v in valid if _swapped(name.lower(), v.lower())]    # mah, Rpoe
    short = [v for v in valid if len(name) >= 3 and v[:1] == name[:1] and _in_order(name, v)]
    close = same or swap or difflib.get_close_matches(name, short, n=1, cutoff=0) or \
        difflib.get_close_matches(name, list(valid), n=1, cutoff=0.7)
    return close[0] if close else None


def choices_hint(name: str, valid) -> str:
    """'did you mean' text listing the valid choices for a misspelt name."""
    valid = sorted(valid)
    close = closest(str(name), valid)
    hint = f" (did you mean {close!r}?)" if close else ""
    return f"{hint}; valid choices: {', '.join(valid)}"


# The optional packages: a tool that needs one it cannot import says which file installs
# it, in the one line every error gets (the light install leaves them out).
EXTRAS = ("transformers", "datasets", "wandb", "bertviz")
EXTRAS_FILE = "requirements-extra.txt"


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
    except ModuleNotFoundError as err:
        package = (err.name or "").split(".")[0]
        if os.environ.get("ATTNLAB_DEBUG") or package not in EXTRAS:
            raise
        print(f"error: this needs {package}, an optional package: pip install -r "
              f"{EXTRAS_FILE}", file=sys.stderr)
        sys.exit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or a CI's stop, `kill`) raised as a Ctrl-C is, so that what
    a Ctrl-C does where it lands is done for it too."""


@contextmanager
def terminate_as_interrupt(active: bool = True):
    """SIGTERM as Ctrl-C while a run is set up (`active`: one process; under torchrun the
    launcher stops its processes its own way). Its default ends the process at once: a
    run folder made and not yet checkpointed was left half-made, with no word of it; as
    an interrupt, the set-up removes it and says so. The training loop's own handler
    takes over while it runs."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupt_at_start():
    """Ctrl-C while a script loads its modules (torch's import takes a second or more),
    before anything is read or written: one line, status 130, instead of the import's
    traceback."""
    try:
        yield
    except KeyboardInterrupt:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        print("error: interrupted while starting, before anything was written; run the "
              "same command again", file=sys.stderr)
        sys.exit(130)
