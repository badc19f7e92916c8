"""docs/walkthrough.ipynb runs top to bottom without an error (through nbclient, the
way Jupyter runs it)."""
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
