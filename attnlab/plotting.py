"""Shared plumbing for the `python -m attnlab.*` tools: matplotlib without a screen,
where a figure goes, and saving it. (Their argument parser is engine.cli.Parser, the
one every command line uses; the options naming a model are attnlab.options.)"""
from __future__ import annotations

import io
import os
from pathlib import Path

from common.errors import AttnlabError
from common.files import write_bytes_atomic


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
    if fig.get_layout_engine() is None:  # a figure with a shared colour scale lays itself out
        fig.tight_layout()
    make_folder_for(path)
    buf = io.BytesIO()                   # drawn whole first, so a killed run leaves the old file
    try:
        fig.savefig(buf, dpi=dpi, format=path.suffix[1:].lower())
    finally:
        pyplot().close(fig)
    write_bytes_atomic(path, buf.getvalue())
    return path


def make_folder_for(path: Path) -> None:
    """Make the folders a figure or page goes into, refusing a path that runs through a
    file (mkdir's own words would name only the file)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        refuse_a_path_through_a_file(str(path))
        raise


def refuse_a_path_through_a_file(given: str) -> None:
    """Refuse an --out one of whose folders is a file (README.md/x.png)."""
    file = next((p for p in Path(given).parents if p.exists() and not p.is_dir()), None)
    if file is not None:
        kind = "a file" if file.is_file() else "a device or a pipe"
        raise AttnlabError(f"--out {given}: {file} is {kind}, not a folder; give a path "
                           "in a folder")


def figures_folder(source: Path | None = None) -> Path:
    """Where a tool writes its figures when --out is not given: the run's own figures/
    for a checkpoint of a run (runs/ is not tracked), else figures/ in the working
    directory (ignored by git in the repository), never loose files beside the code. The
    folder is made when the first figure is written into it, so a tool that refuses its
    input leaves none behind."""
    folder = Path("figures")
    if source is not None:
        source = Path(source)
        run = source.parent.parent
        if source.parent.name == "checkpoints" and (run / "config.json").is_file():
            folder = own_folder(run, "figures")
    return folder


def own_folder(run: Path, name: str) -> Path:
    """`run/name`, a folder a tool writes into by default, refused where it is a symbolic
    link: a run someone shares could point it anywhere, and what a tool writes into a
    run stays inside the run's folder (as engine/rundir.py holds the run's own files)."""
    folder = Path(run) / name
    if folder.is_symlink():
        raise AttnlabError(f"{folder} is a symbolic link, and a tool writes into a run only "
                           "inside the run's own folder; replace the link with a folder (or "
                           "remove it), or give --out a path of your own")
    return folder


def out_path(given: str | None, default: str) -> Path:
    """--out as given where it names a file (it has a suffix: x.png, view.html); inside it
    where it is a folder, ends in a slash or has no suffix (a folder to be made: the help
    says "a PNG path or a folder", and figs is no PNG's name); the default name when empty."""
    if not given:
        return Path(default)
    folder = Path(given).is_dir() or given.endswith(("/", os.sep)) or not Path(given).suffix
    return Path(given) / default if folder else Path(given)


def default_out(source: Path | None = None) -> str:
    """--out's value when none is given: figures_folder(source), as a folder to be made."""
    return f"{figures_folder(source)}{os.sep}"


def check_figure_out(given: str | None) -> None:
    """Refuse, before any work, an --out whose suffix matplotlib cannot write, or that
    runs through a file (None: not given)."""
    given = given or ""
    refuse_a_path_through_a_file(given or ".")
    if given and Path(given).exists() and not (Path(given).is_file() or Path(given).is_dir()):
        # /dev/null became /dev/null.png: a figure needs a file of its own.
        raise AttnlabError(f"--out {given} is neither a file nor a folder (a device or a "
                           "pipe); give a path for the figure, or leave --out out")
    suffix = Path(given).suffix.lower().lstrip(".")
    if not given or not suffix or Path(given).is_dir():
        return                            # a folder or a bare name: nothing to ask matplotlib
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise AttnlabError(f"--out {given}: a figure cannot be saved as .{suffix}; use .png "
                           f"(or {', '.join('.' + f for f in sorted(formats) if f != 'png')})")


# One numbering for layers and heads in every option, printout and figure: from 0, as
# --layer/--head take them and as model.blocks[i] is indexed (the article counts from 1).
NUMBERING = "layers and heads counted from 0, as --layer/--head take them"
WEIGHT = "attention weight (each row sums to 1)"    # a softmax's; capture.weight_label
                                                    # says where a mechanism's do not
MAX_LABELS = 40                 # more tick labels than this overlap: every k-th is shown


def layer_head(layer: int, head: int) -> str:
    """How every title and printout names one head."""
    return f"layer {layer}, head {head}"


def shown(tokens) -> list[str]:
    """Tokens as tick labels: a newline, a tab and a lone space made visible."""
    return [{" ": "␣"}.get(t, t.replace("\n", "\\n").replace("\t", "\\t")) for t in tokens]


def label_tokens(ax, keys, queries=None, fontsize=7) -> None:
    """Each key's token under its column and each query's beside its row (every k-th of
    a long text, so the labels stay readable); `queries` defaults to the keys."""
    queries = keys if queries is None else queries
    upright = 90 if max(map(len, shown(keys)), default=0) > 2 else 0     # long ones turned
    for names, ticks, rotation in ((shown(keys), ax.set_xticks, upright),
                                   (shown(queries), ax.set_yticks, 0)):
        step = -(-len(names) // MAX_LABELS)
        at = range(0, len(names), step)
        ticks(list(at), [names[i] for i in at], rotation=rotation, fontsize=fontsize)


def draw_weights(ax, weights, title: str = "", keys=None, queries=None, signed: bool = False):
    """One attention map on a fixed 0-1 scale (so panels compare), or -1 to 1 on a
    diverging one where weights can go below 0 (`signed`: 0 is white, neither side
    louder); its tokens on the axes where given; returns the image, for weight_scale."""
    if hasattr(weights, "detach"):         # a tensor: matplotlib wants an array
        weights = weights.detach().float().cpu().numpy()
    scale = dict(cmap="RdBu_r", vmin=-1, vmax=1) if signed else dict(cmap="viridis", vmin=0, vmax=1)
    image = ax.imshow(weights, **scale)
    if title:
        ax.set_title(title, fontsize=8)
    if keys is not None:
        label_tokens(ax, keys, queries)
    return image


def weight_scale(fig, image, axes, label: str = WEIGHT) -> None:
    """The colour scale beside the maps drawn with draw_weights (one for all of them)."""
    fig.colorbar(image, ax=axes, label=label, shrink=0.8)


def save_layer_map(path, values, xlabels, title, *, xlabel: str, scale: str, ylabel="layer",
                   cmap="RdBu_r", center=True):
    """A (layers, columns) table of values as a heatmap, centred on 0 unless told not;
    both axes and the colour bar say what they hold, and a long title wraps."""
    import textwrap
    plt = pyplot()
    width = max(4, 0.45 * values.shape[1] + 2)
    fig, ax = plt.subplots(figsize=(width, max(2.5, 0.5 * values.shape[0] + 1.5)))
    lim = float(values.abs().max()) or 1.0
    shown_values = values.detach().float().cpu().numpy() if hasattr(values, "detach") else values
    image = ax.imshow(shown_values, cmap=cmap, aspect="auto",
                      **({"vmin": -lim, "vmax": lim} if center else {}))
    label_tokens(ax, xlabels, [str(i) for i in range(values.shape[0])], fontsize=8)
    ax.set_ylabel(f"{ylabel} (from 0)")
    ax.set_xlabel(xlabel)
    ax.set_title(textwrap.fill(title, int(width * 9)), fontsize=10)
    fig.colorbar(image, ax=ax, label=scale)
    return save_figure(fig, path)
