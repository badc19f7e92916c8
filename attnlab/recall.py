"""Retrieval by depth and length: can the model find a fact it was given N tokens ago?

    python -m attnlab.recall --out runs/recall                     # train every variant, test
    python -m attnlab.recall --variants rope alibi --steps 400 --out runs/recall-quick
    python -m attnlab.recall --model runs/NAME --out runs/recall-NAME    # a trained model
    python -m attnlab.recall --model path/to/gpt2-folder --context 256   # a transformers folder

Validation loss says how well a model predicts the next token on average; it does not
say whether a fact from far back can still be used. This lab asks that directly with
the task in attnlab/recall_task.py: "The code for K is V." at a depth of the text, and
at the end " The code for K is", whose next tokens must be V (chance: 10^-digits).

Each variant is a small model trained on the CPU for a few hundred steps at context T,
with loss on the answer only, then tested on a grid: depth 0-100% x length 1x-8x T.
RoPE models are also tested under position interpolation, NTK and YaRN (rope_factor =
the length factor; model/positions.py). Learned positions have no vectors past T:
those cells are n/a. The windowed variants (windowWxL) learn a short form of the task,
" K is V." in lower-case letters, trained on facts their stack of windows can reach,
L·(W-1)+1 tokens back, the nearest first; the +global ones keep the fact's tokens, set
at the start of the text in half the examples, visible to every query. With `--model`,
nothing is trained: the grid is run on that model, with the task encoded by its own
tokenizer.

Writes into --out: a heatmap per variant (recall_<variant>.png), all of them in one
figure (recall_heatmaps.png), accuracy against distance for the windowed variants
(recall_distance.png), and the tables (recall.md: by depth and length, and for the
windows by distance: within W, to the reach, beyond; recall.csv: every example, with
the trained context and the answer's digits). An --out folder used before keeps the
rows of the variants not run again: only the variants run now replace their rows, so
the lab can be run a few variants at a time into one folder; with --resume, the variants
it already holds with the same options are kept, so a stopped run goes on where it
stopped. In the tables and
figures, "n/a" is a cell the model cannot reach (learned positions stop there) and
"-" one that was never run.
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import sys
import textwrap
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from attnlab.options import add_run_options, load, out_option, whole
from attnlab.plotting import pyplot, save_figure
from attnlab.recall_task import TokenTask, char_task, filler_text
from common.errors import AttnlabError
from common.files import removed_if_left_empty, writable_folder, write_text_atomic
from engine.cli import Parser, errors_as_lines


@dataclass
class Variant:
    """A model to train for the lab: model fields over the lab's small base model, and
    how its training examples are drawn."""
    about: str
    model: dict = field(default_factory=dict)
    short: bool = False           # the short task (char_task(short=True)): fits a small window
    within_reach: bool = False    # train only on facts a window stack can reach, L·(W-1)+1 back
    ramp: float = 0.0             # share of the steps over which the farthest fact moves from
                                  # right before the question out to its limit (0: no ramp)
    fact_first: float = 0.0       # share of training examples with the fact at depth 0
    global_fact: bool = False     # the first tokens, as many as the fact, are global


def windowed(w: int, layers: int, **more) -> Variant:
    # Trained where the stack reaches, the nearest facts first: facts beyond the reach
    # cannot be learned by any weights, and relaying a fact through the layers is found
    # (if at all) only once fetching it from inside one window has been.
    return Variant(f"RoPE, window {w} over {layers} layer{'s' * (layers > 1)}", {"sliding_window": w, "n_layer": layers},
                   short=True, within_reach=True, ramp=0.3, **more)


VARIANTS = {
    "none": Variant("no positions, full attention", {"position": "none"}),
    "sinusoidal": Variant("sinusoidal positions, full attention", {"position": "sinusoidal"}),
    "learned": Variant("learned positions, full attention", {"position": "learned"}),
    "rope": Variant("RoPE, full attention", {"position": "rope"}),
    "alibi": Variant("ALiBi, full attention", {"position": "alibi"}),
    **{f"window{w}x{n}": windowed(w, n) for w, n in [(16, 1), (8, 2), (8, 3), (8, 4), (16, 2), (4, 4)]},
    "window8x2+global": replace(windowed(8, 2, fact_first=0.5, global_fact=True),
                                about="RoPE, window 8 over 2 layers, the fact's tokens global"),
    "window8x2+global+nope": replace(
        windowed(8, 2, fact_first=0.5, global_fact=True), model={
            "sliding_window": 8, "n_layer": 2, "position": "none"},
        about="no positions, window 8 over 2 layers, the fact's tokens global"),
}
BASE = dict(n_layer=2, n_head=4, n_embd=64, mlp="gelu", position="rope")
COLUMNS = ["variant", "factor", "length", "depth", "distance", "correct", "window", "layers",
           "global", "about", "context", "digits", "steps"]


def train_variant(task: TokenTask, variant: Variant, context: int, steps: int, batch: int = 32,
                  lr: float = 3e-3, seed: int = 0, log=print):
    """A small model trained on the task with the project's optimizer and schedule."""
    from engine.config import TrainConfig
    from engine.loop import lr_at
    from engine.optim import configure_optimizer
    from model import GPT, ModelConfig
    torch.manual_seed(seed)
    extra = {"n_global": task.nearest()} if variant.global_fact else {}
    cfg = ModelConfig(**{**BASE, **variant.model, **extra, "vocab_size": task.tokenizer.vocab_size,
                         "block_size": context})
    farthest = 1.0                        # the share of the filler a fact may be set back
    if variant.within_reach:
        filler = task.example(context, 0.0, torch.Generator()).filler
        far = reach(cfg.sliding_window, cfg.n_layer)
        farthest = min(1.0, max(0.0, (far - task.nearest()) / filler))
    model = GPT(cfg)
    t = TrainConfig(lr=lr, min_lr=lr / 10, max_iters=steps, warmup_iters=min(50, steps // 5),
                    weight_decay=0.0)
    opt = configure_optimizer(model, t, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(seed + 1)
    started = time.perf_counter()
    for step in range(steps):
        opt.set_lr(lr_at(step, t) / t.lr)
        first = float(torch.rand((), generator=g)) < variant.fact_first
        grown = min(1.0, (step + 1) / (variant.ramp * steps)) if variant.ramp else 1.0
        x, y = task.batch(batch, context, g, depth=0.0 if first else None, reach=farthest * grown)
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(scaler)
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:>4}: answer loss {loss.item():.3f} "
                f"(guessing the digits: {math.log(10):.2f})")
    log(f"  trained in {time.perf_counter() - started:.0f} s")
    return model.eval()


