"""docs/walkthrough.ipynb runs top to bottom without an error (through nbclient, the
way Jupyter runs it)."""
import importlib.util
import re

import nbformat
from nbclient import NotebookClient

from conftest import ROOT


def test_the_walkthrough_notebook_runs_top_to_bottom():
    nb = nbformat.read(ROOT / "docs" / "walkthrough.ipynb", as_version=4)
    # Limits for a hang only, far past any load: a kernel slow to start beside other
    # work (the default gives it 60 s) is not a fault of the notebook.
    NotebookClient(nb, timeout=3600, startup_timeout=3600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "docs")}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "blend: 6.1" in printed and "exact match on held-out words" in printed
    assert "without the scaling: the scores are too large by exactly √d_k" in printed
    assert "with it: passed" in printed
    assert "fact at depth 100%:" in printed and "recalled (chance 10%)" in printed
    if importlib.util.find_spec("all_minilm_l6_v2"):      # the article's own hands-on result
        assert "6 12 17" in printed and "layer 3, head 1: it → trophy = 0.58" in printed


def test_the_notebook_counts_layers_and_heads_from_0_as_the_tools_do():
    """README: layers and heads are counted from 0 everywhere, so the article's "layer 4,
    head 2" prints as the CLI prints it, layer 3, head 1. Read without running: a cell
    printing `{layer + 1}` fails here even where the MiniLM wheel is not installed."""
    nb = nbformat.read(ROOT / "docs" / "walkthrough.ipynb", as_version=4)
    shifted = [m.group(0) for c in nb.cells if c.cell_type == "code"
               for m in re.finditer(r"\{\s*\w*(?:layer|head)\w*\s*\+\s*1\s*[}:!]", c.source)]
    assert not shifted, shifted
    said = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "printed from 1" not in said and "prints as layer 3, head 1" in said


def test_the_readme_says_how_to_run_the_notebook_headless():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "[docs/walkthrough.ipynb](docs/walkthrough.ipynb)" in readme
    assert "`jupyter nbconvert --to notebook --execute docs/walkthrough.ipynb`" in readme
