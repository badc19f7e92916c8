"""Shared plumbing for the `python -m attnlab.*` tools: matplotlib without a screen,
saving a figure, and an argument parser whose help is the module's docstring."""
from __future__ import annotations

import argparse
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (writes files; needs no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def module_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The first paragraph of `doc` as the description, the rest as the epilogue."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=head, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
