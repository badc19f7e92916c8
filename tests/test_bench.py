"""bench/*.py explain themselves: each --help opens with a whole sentence or more of what
the script measures, and says what every option does."""
import argparse
import importlib.util
import os
import re
import sys

import pytest

from conftest import ROOT

SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "add_argument" in p.read_text())


class Parsing(BaseException):
    """Raised where a script's parser would parse, carrying the parser; a BaseException
    so that no `except Exception` in a main() swallows it."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(path) -> argparse.ArgumentParser:
    """The parser the script's main() builds, caught before it parses anything."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    env, argv, sys_path = dict(os.environ), sys.argv, list(sys.path)
    original = argparse.ArgumentParser.parse_known_args

    def caught(self, args=None, namespace=None):
        raise Parsing(self)

    argparse.ArgumentParser.parse_known_args = caught
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))                  # a script's own folder, as python runs it
    try:
        spec.loader.exec_module(module)                   # not as __main__: main() is not run
        module.main()
    except Parsing as parsing:
        return parsing.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv, sys.path[:] = argv, sys_path
        os.environ.clear()
        os.environ.update(env)
    raise AssertionError(f"{path.name}'s main() returned without parsing its arguments")


def test_there_are_bench_scripts_to_check():
    assert len(SCRIPTS) >= 15 and ROOT / "bench" / "cpu_kinds.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_each_bench_scripts_help_says_what_it_does_and_what_each_option_does(path):
    parser = parser_of(path)
    description = " ".join((parser.description or "").split())
    # A description cut at the docstring's first line ends mid-sentence, often on a comma.
    assert re.search(r"[.?!]\)?$", description), \
        f"{path.name}: its --help description stops mid-sentence: {description!r}"
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and not action.help]
    assert not silent, f"{path.name}: options without help text: {silent}"


def attention_cost():
    path = ROOT / "bench" / "attention_cost.py"
    spec = importlib.util.spec_from_file_location("bench_attention_cost", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_attention_costs_default_is_quick_and_the_full_sweep_is_named():
    """The walkthrough's `python bench/attention_cost.py` ran past 10 minutes (T up to
    16,384) with no word of how long; the long sweep is now --full, its time stated."""
    parser = parser_of(ROOT / "bench" / "attention_cost.py")
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "a minute or two" in helps["--lengths"] and "over 10 minutes" in helps["--full"]
    module = attention_cost()
    assert max(module.QUICK_LENGTHS) <= 2048 and max(module.FULL_LENGTHS) == 16384


def test_attention_cost_writes_each_case_as_it_is_timed(tmp_path, monkeypatch):
    """The results were written only at the end, so a sweep stopped part way left
    `attnlab.figures cost` an empty panel."""
    import json
    module = attention_cost()
    monkeypatch.setattr(module, "OUT_JSON", tmp_path / "attention_cost.json")
    timed = []

    def measure(*args, **kwargs):
        if len(timed) == 3:
            raise KeyboardInterrupt                    # stopped part way
        timed.append(args)
        return 0.001 * len(timed), 0
    monkeypatch.setattr(module, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["attention_cost.py", "--devices", "cpu", "--plot", ""])
    with pytest.raises(KeyboardInterrupt):
        module.main()
    rows = json.loads((tmp_path / "attention_cost.json").read_text())
    assert [r["seconds"] for r in rows] == [0.001, 0.002, 0.003]
    assert list(tmp_path.iterdir()) == [tmp_path / "attention_cost.json"]      # no part file left
