"""The one command-line layer: argparse options generated from the config dataclasses,
used by train.py, sample.py and every `python -m attnlab.<tool>` (whose options naming
a model, --run, --checkpoint and --device, are attnlab/options.py).

Each config field becomes `--section.key VALUE` (bool fields also work as a bare
switch), with the field's help text, its choices and its default in `--help`. Values
arrive as strings and go through engine.config.apply, the same conversion and checks
a preset file gets, so the command line, presets and saved configs cannot disagree.
Every mistake is a ConfigError, printed as one `error:` line with a did-you-mean.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import MISSING, fields

from common.errors import ConfigError, Terminated, choices_hint, closest, friendly_errors
from engine import config
from engine.config import RunConfig
from model import ModelError


# An unknown option is answered with the valid ones when there are at most this many.
LISTED_OPTIONS = 20


class Parser(argparse.ArgumentParser):
    """argparse with the module docstring as help, no abbreviated options, and
    mistakes raised as ConfigError (one `error:` line) instead of a usage dump."""

    def __init__(self, prog: str, doc: str = "", hints: dict[str, str] | None = None, **kw):
        # hints: an option this command does not take but a user may bring from another
        # (train.py's --run), and what to give instead.
        self.hints = hints or {}
        head, _, rest = (doc or "").strip().partition("\n\n")
        super().__init__(prog=prog, description=head, epilog=rest or None, allow_abbrev=False,
                         formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
                             prog, max_help_position=32, width=100), **kw)

    def error(self, message):
        needs = re.match(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if needs:
            raise ConfigError(f"{needs.group(1)} needs a value: {needs.group(1)}=VALUE")
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError(self._explain_unknown(unknown[0]))
        return parsed

    def _explain_unknown(self, arg: str) -> str:
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            return f"unexpected argument {arg!r} (see {self.prog} --help)"
        section, dot, key = name[2:].partition(".")
        if dot and section in config.SECTIONS and self._takes(section):
            valid = config.field_types(config.SECTIONS[section])
            return f"unknown key {section}.{key} on the command line" + choices_hint(key, valid)
        if dot:
            sections = [s for s in config.SECTIONS if self._takes(s)]
            return f"unknown config section {section!r}" + choices_hint(section, sections)
        if name in self.hints:
            return f"unknown option {name}: {self.hints[name]}"
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        if len(options) <= LISTED_OPTIONS:
            return f"unknown option {name}" + choices_hint(name, options)
        # train.py takes some 150 options: listed, they made a line of 2,700 characters.
        close = closest(name, options)
        return (f"unknown option {name}" + (f" (did you mean {close!r}?)" if close else "")
                + f"; see {self.prog} --help for its {len(options)} options")

    def _takes(self, section: str) -> bool:
        return any(a.dest.startswith(section + ".") for a in self._actions)


def add_config_options(parser: Parser, sections=tuple(config.SECTIONS), short: tuple = (),
                       shown: RunConfig | None = None):
    """--section.key for every field of each section; fields of the sections in
    `short` may also be given without their prefix (sample.py's --temperature).
    `shown`: the config whose values --help gives as the defaults (train.py's preset),
    rather than the dataclasses' built-in ones, which no preset trains with."""
    for section in sections:
        cls = config.SECTIONS[section]
        group = parser.add_argument_group(f"[{section}]")
        types = config.field_types(cls)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            if shown is not None:
                default = getattr(getattr(shown, section), f.name)
            choices = config.choices_of(f)
            text = f.metadata.get("help", "")
            if choices:
                text += " {" + ", ".join(choices) + "}"
            names = [f"--{section}.{f.name}"] + ([f"--{f.name}"] if section in short else [])
            extra = {"nargs": "?", "const": "true"} if types[f.name] is bool else {}
            group.add_argument(*names, dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                               metavar="VALUE", help=f"{text} (default: {default!r})".replace("%", "%%"),
                               **extra)


def overrides_of(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The config options given on the command line, as {section: {key: raw value}}."""
    out: dict[str, dict[str, str]] = {}
    for dest, value in vars(args).items():
        section, dot, key = dest.partition(".")
        if dot and section in config.SECTIONS and value is not None:
            out.setdefault(section, {})[key] = value
    return out


def apply_overrides(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    for section, values in overrides_of(args).items():
        config.apply(cfg, section, values, "the command line")
    # With train.init_from the model, and with it what the objective may be, comes from
    # the source: the whole config is checked once it is read (engine/pretrained.adopt_source).
    if not cfg.train.init_from:
        cfg.validate()
    return cfg


def build(preset: str | None, argv: list[str]) -> RunConfig:
    """Defaults, then the preset, then `--section.key=value` options; validated."""
    parser = Parser("python train.py", add_help=False)
    add_config_options(parser)
    args = parser.parse_args(argv)
    cfg = RunConfig()
    if preset is not None:
        config.load_preset(cfg, preset)
    return apply_overrides(cfg, args)


@contextmanager
def errors_as_lines(interrupted: str = "nothing half-written was kept; run the same "
                                         "command again"):
    """Every error a user can cause (the project's and the model's own, and what the
    system refuses: a full disk, a read-only folder, a path that is not there) as one
    `error:` line and exit status 2; Ctrl-C as one line (`interrupted`: what to do next)
    and status 130. ATTNLAB_DEBUG=1 shows the traceback instead."""
    debug = bool(os.environ.get("ATTNLAB_DEBUG"))
    try:
        with friendly_errors(ModelError):
            yield
    except BrokenPipeError:                   # the reader left (| head): nothing to report
        sys.stdout = open(os.devnull, "w")
        sys.exit(0)
    except OSError as err:
        if debug:
            raise
        where = f" ({err.filename})" if err.filename else ""
        print(f"error: {err.strerror or err}{where}; nothing half-written was kept (files are "
              "written whole or not at all): fix that and run the same command again",
              file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as err:
        if debug:
            raise
        # A KeyboardInterrupt of ours carries what to do next (engine.loop.stop_signals).
        print(f"error: interrupted; {err.args[0] if err.args else interrupted}", file=sys.stderr)
        # The shell's 128 + the signal, as a stop in the loop exits (train.py's finished).
        sys.exit(143 if isinstance(err, Terminated) else 130)
