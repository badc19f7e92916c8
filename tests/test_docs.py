"""The commands in README.md and docs/*.md work as written.

Every fenced shell block (```bash, ```sh, ```shell, ```console, or an unlabelled block
whose lines start with `$ python`) is read, and each `python ...` command in it (also
behind `torchrun`) gets a dry parse: the entry point's own argparse parser parses its
arguments, then the project's `--section.key=value` options are checked against the
config's fields on top of the `--config` preset, as the command would check them before
doing any work. Nothing runs: the parser is caught at the moment it has parsed. A few
commands then run for real at tiny settings. So an option renamed in the code and not in
the docs fails here. Relative links and images in the same files must point at files
and headings that exist.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, registries_kept, run_script

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
# Where one shell command ends and the next begins; commands of other programs than
# python (pip, git, bash) are not checked.
SEPARATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class Command:
    doc: str          # file:line
    text: str         # the command as written
    target: str       # "train.py", "bench/x.py", or a module: "-m attnlab.heads"
    argv: tuple[str, ...]

    def __str__(self):
        return f"{self.doc}: {self.text}"


def shell_blocks(path: Path):
    """(first line number, lines, whether only `$ ` lines are commands) of each fenced
    shell block of a markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, mark, label = fence.group(1), fence.group(2), fence.group(3).lower()
        body, start = [], i + 2
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(mark):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prompted = [line for line in body if line.lstrip().startswith("$ ")]
        if label == "console" or (label == "" and any("$ python" in p for p in prompted)):
            yield start, [line if line.lstrip().startswith("$ ") else "" for line in body], True
        elif label in SHELL:
            yield start, body, False


def commands_of(path: Path) -> list[Command]:
    found = []
    for start, body, prompted in shell_blocks(path):
        n = 0
        while n < len(body):
            line, first = body[n], n
            while line.rstrip().endswith("\\") and n + 1 < len(body):   # continuation
                n += 1
                line = line.rstrip()[:-1] + " " + body[n].strip()
            n += 1
            line = line.strip()
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            where = f"{name}:{start + first}"
            try:
                words = shlex.split(line, comments=True)
            except ValueError as err:
                pytest.fail(f"{where}: cannot read {line!r} as a shell command ({err})")
            piece: list[str] = []
            for word in [*words, ";"]:
                if word in SEPARATORS:
                    command = python_command(where, line, piece)
                    if command:
                        found.append(command)
                    piece = []
                else:
                    piece.append(word)
    return found