@torch.no_grad()
def grid(model, task: TokenTask, context: int, factors, depths, n: int, seed: int = 0):
    """One row per example: factor, depth, the distance from the fact's answer to the
    question's, and whether every answer token was the model's top choice."""
    rows = []
    device = next(model.parameters()).device
    for f in factors:
        length = f * context
        for depth in depths:
            g = torch.Generator().manual_seed(seed + 1000 * f + round(100 * depth))
            examples = [task.example(length, depth, g) for _ in range(n)]
            x = torch.stack([e.ids for e in examples]).to(device)
            logits = model(x).logits
            for i, e in enumerate(examples):
                guess = logits[i, e.answer_at].argmax(-1).cpu()
                distance = task.distance(e)
                rows.append({"factor": f, "length": length, "depth": depth,
                             "distance": distance, "correct": bool((guess == e.answer).all())})
    return rows


def schemes(cfg, factor: int):
    """(label, model config) pairs to test at this factor: as trained, and for a RoPE
    model each scaling, unless a window keeps every distance short (global tokens do not:
    the distance to them grows with the text)."""
    from attnlab.extrapolate import schemes as scaled
    if cfg.sliding_window and not cfg.n_global:
        yield "as trained", cfg
        return
    for label, mcfg in scaled(cfg, factor):
        yield ("as trained" if mcfg is cfg else label), mcfg


