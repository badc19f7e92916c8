"""No stale words: what the code, the configs and the docs name is there, and code
comments say why in the code's own terms.

Every repository path named in code, configs and docs (`engine/machine.py`,
`docs/benchmarks.md`, `configs/cpu.toml`) is a file that exists, and every section named
beside a docs page (`docs/benchmarks.md, "GPU"`) a heading of that page. No code comment
or docstring names an issue number or a date, and none in the shipped code or the
presets carries a measured figure (a timing, a rate, a speed-up, a loss against
another): those go to docs/benchmarks.md, and the comment keeps the sentence of why.
A name the config renamed away is not in that field's --help.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from pathlib import Path

from conftest import ROOT

# Files in model/ whose hits are known and cleaned where model/ is rewritten: each entry
# excuses that file's hits of that kind only. The set must shrink to empty; an entry
# whose file no longer has the hit fails below, so it is removed when the file is clean.
KNOWN_MODEL_FILES: set[tuple[str, str]] = set()

# Paths of other projects named as theirs (nanoGPT's preparation script for its
# Shakespeare corpus, which the bundled copy matches).
OTHER_PROJECTS = {"data/shakespeare_char/prepare.py"}
# What the project writes (a bench script's results, the notebook run headless) is named
# before it exists; .gitignore lists it.
OUTPUTS = tuple(line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#") and "*" not in line)

FOLDERS = ("model", "engine", "data", "attnlab", "common", "bench", "tests", "configs", "docs")
SHIPPED = ("model", "engine", "data", "attnlab", "common", "configs")
SCRIPTS = ("train.py", "sample.py")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(FOLDERS) + r")/[\w/.-]*\w\."
                  r"(?:py|md|toml|sh|json|txt|gz|ipynb))(?![\w/-])")
# A placeholder names no file: a stem in capitals (configs/NAME.toml) or one letter
# (bench/x.py).
PLACEHOLDER = re.compile(r"/(?:[A-Z][A-Z_]*|[a-z])\.\w+$")
SECTION = re.compile(r"(docs/[\w-]+\.md)`?\)?,? \"([^\"]+)\"")

ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
FIGURE = re.compile(
    r"\b\d[\d,]*(?:\.\d+)? ?(?:ms|us|µs|ns|tok/s|tokens/s|steps/s|it/s|[GTM]FLOP/s|GB/s)(?![\w/])"   # timings, rates
    r"|\b\d+(?:\.\d+)?x (?:faster|slower)\b|\b\d+\.\d+x\b|\b\d+(?:\.\d+)? times (?:faster|slower)\b"  # speed-ups
    r"|\b\d+\.\d{2,},? (?:against|vs\.?|versus)\b|\b(?:measured|reads?|reached|reaches) \d+\.\d{3,}\b")  # losses


def files(folders, suffixes) -> list[Path]:
    found = [ROOT / name for name in (*SCRIPTS, "README.md") if Path(name).suffix in suffixes]
    for folder in folders:
        found += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in suffixes
                  and p.is_file() and "__pycache__" not in p.parts and "fixtures" not in p.parts]
    return found


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def comments(path: Path):
    """(first line, text) of each comment of a Python or TOML file, the lines of a comment
    that runs over several joined (a figure may wrap), and of each docstring."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        lines = [(n, re.sub(r'"[^"]*"', '""', line)) for n, line in enumerate(text.splitlines(), 1)]
        found = [(n, code[code.index("#"):]) for n, code in lines if "#" in code]
    else:
        found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                 if tok.type == tokenize.COMMENT]
    block: list[str] = []
    for i, (n, comment) in enumerate(found):
        block.append(comment.lstrip("#").strip())
        if i + 1 == len(found) or found[i + 1][0] != n + 1:
            yield n - len(block) + 1, " ".join(block)
            block = []
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and ast.get_docstring(node, clean=False) is not None:
                yield node.body[0].lineno, " ".join(node.body[0].value.value.split())


