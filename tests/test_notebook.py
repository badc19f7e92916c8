"""docs/walkthrough.ipynb runs top to bottom without an error (through nbclient, the
way Jupyter runs it)."""
import importlib.util

import nbformat
from nbclient import NotebookClient

from conftest import ROOT


def test_the_walkthrough_notebook_runs_top_to_bottom():
    nb = nbformat.read(ROOT / "docs" / "walkthrough.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "docs")}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "blend: 6.1" in printed and "exact match on held-out words" in printed
    assert "without the scaling: the scores are too large by exactly √d_k" in printed
    assert "with it: passed" in printed
    assert "fact at depth 100%:" in printed and "recalled (chance 10%)" in printed
    if importlib.util.find_spec("all_minilm_l6_v2"):      # the article's own hands-on result
        assert "6 12 17" in printed and "layer 4, head 2: it → trophy = 0.58" in printed
