"""The floors of docs/architecture.md, checked: every import points down, none goes
round in a circle, and model/ lifts out with torch alone.

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