def evaluate(name: str, model, task: TokenTask, context: int, factors, depths, n: int, log=print):
    """Grid rows for the model and each of its scalings, labelled `name` / `scheme`."""
    from model import GPT
    from model.positions import POSITION_ENCODINGS
    cfg = model.config
    rows = []
    for f in factors:
        for scheme, mcfg in schemes(cfg, f):
            label = name if scheme == "as trained" else f"{name} + {scheme.split('+ ')[-1]}"
            if POSITION_ENCODINGS[mcfg.position].has_length_limit and f * context > cfg.block_size:
                rows += [{"variant": label, "factor": f, "length": f * context, "depth": d,
                          "distance": None, "correct": None} for d in depths]
                log(f"  {label:<22} {f}x ({f * context:>5} tokens): n/a, {mcfg.position} positions "
                    f"stop at {cfg.block_size}")
                continue
            m = model
            if mcfg is not cfg:
                m = GPT(mcfg).to(next(model.parameters()).device).eval()
                m.load_state_dict(model.state_dict())
            found = grid(m, task, context, [f], depths, n)
            rows += [{"variant": label, **r} for r in found]
            acc = sum(r["correct"] for r in found) / len(found)
            log(f"  {label:<22} {f}x ({f * context:>5} tokens): accuracy {acc:6.1%}")
    return rows


def cells(rows, variant: str, factors, depths):
    """(depths, factors) accuracies of one variant; NaN where not applicable, and
    NOT_RUN where the variant has no rows at all (a merge of runs on other grids)."""
    acc = torch.full((len(depths), len(factors)), NOT_RUN)
    for r in rows:
        if r["variant"] == variant and r["factor"] in factors and r["depth"] in depths:
            i, j = depths.index(r["depth"]), factors.index(r["factor"])
            if r["correct"] is None:
                acc[i, j] = float("nan") if acc[i, j] == NOT_RUN else acc[i, j]
    for i, d in enumerate(depths):
        for j, f in enumerate(factors):
            hit = [r["correct"] for r in rows if r["variant"] == variant
                   and r["factor"] == f and r["depth"] == d and r["correct"] is not None]
            if hit:
                acc[i, j] = sum(hit) / len(hit)
    return acc


NOT_RUN = -1.0        # a cell no run measured, told apart from n/a (out of the model's reach)


def cell_text(values) -> str:
    """A table cell: the mean of the measured values, n/a when none could be, - when
    none was run."""
    measured = values[values >= 0]
    if len(measured):
        return f"{measured.mean():.0%}"
    return "n/a" if values.isnan().any() else "-"


def heatmap(ax, acc, factors, depths, context: int, title: str, chance: float):
    plt = pyplot()
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey", under="white")
    image = ax.imshow(acc.numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(factors)), [f"{f}x\n{f * context}" for f in factors], fontsize=7)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            v = acc[i, j].item()
            text = "n/a" if math.isnan(v) else "-" if v == NOT_RUN else f"{100 * v:.0f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=6,
                    color="black" if math.isnan(v) or v == NOT_RUN or v > 0.5 else "white")
    ax.set_title("\n".join(textwrap.wrap(title, 40)), fontsize=8)
    ax.set_xlabel("length (x trained context, tokens)", fontsize=7)
    ax.set_ylabel("depth of the fact", fontsize=7)
    return image


def colorbar(fig, image, cax, chance: float):
    bar = fig.colorbar(image, cax=cax)
    bar.ax.axhline(chance, color="red", linewidth=2)
    bar.ax.text(1.6, chance, f" chance {chance:.0%}", color="red", fontsize=7, va="center",
                transform=bar.ax.get_yaxis_transform())
    bar.set_label("accuracy (whole answer right)", fontsize=7)