def word_hits(paths, kinds) -> list[tuple[str, str, str]]:
    """(file:line, kind, the words) for each comment that names what `kinds` forbid."""
    patterns = {"issue": ISSUE, "date": DATE, "figure": FIGURE}
    hits = []
    for path in paths:
        for n, line in comments(path):
            for kind in kinds:
                found = patterns[kind].search(line)
                if found:
                    hits.append((f"{rel(path)}:{n}", kind, found.group(0)))
    return hits


def excused(hits) -> tuple[list, set]:
    """The hits not excused by KNOWN_MODEL_FILES, and the entries that excused any."""
    left, used = [], set()
    for where, kind, words in hits:
        key = (where.split(":")[0], kind)
        if key in KNOWN_MODEL_FILES:
            used.add(key)
        else:
            left.append((where, kind, words))
    return left, used


# --- paths -------------------------------------------------------------------------------------
def named_paths(paths) -> list[tuple[str, str]]:
    """(file:line, path) for each repository path named in these files; in a test, only
    in its comments and docstrings (its strings name files it means to be missing)."""
    found = []
    for path in paths:
        lines = (comments(path) if path.parent.name == "tests" else
                 enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
        for n, line in lines:
            found += [(f"{rel(path)}:{n}", m.group(1)) for m in PATH.finditer(line)]
    return found


def missing(named) -> list[str]:
    return [f"{where}: {name}" for where, name in named
            if not (ROOT / name).exists() and not PLACEHOLDER.search(name) and name not in OTHER_PROJECTS
            and not any(name == out or name.startswith(out + "/") for out in OUTPUTS)]


def test_every_path_named_in_code_configs_and_docs_exists():
    paths = files(FOLDERS, {".py", ".md", ".toml", ".ipynb"}) + [ROOT / ".ci" / "run", ROOT / "pyproject.toml"]
    named = named_paths(paths)
    assert len(named) > 200, "the reader found too few paths to be reading the files"
    gone = missing(named)
    assert not gone, "paths named that do not exist (name the file that is there):\n" + "\n".join(gone)


def test_the_path_reader_tells_a_file_from_a_placeholder_and_a_longer_path(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("See engine/machine.py and `engine/gone.py`; presets are configs/NAME.toml,\n"
                   "scripts bench/x.py; nanoGPT/data/other/prepare.py is theirs (model/cpu_kernels.py).\n"
                   "data/shakespeare/plays.txt.gz, not data/shakespeare/plays.txt; bench/out/x_y.json.\n")
    named = named_paths([doc])
    assert [name for _, name in named] == [
        "engine/machine.py", "engine/gone.py", "configs/NAME.toml", "bench/x.py", "model/cpu_kernels.py",
        "data/shakespeare/plays.txt.gz", "data/shakespeare/plays.txt", "bench/out/x_y.json"]
    assert [line.split(": ")[1] for line in missing(named)] == [
        "engine/gone.py", "model/cpu_kernels.py", "data/shakespeare/plays.txt"]


def _headings(doc: str) -> list[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [line.lstrip("#").strip().replace("`", "") for line in text.splitlines() if line.startswith("#")]


def test_every_section_named_beside_a_docs_page_is_a_heading_of_it():
    """`docs/benchmarks.md, "GPU"` names the section whose heading starts with GPU."""
    paths = files(FOLDERS, {".py", ".md", ".toml"})
    named = [(f"{rel(p)}:{n}", m.group(1), m.group(2)) for p in paths
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             for m in SECTION.finditer(line)]
    assert len(named) > 5
    from engine.machine import CPU_KINDS
    named += [(f"engine/machine.py: CPU_KINDS[{name!r}]", "docs/benchmarks.md", kind.numbers)
              for name, kind in CPU_KINDS.items()]
    gone = [f"{where}: {doc}, {section!r}" for where, doc, section in named
            if (ROOT / doc).exists() and not any(h.startswith(section.replace("`", ""))
                                                  for h in _headings(doc))]
    assert not gone, "sections named that the page does not have:\n" + "\n".join(gone)


# --- comments ----------------------------------------------------------------------------------
def test_no_code_comment_names_an_issue_or_a_date():
    """The code speaks of itself: why, in its own terms, not when or for which ticket."""
    paths = files((*SHIPPED, "bench", "tests"), {".py", ".toml"})
    left, used = excused(word_hits(paths, ("issue", "date")))
    assert not left, "\n".join(f"{w}: {k} {words!r}" for w, k, words in left)
    assert used == {k for k in KNOWN_MODEL_FILES if k[1] in ("issue", "date")}, (
        "model/ files cleaned: remove them from KNOWN_MODEL_FILES")


def test_no_comment_in_the_shipped_code_or_presets_carries_a_measured_figure():
    """Figures go to docs/benchmarks.md with their machine, date and command; the comment
    keeps the sentence of why and names the section. The bench scripts and the tests keep
    theirs: a bench script is where a figure is made, a test's numbers are its inputs."""
    paths = files(SHIPPED, {".py", ".toml"})
    left, used = excused(word_hits(paths, ("figure",)))
    assert not left, "\n".join(f"{w}: {words!r}" for w, k, words in left)
    assert used == {k for k in KNOWN_MODEL_FILES if k[1] == "figure"}, (
        "model/ files cleaned: remove them from KNOWN_MODEL_FILES")


def test_the_comment_reader_finds_each_kind(tmp_path):
    code = tmp_path / "x.py"
    code.write_text('"""Module: as issue 53 asked."""\n'
                    "x = 1  # measured 2026-12-05\n"
                    "def f():\n"
                    '    """Two matmuls,\n    71.9 ms against 76.8 ms."""\n'
                    "    return 'issue 4, 3.4x faster, in a string'  # 4 x 128: a shape\n"
                    "z = 2\n"
                    "# 1,337 tok/s\n"
                    "y = 3\n"
                    "# emulated, some 30 times\n# slower than fp32\n")
    preset = tmp_path / "p.toml"
    preset.write_text('lr = 3e-3   # 1.500 against 1.515 at 0.02\nname = "# 2.5x"\n')
    hits = {(where.rsplit("/", 1)[1], kind) for where, kind, _ in
            word_hits([code, preset], ("issue", "date", "figure"))}
    assert hits == {("x.py:1", "issue"), ("x.py:2", "date"), ("x.py:4", "figure"),
                    ("x.py:8", "figure"), ("x.py:10", "figure"), ("p.toml:1", "figure")}


# --- --help ------------------------------------------------------------------------------------
def test_help_names_no_variant_the_config_renamed_away():
    """A config version that renames a variant (model.attention's `cpu` became `auto`) also
    takes the old name out of the field's --help, unless it is still a valid name."""
    from engine.config import RENAMED_IN, RunConfig, choices_of
    sections = {f.name: type(f.default_factory()) for f in dataclasses.fields(RunConfig)
                if f.default_factory is not dataclasses.MISSING}
    stale, used = [], set()
    for version, renamed in RENAMED_IN.items():
        for section, fields in renamed.items():
            cls = sections[section]
            for name, old_to_new in fields.items():
                f = next(f for f in dataclasses.fields(cls) if f.name == name)
                valid = set(choices_of(f) or ())
                for old in old_to_new:
                    if old not in valid and re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", f.metadata["help"]):
                        where = "model/config.py" if section == "model" else "engine/config.py"
                        if (where, "renamed") in KNOWN_MODEL_FILES:
                            used.add((where, "renamed"))
                        else:
                            stale.append(f"--{section}.{name}: {old!r} (renamed in version {version})")
    assert not stale, "\n".join(stale)
    assert used == {k for k in KNOWN_MODEL_FILES if k[1] == "renamed"}, (
        "model/ files cleaned: remove them from KNOWN_MODEL_FILES")