def python_command(where: str, text: str, words: list[str]) -> Command | None:
    """The python entry point and its arguments in one shell command, if it has one."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):          # VAR=value python ...
        words = words[1:]
    if words and words[0] == "torchrun":                       # torchrun [its options] x.py ...
        script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if script is None:
            pytest.fail(f"{where}: torchrun without a script: {text}")
        return Command(where, text, words[script], tuple(words[script + 1:]))
    if not words or not re.fullmatch(r"python3?", words[0]):
        return None
    if len(words) < 2 or words[1] == "-c":
        return None
    if words[1] == "-m":
        return Command(where, text, "-m " + words[2], tuple(words[3:]))
    return Command(where, text, words[1], tuple(words[2:]))


ALL = [c for doc in DOCS for c in commands_of(doc)]


class Parsed(BaseException):
    """Raised by the first top-level parse of an entry point, carrying what it parsed;
    a BaseException so that no `except Exception` in a main() can swallow it."""

    def __init__(self, parser, namespace, extras):
        super().__init__()
        self.parser, self.namespace, self.extras = parser, namespace, extras


@contextlib.contextmanager
def caught_at_parse():
    """argparse stops the entry point as soon as its top-level parser has parsed (a
    subcommand's parser runs inside it and goes on as usual)."""
    original = argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            namespace, extras = original(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise Parsed(self, namespace, extras)
        return namespace, extras

    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


_modules: dict[str, object] = {}


def entry_point(target: str):
    """The module a command runs: `-m pkg.mod` (a package's __main__), or a script path."""
    if target not in _modules:
        if target.startswith("-m "):
            name = target[3:]
            spec = importlib.util.find_spec(name)
            assert spec is not None, f"no module {name}"
            if spec.submodule_search_locations:                  # a package: its __main__
                name += ".__main__"
            _modules[target] = importlib.import_module(name)
        elif target.startswith("data/"):                        # python data/prepare.py
            _modules[target] = importlib.import_module("data." + Path(target).stem)
        else:                                                    # train.py, bench/x.py
            path = ROOT / target
            assert path.is_file(), f"no script {target}"
            spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            env, sys_path = dict(os.environ), list(sys.path)
            sys.path.insert(0, str(path.parent))     # the script's own folder, as python runs it
            try:
                spec.loader.exec_module(module)      # not as __main__: main() is not run
            finally:
                sys.path[:] = sys_path
                os.environ.clear()
                os.environ.update(env)               # whatever importing train.py set
            _modules[target] = module
    return _modules[target]


def dry_parse(command: Command) -> argparse.Namespace:
    """Parse the command's arguments with its entry point's own parser, then check its
    config options as the command does before any work; raise AssertionError with the
    reason when they would be refused."""
    with registries_kept():
        return _dry_parse(command)


def _dry_parse(command: Command) -> argparse.Namespace:
    module = entry_point(command.target)
    main = getattr(module, "main", None)
    assert callable(main), f"{command.target} has no main()"
    source = inspect.getsource(module)
    if "parse_args" not in source and "parse_known_args" not in source:
        assert not command.argv, f"{command.target} takes no options, given {command.argv}"
        return argparse.Namespace()
    takes_argv = bool(inspect.signature(main).parameters)
    saved_argv, err = sys.argv, io.StringIO()
    sys.argv = [command.target, *command.argv]
    try:
        with caught_at_parse(), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            main(list(command.argv)) if takes_argv else main()
    except Parsed as parsed:
        if parsed.extras:
            explain = getattr(parsed.parser, "_explain_unknown", None)
            raise AssertionError(explain(parsed.extras[0]) if explain
                                 else f"unrecognized arguments: {parsed.extras}") from None
        namespace = parsed.namespace
    except SystemExit as exit_:
        if exit_.code == 0 and {"-h", "--help"} & set(command.argv):
            return argparse.Namespace()
        raise AssertionError(f"refused (exit {exit_.code}): {err.getvalue().strip()}") from None
    except Exception as error:                              # the project's ConfigError, ...
        raise AssertionError(f"refused: {error}") from None
    else:
        raise AssertionError(f"{command.target}'s main() returned without parsing its "
                             "arguments through argparse: it cannot be checked dry")
    finally:
        sys.argv = saved_argv
    try:
        check_config(namespace)
    except Exception as error:                              # ConfigError, ModelError
        raise AssertionError(f"refused: {error}") from None
    return namespace


def check_config(ns: argparse.Namespace) -> None:
    """`--config NAME` against configs/, `--section.key=value` against the config's
    fields, types, choices and cross-field rules, `--budget` as a duration."""
    from engine import config
    from engine.cli import apply_overrides, overrides_of
    if getattr(ns, "budget", None):
        from engine.budget import parse_duration
        parse_duration(ns.budget)
    if not overrides_of(ns) and not hasattr(ns, "preset"):
        return
    cfg = config.RunConfig()
    config.load_preset(cfg, getattr(ns, "preset", None) or "cpu")   # train.py's CPU default
    apply_overrides(cfg, ns)


def test_the_reader_finds_commands_in_every_kind_of_block(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "```bash\n"
        "# a comment\n"
        "python train.py --config tiny \\\n    --train.max_iters=5   # trailing comment\n"
        "OMP_NUM_THREADS=1 python -m attnlab.heads grid --text \"a b\" && python sample.py\n"
        "torchrun --standalone --nproc_per_node=2 train.py --config gpu\n"
        "pip install x; python -c 'print(1)'\n"
        "```\n"
        "```console\n$ python bench/streaming.py --run r\noutput line python train.py --nope\n```\n"
        "```\n$ python -m data.prepare a.txt --out b\n```\n"
        "```text\npython train.py --not-a-command\n```\n"
        "```python\nimport train\n```\n", encoding="utf-8")
    found = [(c.target, c.argv) for c in commands_of(doc)]
    assert found == [
        ("train.py", ("--config", "tiny", "--train.max_iters=5")),
        ("-m attnlab.heads", ("grid", "--text", "a b")),
        ("sample.py", ()),
        ("train.py", ("--config", "gpu")),
        ("bench/streaming.py", ("--run", "r")),
        ("-m data.prepare", ("a.txt", "--out", "b")),
    ]


def test_the_docs_have_commands_to_check():
    """A reader that found nothing would pass every check below."""
    targets = {c.target for c in ALL}
    assert len(ALL) >= 60, [str(c) for c in ALL]
    for expected in ("train.py", "sample.py", "-m data.prepare", "-m attnlab.heads",
                     "-m attnlab.exercises", "-m attnlab.export", "-m attnlab.recall"):
        assert expected in targets, f"no {expected} command found in the docs"
    readme = [c for c in ALL if c.doc.startswith("README.md")]
    assert any(c.text == "python -m pytest -q" for c in readme), \
        "the README's test command (what .ci/run runs) is gone"


# pip and pytest are not the project's entry points; test files named are checked below.
OTHERS = {"-m pip", "-m pytest"}


@pytest.mark.parametrize("command", [c for c in ALL if c.target not in OTHERS],
                         ids=lambda c: c.doc)
def test_each_documented_command_parses(command):
    try:
        dry_parse(command)
        failure = None
    except AssertionError as err:
        failure = f"{command}\n  {err}"
    if failure:
        pytest.fail(failure, pytrace=False)


def test_documented_test_files_exist():
    for command in ALL:
        if command.target == "-m pytest":
            # The words after the options that take one (-p no:xdist, -n 2) are not files.
            values = {i + 1 for i, arg in enumerate(command.argv) if arg in ("-p", "-n", "-k", "-m")}
            for i, arg in enumerate(command.argv):
                if not arg.startswith("-") and i not in values:
                    assert (ROOT / arg.split("::")[0]).exists(), f"{command}: no {arg}"


def test_a_renamed_option_is_caught():
    """The check bites: an option that does not exist, or a config key or value that is
    wrong, is refused in the dry parse."""
    for text in ("python sample.py --max_tokens 30", "python train.py --model.positoin=rope",
                 "python train.py --model.position=ropey", "python train.py --config cpu-slow",
                 "python -m attnlab.heads grid --txt hello", "python -m data.prepare a.txt",
                 "python train.py --budget soon"):
        words = shlex.split(text)
        command = python_command("test", text, words)
        with pytest.raises(AssertionError):
            dry_parse(command)


def test_the_speedrun_command_names_the_corpus_its_ratio_is_measured_on():
    """The README's ratio to nanoGPT's time is measured on tiny Shakespeare (the file
    bench/cpu_speedrun.py trains on); the preset alone reads the bundled plays, where it
    gets to 1.886 only at its last step. So each speedrun command the README, training.md
    and the preset's own comment show names that file."""
    DEFAULT_CORPUS = entry_point("bench/cpu_recipe.py").DEFAULT_CORPUS
    shown = [(c.doc, c.text) for c in ALL if c.target == "train.py" and "speedrun-cpu" in
             " ".join(c.argv).replace("=", " ").split()]
    assert {"README.md", "docs/training.md"} <= {doc.split(":")[0] for doc, _ in shown}, shown
    preset = ROOT / "configs" / "speedrun-cpu.toml"
    comments = [line.lstrip("# ").strip() for line in preset.read_text().splitlines()
                if line.startswith("#") and "python train.py" in line]
    assert comments, f"{preset} no longer shows its command"
    for doc, text in shown + [("configs/speedrun-cpu.toml", c) for c in comments]:
        paths = [w.split("=", 1)[1] for w in shlex.split(text) if w.startswith("--data.path=")]
        assert paths and (ROOT / paths[0]).resolve() == DEFAULT_CORPUS.resolve(), \
            f"{doc}: {text!r} does not train on {DEFAULT_CORPUS.name}, the ratio's corpus"


def heading_anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_files_and_headings_that_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):                          # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.relative_to(ROOT)}: link to a missing {target}"
        if anchor and path.suffix == ".md":
            assert anchor in heading_anchors(path), \
                f"{doc.relative_to(ROOT)}: no heading #{anchor} in {path.relative_to(ROOT)}"


def find(text: str) -> Command:
    """A command as the docs write it (so a real run below follows the docs' own words)."""
    for command in ALL:
        if command.text.split(" #")[0].strip() == text:
            return command
    raise AssertionError(f"the docs no longer show {text!r}; update the real runs here")


def test_a_few_commands_run_for_real_at_tiny_settings(corpus, tmp_path):
    """Train with a documented variant at the tiny preset, then sample and draw the heads
    of that run, each as the docs write it plus tiny settings."""
    train = find("python train.py --model.position=alibi --model.n_kv_head=2")
    run_script(ROOT / "train.py", *train.argv, "--config", "tiny", f"--data.path={corpus}",
               f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={tmp_path / 'runs'}",
               "--train.run_name=docs", "--train.max_iters=4", "--train.eval_interval=4",
               cwd=tmp_path)
    run = tmp_path / "runs" / "docs"
    sample = find("python sample.py --temperature 0")
    out = run_script(ROOT / "sample.py", *sample.argv, "--run", run, "--max_new_tokens", "10",
                     cwd=tmp_path)
    assert len(out.stdout) >= 10 and "alibi positions" in out.stderr
    heads = find('python -m attnlab.heads grid   --text "ROMEO. What light is this"')
    run_script("-m", "attnlab.heads", *heads.argv, "--run", run, "--out", tmp_path / "grid.png",
               cwd=tmp_path)
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_the_benchmarks_page_stays_a_table_of_figures():
    """Per comparison a short dated table; how a figure was reached is git history. At
    19,983 words it had become a lab notebook, half of all the docs."""
    words = len((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert words <= 4000, f"docs/benchmarks.md has {words} words; keep it at most 4,000"


def test_every_registered_mechanism_has_its_paragraph_after_the_article():
    """docs/architecture.md asks a new mechanism for a paragraph in after_the_article.md
    (what it changes in the formula, saves and loses): each entry is named there, as code
    (`name`, `mechanism=name`) or in bold as the page introduces one."""
    from model.mechanisms import MECHANISMS
    page = (ROOT / "docs" / "after_the_article.md").read_text(encoding="utf-8")
    missing = [name for name in MECHANISMS
               if not re.search(rf"`{name}`|\*\*{name}\*\*|mechanisms?[= ]{name}(?![\w,])", page)]
    assert not missing, f"docs/after_the_article.md names no paragraph for {missing}"