def write(rows, variants: list[str], factors, depths, context: int, chance: float, out: Path,
          about: dict[str, str]):
    out.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: the csv may hold earlier runs' rows, which a crash must not lose.
    text = io.StringIO()
    w = csv.DictWriter(text, COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(out / "recall.csv", text.getvalue())
    lines = [f"Accuracy (whole answer right) by depth, averaged over depths 0-100%; chance "
             f"{chance:.0%}; trained context {context} tokens.", "",
             "| variant | " + " | ".join(f"{f}x" for f in factors) + " |",
             "|---|" + "---|" * len(factors)]
    maps = {}
    for v in variants:
        acc = cells(rows, v, factors, depths)
        maps[v] = acc
        lines.append(f"| {v} | " + " | ".join(cell_text(acc[:, j]) for j in range(len(factors))) + " |")
    write_text_atomic(out / "recall.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    written = []
    for v, acc in maps.items():
        fig, (ax, cax) = plt.subplots(1, 2, figsize=(4.2, 4.2), width_ratios=[1, 0.06])
        colorbar(fig, heatmap(ax, acc, factors, depths, context, about.get(v, v), chance), cax, chance)
        written.append(save_figure(fig, out / f"recall_{v.replace(' ', '').replace('+', '_')}.png"))
    cols = min(4, len(maps))
    nrows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(nrows, cols + 1, figsize=(3.3 * cols + 0.8, 3.8 * nrows), squeeze=False,
                             width_ratios=[1] * cols + [0.06])
    panels = [ax for row in axes for ax in row[:-1]]
    for ax, (v, acc) in zip(panels, maps.items()):
        image = heatmap(ax, acc, factors, depths, context, about.get(v, v), chance)
    for ax in panels[len(maps):] + [row[-1] for row in axes[1:]]:
        ax.axis("off")
    fig.suptitle(f"Recall of a fact by depth and length (trained at {context} tokens)", fontsize=10)
    colorbar(fig, image, axes[0, -1], chance)
    written.append(save_figure(fig, out / "recall_heatmaps.png"))
    return written


def reach(window: int, layers: int) -> int:
    """How far back (as TokenTask.distance counts) a stack of windows can see the fact's
    answer: each layer moves it at most W-1 positions forward, and the query sits one
    position after the distance's end."""
    return layers * (window - 1) + 1


def reach_table(rows, windowed: dict[str, tuple[int, int]], chance: float, out: Path):
    """Accuracy by where the fact lies: within one window (a head fetches it directly),
    past one window but within the stack's reach (it must be relayed up the layers), and
    beyond (no weights can fetch it), appended to recall.md."""
    lines = ["", f"Sliding windows by distance back to the fact (chance {chance:.0%}; examples in brackets):", "",
             "| variant | W | L | reach L·(W-1)+1 | within W | W to reach | beyond reach |",
             "|---|---|---|---|---|---|---|"]
    for name, (w, layers) in windowed.items():
        far = reach(w, layers)
        parts = []
        for lo, hi in ((0, w), (w, far), (far, float("inf"))):
            hit = [r["correct"] for r in rows if r["variant"] == name and r["correct"] is not None
                   and lo < r["distance"] <= hi]
            parts.append(f"{sum(hit) / len(hit):.0%} ({len(hit)})" if hit else "-")
        lines.append(f"| {name} | {w} | {layers} | {far} | " + " | ".join(parts) + " |")
    write_text_atomic(out / "recall.md", (out / "recall.md").read_text() + "\n".join(lines) + "\n")
    print("\n".join(lines))


def distance_plot(rows, windowed: dict[str, tuple[int, int]], chance: float, out: Path,
                  bins: int = 24):
    """Accuracy against the distance back to the fact, for each (window, layers) variant,
    with the window W and the stacked reach L·W marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, (w, layers)), color in zip(windowed.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        pts = [(r["distance"], r["correct"]) for r in rows if r["variant"] == name and r["correct"] is not None]
        if not pts:
            continue
        top = max(d for d, _ in pts)
        edges = torch.linspace(0, top + 1, bins + 1)
        xs, ys = [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            hit = [c for d, c in pts if lo <= d < hi]
            if hit:
                xs.append(((lo + hi) / 2).item())
                ys.append(sum(hit) / len(hit))
        ax.plot(xs, ys, marker=".", color=color, label=f"{name} (W={w}, L={layers})")
        ax.axvline(w, color=color, linestyle=":", alpha=0.7)
        ax.axvline(reach(w, layers), color=color, linestyle="--", alpha=0.7)
    ax.axhline(chance, color="red", linewidth=1, label=f"chance {chance:.0%}")
    ax.set_xscale("symlog", linthresh=64)
    ax.set_xlabel("distance back to the fact's answer (tokens); dotted: W, dashed: L·(W-1)+1")
    ax.set_ylabel("accuracy")
    ax.set_title("Sliding windows: how far back a fact can be retrieved")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "recall_distance.png")


# The longest example tested, in tokens (context x factor): within the filler's
# 200,000 characters for any tokenizer, and an attention matrix a laptop holds.
LONGEST = 1 << 13


def parse(argv) -> argparse.Namespace:
    """The options, each within its bounds, and the combinations that cannot work refused,
    before anything is trained or read."""
    parser = Parser("python -m attnlab.recall", __doc__)
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                        help="variants to train (default: all): " + ", ".join(VARIANTS))
    add_run_options(parser, "test this model instead of training: a run directory or name, "
                    "checkpoint or transformers folder (its tokenizer encodes the task)",
                    aliases=("--model",), without="train the variants")
    parser.add_argument("--context", type=whole(0, LONGEST), default=0, help="trained (base) "
                        "context in tokens; default 96 for the lab's models, the model's "
                        "block_size with --model")
    parser.add_argument("--factors", type=whole(1, 64), nargs="+", default=[1, 2, 4, 8],
                        help="lengths to test, as multiples of the context")
    parser.add_argument("--steps", type=whole(1, 10**6), default=500, help="training steps per variant")
    parser.add_argument("--digits", type=whole(1, 9), default=2, help="digits of the answer "
                        "(chance 10^-digits)")
    parser.add_argument("--examples", type=whole(1, 10**4), default=24, help="examples per grid cell")
    parser.add_argument("--depths", type=whole(2, 101), default=11, help="depths from 0 to 100%%")
    parser.add_argument("--out", type=out_option, default="runs/recall", help="folder for the figures and tables; "
                        "one used before keeps its other variants' rows, and the variants run "
                        "now replace theirs")
    parser.add_argument("--merge", nargs="+", default=[], metavar="DIR", help="train nothing: "
                        "draw the figures and table again from these runs' recall.csv, together")
    parser.add_argument("--resume", action="store_true", help="go on with a stopped run: the "
                        "variants --out already holds, measured with the same --steps, "
                        "--examples, --factors, --depths, --context and --digits, are kept, "
                        "not trained again")
    args = parser.parse_args(argv)
    refuse_combinations(args)
    return args


def refuse_combinations(args) -> None:
    longest = (args.context or 96) * max(args.factors)
    if longest > LONGEST:
        raise AttnlabError(f"--context {args.context or 96} x --factors {max(args.factors)} tests "
                           f"examples of {longest:,} tokens; the longest this lab reads is "
                           f"{LONGEST:,}: give a smaller --context or smaller --factors")
    other = "--model" if args.run else "--merge"
    if args.variants is not None and (args.run or args.merge):
        raise AttnlabError(f"--variants names models to train; {other} trains nothing: give "
                           "one or the other")
    if args.resume and (args.run or args.merge):
        raise AttnlabError(f"--resume goes on training the lab's variants; {other} trains "
                           "nothing: leave --resume out")
    if args.run and args.merge:
        raise AttnlabError("--merge draws runs already made and --model makes one: give one or the other")
    unknown = [v for v in args.variants or () if v not in VARIANTS]
    if unknown:
        raise AttnlabError(f"unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}")


def main(argv=None) -> int:
    args = parse(argv)
    depths = [i / (args.depths - 1) for i in range(args.depths)]
    with removed_if_left_empty(args.out):     # a refused input leaves no empty --out
        # Checked now, not after the training: a folder that cannot be written would lose it all.
        out = writable_folder(args.out)
        if args.merge:
            rows = [r for folder in args.merge for r in read_rows(Path(folder))]
            context, digits = run_facts(rows, args.merge)
            report(rows, sorted({r["factor"] for r in rows}), sorted({r["depth"] for r in rows}),
                   context, 10.0 ** -(digits or args.digits), out)
        elif args.run:
            test_model(args, depths, out)
        else:
            train_all(args, args.variants or list(VARIANTS), depths, out)
    return 0


def test_model(args, depths, out: Path) -> None:
    """Measure the model --model names on the task, in its own tokenizer."""
    model, cfg, tokenizer, ckpt = load(args)
    task = TokenTask(tokenizer, filler_text(), args.digits)
    context = args.context or cfg.model.block_size
    need = task.overhead() + 8
    if context < need:
        given = f"--context {context}" if args.context else f"{ckpt}'s context of {context} tokens"
        raise AttnlabError(f"{given} cannot hold the task's fact, question and some filler in "
                           f"this tokenizer: give --context {need} or more")
    from model.positions import POSITION_ENCODINGS
    if POSITION_ENCODINGS[cfg.model.position].has_length_limit and context > cfg.model.block_size:
        raise AttnlabError(f"--context {context} is past {ckpt}'s {cfg.model.position} positions: "
                           f"give --context at most {cfg.model.block_size}")
    if context * max(args.factors) > LONGEST:
        raise AttnlabError(f"{ckpt}'s context of {context:,} tokens x --factors "
                           f"{max(args.factors)} is past the {LONGEST:,} tokens this lab reads: "
                           "give --context or smaller --factors")
    name = Path(args.run).name or "model"
    earlier = earlier_rows(out, [name], context, args.digits)
    print(f"{ckpt}: {cfg.model.position} positions, context {context} tokens")
    rows = evaluate(name, model, task, context, args.factors, depths, args.examples)
    for r in rows:
        r.update(context=context, digits=args.digits)
    report(earlier + rows, *grid_of(earlier + rows), context, task.chance, out)


def train_all(args, variants: list[str], depths, out: Path) -> None:
    """Train each variant, measure it, and report everything so far after each."""
    tasks = {short: char_task(args.digits, short=short)
             for short in sorted({VARIANTS[name].short for name in variants})}
    context = args.context or 96
    need = max(t.overhead() for t in tasks.values()) + 8
    if context < need:
        raise AttnlabError(f"--context {context} leaves no room for filler: give at least {need}")
    kept = finished(out, variants, args, context, depths) if args.resume else set()
    rows = earlier_rows(out, [v for v in variants if v not in kept], context, args.digits)
    for name in variants:
        if name in kept:
            print(f"{name}: kept from {out / 'recall.csv'} (measured with these options)")
            continue
        v = VARIANTS[name]
        task = tasks[v.short]
        print(f"{name}: {v.about}" + (" (the short task: ' K is V.' in letters)" if v.short else ""))
        model = train_variant(task, v, context, args.steps)
        found = evaluate(name, model, task, context, args.factors, depths, args.examples)
        for r in found:
            r.update(window=model.config.sliding_window, layers=model.config.n_layer,
                     **{"global": model.config.n_global}, context=context, digits=args.digits,
                     steps=args.steps,
                     about=v.about if r["variant"] == name else
                     f"{v.about}, {r['variant'].split(' + ')[-1]}")
        rows += found
        # Everything so far, after each variant: a stopped run keeps what it measured.
        report(rows, *grid_of(rows), context, task.chance, out)


def grid_of(rows):
    """The factors and depths that any of the rows were measured at."""
    return sorted({r["factor"] for r in rows}), sorted({r["depth"] for r in rows})


def of_variant(label: str, names) -> bool:
    """Whether a row's label is one of these variants, as trained or scaled."""
    return label in names or label.split(" + ")[0] in names


def earlier_rows(out: Path, names, context: int, digits: int) -> list[dict]:
    """The rows an earlier run left in `out`, less those of the variants about to be run
    again; refused if they were measured at another context or digits (one figure, one
    scale and one chance line)."""
    if not (out / "recall.csv").exists():
        return []
    rows = [r for r in read_rows(out) if not of_variant(r["variant"], names)]
    if rows:
        was = run_facts(rows, [out])
        if was[0] != context or (was[1] or digits) != digits:
            raise AttnlabError(f"{out} holds runs at context {was[0]} with {was[1] or '?'} digits; "
                               f"this one is at {context} with {digits}: give another --out "
                               "(or the same --context and --digits)")
    return rows


def finished(out: Path, names, args, context: int, depths) -> set[str]:
    """The variants among `names` whose whole grid `out` already holds, measured with
    these options: a run stopped part-way writes each variant's rows when it is done, so
    these are the ones a resumed run need not train again."""
    if not (out / "recall.csv").exists():
        return set()
    done, every = set(), read_rows(out)
    for name in names:
        mine = [r for r in every if r["variant"] == name]
        if not mine or any((r["steps"], r["context"], r["digits"]) != (args.steps, context, args.digits)
                           for r in mine):
            continue
        per_cell = {}
        for r in mine:
            per_cell.setdefault((r["factor"], round(r["depth"], 9)), []).append(r)
        want = {(f, round(d, 9)) for f in args.factors for d in depths}
        if set(per_cell) == want and all(
                len(c) == args.examples or all(r["correct"] is None for r in c)   # n/a: one row a depth
                for c in per_cell.values()):
            done.add(name)
    return done


def run_facts(rows, folders) -> tuple[int, int | None]:
    """The one trained context and answer digits of these rows (digits None for a csv
    written before the lab recorded them), or an error when they differ: one figure
    has one length axis and one chance line."""
    contexts = {r["context"] or r["length"] // r["factor"] for r in rows}
    digits = {r["digits"] for r in rows if r["digits"]}
    if len(contexts) > 1 or len(digits) > 1:
        raise AttnlabError(f"{', '.join(map(str, folders))} hold runs at contexts "
                           f"{sorted(contexts)} and digits {sorted(digits)}: merge only runs of "
                           "one context and one number of digits")
    return contexts.pop(), (digits.pop() if digits else None)


def report(rows, factors, depths, context: int, chance: float, out: Path):
    names = list(dict.fromkeys(r["variant"] for r in rows))
    about = {r["variant"]: r.get("about") or r["variant"] for r in rows}
    # Windows alone, as trained: global tokens or a RoPE scaling change what "reach" means.
    windowed = {r["variant"]: (int(r["window"]), int(r["layers"])) for r in rows
                if int(r.get("window") or 0) and not int(r.get("global") or 0)   # "0" read back
                and " + " not in r["variant"]}
    written = write(rows, names, factors, depths, context, chance, out, about)
    if windowed:
        written.append(distance_plot(rows, windowed, chance, out))
        reach_table(rows, windowed, chance, out)
    print("wrote " + ", ".join(str(p) for p in written) + f", {out}/recall.md and .csv")
    return written


def read_rows(folder: Path) -> list[dict]:
    """The rows a run wrote to recall.csv, typed again; a damaged file is refused with
    its path."""
    path = folder / "recall.csv"
    rows = []
    with open(path, newline="") as f:
        try:
            for r in csv.DictReader(f):
                r["factor"], r["length"] = int(r["factor"]), int(r["length"])
                r["depth"] = float(r["depth"])
                r["distance"] = int(r["distance"]) if r["distance"] else None
                if r["correct"] not in ("", "True", "False") or r["factor"] < 1:
                    raise ValueError(r["correct"])
                r["correct"] = None if r["correct"] == "" else r["correct"] == "True"
                r["context"] = int(r.get("context") or 0)       # 0: a csv from before it was kept
                r["digits"] = int(r.get("digits") or 0)
                r["steps"] = int(r.get("steps") or 0)                # 0: not kept, so not resumable
                if not isinstance(r["variant"], str) or not r["variant"]:
                    raise ValueError("variant")
                rows.append(r)
        except (KeyError, ValueError, TypeError, IndexError, csv.Error):
            raise AttnlabError(f"{path} is damaged (row {len(rows) + 1} cannot be read): "
                               "run that lab again or remove the file") from None
    if not rows:
        raise AttnlabError(f"{path} holds no rows: run that lab again or remove the file")
    return rows


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
