"""The floors of docs/architecture.md, checked: every import points down, none goes
round in a circle, model/ lifts out with torch alone, and a function reads on one
screen.

    scripts (train.py, sample.py, bench/)
    attnlab/    the study tools
    engine/     the run machinery
    model/  data/   beside each other, neither importing the other
    common/     the ground floor
"""
import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT

FLOORS = {"common": 0, "model": 1, "data": 1, "engine": 2, "attnlab": 3}
PACKAGES = set(FLOORS)


def modules() -> dict[str, Path]:
    """Every project module by dotted name (packages by their __init__)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = path
    return out


def project_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports, at the top or deferred inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from model import flex` runs the package model's __init__ and then
            # model.flex: both are imports (a submodule that imports its own package
            # that way closes a circle through the __init__)
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: project_imports(path, set(mods)) - {name} for name, path in mods.items()}


def floor(module: str) -> tuple[str, int]:
    package = module.split(".")[0]
    return package, FLOORS[package]


def test_every_import_points_down_or_stays_in_its_package():
    upward = []
    for module, imported in graph().items():
        package, level = floor(module)
        for other in imported:
            other_package, other_level = floor(other)
            if other_package != package and other_level >= level:
                upward.append(f"{module} -> {other}")
    assert not upward, "imports that do not point down: " + ", ".join(sorted(upward))


def test_no_module_imports_itself_round_a_circle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1                                        # on the current path
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_scripts_and_tools_import_only_what_exists():
    """train.py and sample.py sit on top; their project imports must resolve."""
    mods = set(modules())
    for script in ("train.py", "sample.py"):
        assert project_imports(ROOT / script, mods) <= mods


def test_model_files_import_the_standard_library_torch_and_model_only():
    for path in sorted((ROOT / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            outside = roots - {"torch", "model", "__future__"} - set(sys.stdlib_module_names)
            assert not outside, f"{path.name} imports {outside}"


def test_the_model_folder_lifts_out_with_torch_alone(tmp_path):
    """Copied on its own into an empty folder, with the project's other packages
    blocked, model/ builds a GPT, trains a step and generates."""
    shutil.copytree(ROOT / "model", tmp_path / "model", ignore=shutil.ignore_patterns("__pycache__"))
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"common", "data", "engine", "attnlab"}:
                    raise ImportError(f"model/ imported {name}")
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, "")                   # -I leaves the current folder off the path
        import torch
        from model import GPT, ModelConfig
        for attention in ("eager", "sdpa", "banded"):
            cfg = ModelConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=16,
                              attention=attention, sliding_window=8)
            model = GPT(cfg)
            x = torch.randint(0, 11, (2, 16))
            model(x, x).loss.backward()
            out = list(model.generate(x[:1, :4], 5, temperature=0))
            assert len(out) == 5
        print("lifted")
    """)
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "lifted" in proc.stdout, proc.stderr[-2000:]


# -- variant names are compared with strings only inside their registries -------------

def variant_fields() -> set[str]:
    """Every config field that names a registry entry (model.attention, model.mlp,
    data.tokenizer, ...), read from the fields' own metadata, so a registry added to
    any section is covered the day it lands."""
    from dataclasses import fields
    from engine.config import SECTIONS
    return {f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata.get("registry")}


def _names_a_field(node, names: set[str]) -> bool:
    """`cfg.mlp`, `mlp`, `saved["mlp"]` or `saved.get("mlp")` for a variant field."""
    if isinstance(node, ast.Attribute):
        return node.attr in names
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in names
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in names
    return False


