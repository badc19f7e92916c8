"""Shared plumbing for the `python -m attnlab.*` tools: matplotlib without a screen,
and saving a figure. (Their argument parser is engine.cli.Parser, the one every
command line uses.)"""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (writes files; needs no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> Path:
    """Save as PNG (a path without a suffix gets .png) and return the path written."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def figures_folder(source: Path | None = None) -> Path:
    """Where a tool writes its figures when --out is not given: the run's own figures/
    for a checkpoint of a run (runs/ is not tracked), else figures/ in the working
    directory (ignored by git in the repository), never loose files beside the code."""
    folder = Path("figures")
    if source is not None:
        source = Path(source)
        run = source.parent.parent
        if source.parent.name == "checkpoints" and (run / "config.json").is_file():
            folder = run / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