def _is_text(node) -> bool:
    """A string literal, or a literal tuple, list or set holding one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_text(e) for e in node.elts)
    return False


def string_compares(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of each comparison of a variant field with a string literal: ==, !=,
    in / not in a literal, and match-case on string patterns."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for (left, right), op in zip(zip(sides, sides[1:]), node.ops):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                if (_names_a_field(left, names) and _is_text(right)) or \
                        (_names_a_field(right, names) and _is_text(left)):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and _names_a_field(node.subject, names):
            if any(isinstance(p, ast.MatchValue) and _is_text(p.value)
                   for case in node.cases for p in ast.walk(case.pattern)):
                found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
    return found


def project_sources():
    """Every Python file of the project but the tests (which check names on purpose)."""
    skip = {"tests", "runs", "node_modules", "__pycache__"}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if not skip.intersection(parts) and not any(p.startswith(".") for p in parts):
            yield path


REGISTRY_MODULE = ROOT / "model" / "registry.py"


def test_no_variant_name_is_compared_with_a_string_outside_its_registry():
    """docs/architecture.md: the facts about a variant live on its registry entry, so no
    code outside model/registry.py asks `cfg.readout == "adaptive"`; it asks the entry
    (`READOUTS[cfg.readout].shortlisted`)."""
    names = variant_fields()
    assert {"attention", "position", "mlp", "norm", "block", "readout", "tokenizer"} <= names
    found = [f"{path.relative_to(ROOT)}:{line}: {code}"
             for path in project_sources() if path != REGISTRY_MODULE
             for line, code in string_compares(path.read_text(encoding="utf-8"), names)]
    assert not found, "ask the registry entry instead:\n" + "\n".join(found)


@pytest.mark.parametrize("code,caught", [
    ('if cfg.readout == "adaptive": pass', True),
    ('if "full" != model.config.readout: pass', True),
    ('x = c.mlp in ("gelu", "gelu_tanh")', True),
    ('x = saved["model"]["mlp"] not in {"gelu"}', True),
    ('x = saved.get("attention") == "sdpa"', True),
    ('match cfg.position:\n    case "rope": pass\n    case _: pass', True),
    ('x = READOUTS[cfg.readout].shortlisted', False),
    ('x = READOUTS[cfg.readout] is READOUTS["full"]', False),
    ('x = replace(cfg, readout="full")', False),
    ('x = cfg.n_layer == 2 and args.what == "lens"', False),
])
def test_the_string_compare_check_sees_each_form(code, caught):
    assert bool(string_compares(code, variant_fields())) is caught


# A file is written whole or not at all (common/files.py's atomic writes: a temporary
# file renamed over the target), so a run killed part-way never leaves half a config,
# figure or table behind. The files allowed to write otherwise, each with why:
WRITES_ALLOWED = {
    "common/files.py": "the atomic writes themselves, and the writable-folder probe",
    "engine/checkpoint.py": "writes inside a temporary folder that is renamed whole",
    "engine/tracking.py": "a temporary file renamed over the metrics log",
    "engine/cli.py": "opens os.devnull",
    "data/shards.py": "token shards that an interrupted build resumes from, checked on load",
    "data/build_corpus.py": "a temporary file renamed over the corpus (run without common/)",
}


def partial_writes(code: str) -> list[int]:
    """Lines of `code` that write a file in place: Path.write_text/write_bytes,
    savefig to a path (not to an in-memory buffer named buf) and open(..., "w"/"a"/"x")."""
    lines = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("write_text", "write_bytes"):
            lines.append(node.lineno)
        elif name == "savefig" and not (node.args and getattr(node.args[0], "id", "") == "buf"):
            lines.append(node.lineno)
        elif name == "open":
            # open(path, mode), where a mode that is not a constant may write; or
            # path.open(mode) with a constant mode (other classes' open take other arguments)
            method = isinstance(func, ast.Attribute)
            modes = node.args[0 if method else 1:][:1] + [k.value for k in node.keywords if k.arg == "mode"]
            if any(set(str(m.value)) & set("wax") if isinstance(m, ast.Constant) else not method
                   for m in modes):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("code, caught", [
    ('Path("a").write_text("x")', True),
    ('p.write_bytes(b"")', True),
    ('fig.savefig(path, dpi=1)', True),
    ('fig.savefig(buf, format="png")', False),
    ('open(p, "w", newline="")', True),
    ('open(p, mode="ab")', True),
    ('open(p, "r+b" if t else "wb")', True),
    ('open(p)', False),
    ('open(p, "rb")', False),
    ('Path(p).open("w")', True),
    ('Shards.open(folder, names)', False),
    ('write_text_atomic(p, "x")', False),
])
def test_the_partial_write_check_sees_each_form(code, caught):
    assert bool(partial_writes(code)) == caught


def test_files_are_written_whole():
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    paths += [ROOT / "train.py", ROOT / "sample.py"]
    found = []
    for path in sorted(paths):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in WRITES_ALLOWED:
            found += [f"{rel}:{n}" for n in partial_writes(path.read_text(encoding="utf-8"))]
    assert not found, f"files written in place, not through common/files.py: {found}"


# -- a function on one screen ------------------------------------------------------------
# A function that validates, plans and reports is three functions with names, each read
# on one screen. The ones still longer, by file and dotted name: the list only shrinks
# (one that fits now must leave it, and a new long one is not added).
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED: set[str] = set()
# The exercises' solutions and stubs are written as a learner would write them.
LONG_FUNCTIONS_SKIPPED = ("attnlab/exercises/solutions/", "attnlab/exercises/stubs/")


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Each function longer than `limit` lines (from its def to its last line), by its
    dotted name (`Class.method`, `outer.inner`), with its length."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > limit:
                    found[name] = length
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def project_sources() -> list[Path]:
    """The code under the one-screen rule: the packages and the scripts beside them
    (tests/ and bench/ are outside it)."""
    packages = [p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests", "bench")]
    paths = [p for package in packages for p in package.rglob("*.py")] + list(ROOT.glob("*.py"))
    return sorted(p for p in paths
                  if not p.relative_to(ROOT).as_posix().startswith(LONG_FUNCTIONS_SKIPPED))


@pytest.mark.parametrize("code, found", [
    ("def f():\n" + "    x = 1\n" * 60, {"f": 61}),
    ("def f():\n" + "    x = 1\n" * 59, {}),
    ("class C:\n    async def m(self):\n" + "        x = 1\n" * 60, {"C.m": 61}),
    ("def outer():\n    def inner():\n" + "        x = 1\n" * 60, {"outer": 62, "outer.inner": 61}),
])
def test_the_long_function_check_sees_each_form(code, found):
    assert long_functions(code) == found


def test_every_function_reads_on_one_screen():
    found = {}
    for path in project_sources():
        rel = path.relative_to(ROOT).as_posix()
        for name, length in long_functions(path.read_text(encoding="utf-8")).items():
            found[f"{rel}:{name}"] = length
    new = {name: n for name, n in found.items() if name not in LONG_FUNCTIONS_ALLOWED}
    assert not new, (f"functions over {MAX_FUNCTION_LINES} lines: {new}; split each into "
                     "named pieces, each read on one screen")
    fits = sorted(LONG_FUNCTIONS_ALLOWED - set(found))
    assert not fits, f"now {MAX_FUNCTION_LINES} lines or fewer: remove {fits} from LONG_FUNCTIONS_ALLOWED"


def repeated_keys(source: str) -> list[tuple[int, str]]:
    """Keys written twice in one dict literal: Python keeps the last without a word, so a
    registry entry pasted under a name already taken replaces it silently."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            found += [(node.lineno, repr(k)) for k in sorted({k for k in keys if keys.count(k) > 1}, key=str)]
    return found


@pytest.mark.parametrize("code,caught", [("R = {'mha': 1, 'x': 2, 'mha': 3}", True),
                                         ("R = {'mha': 1, 'x': {'mha': 2}}", False),
                                         ("R = dict(a=1)", False)])
def test_the_repeated_key_check_sees_each_form(code, caught):
    assert bool(repeated_keys(code)) == caught


def test_no_dict_literal_names_a_key_twice():
    found = [f"{path.relative_to(ROOT)}:{line} {key}" for path in project_sources()
             for line, key in repeated_keys(path.read_text())]
    assert not found, found
