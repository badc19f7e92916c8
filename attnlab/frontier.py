"""The recall-against-memory frontier: what each attention mechanism keeps to decode the
next token, and what it can still recall with it, side by side.

    python -m attnlab.frontier --out runs/frontier                  # every mechanism
    python -m attnlab.frontier --mechanisms mha gqa mqa window --out runs/frontier-kv
    python -m attnlab.frontier --quick --mechanisms mha mqa --out runs/frontier-quick

Softmax attention keeps every earlier token's key and value, so its memory grows with
the text; grouped-query (GQA) and multi-query (MQA) attention share keys and values
between heads, latent attention (MLA) caches a small latent, a sliding window keeps
only the newest tokens, and linear attention and the delta rule a state of fixed size.
Zoology (arXiv:2312.04927) and Based (arXiv:2402.18668) measured what that costs:
recall of what came earlier falls as the memory shrinks. This command measures the
same trade on a laptop.

Each mechanism is an entry of MECHANISMS, model config fields over one small base
model (the retrieval lab's, attnlab/recall.py); any other registered model.mechanism
is measured when named (`--mechanisms differential`). Each is trained three times for the
same number of steps: as a language model on the bundled corpus (by train.py, as
attnlab.compare does: val loss and training tokens/s), on the retrieval lab's fact by
depth and length, and on multi-query associative recall (attnlab/mqar_task.py) with
1..N key-value pairs, tested at each N. Decoding is timed one token at a time after a
cache filled with `context` tokens, and the bytes that cache holds are read from it
(the model's own cache says its size), so a mechanism that keeps something else than
keys and values reports its own. An entry whose config this model cannot build yet
(a mechanism not registered on this branch) is skipped with one line.

Writes into --out: frontier.md and frontier.csv (one row per mechanism) and
frontier.png (recall against memory per token, one point per mechanism, log x), and
keeps the language models' run folders under lm/ (a run of the same mechanism into
the same folder replaces them). Timings are of this machine at this
moment: other work on it makes them slower and noisier.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab.options import out_option
from attnlab.plotting import pyplot, save_figure
from common.errors import AttnlabError
from common.files import writable_folder, write_text_atomic
from engine.cli import Parser, errors_as_lines
from engine.machine import use_threads


@dataclass(frozen=True)
class Mechanism:
    """A mechanism to measure: model config fields over the base model (recall.BASE)."""
    about: str
    model: dict = field(default_factory=dict)


# The base model has 4 heads: GQA shares each key/value head between 2 of them, MQA one
# between all 4. The entries after the window change the attention's maths, each a choice
# of model.mechanism (model/mechanisms.py); the hybrid is a per-layer pattern of two.
MECHANISMS = {
    "mha": Mechanism("multi-head attention: 4 query heads, 4 key/value heads"),
    "gqa": Mechanism("grouped-query attention: 4 query heads share 2 key/value heads",
                     {"n_kv_head": 2}),
    "mqa": Mechanism("multi-query attention: 4 query heads share 1 key/value head",
                     {"n_kv_head": 1}),
    "window": Mechanism("sliding window: each query sees its 16 newest tokens",
                        {"sliding_window": 16}),
    "mla": Mechanism("multi-head latent attention (arXiv:2405.04434): a latent cached",
                     {"mechanism": "mla"}),
    "linear": Mechanism("linear attention (arXiv:2006.16236): a state of fixed size",
                        {"mechanism": "linear"}),
    "deltanet": Mechanism("the delta rule (arXiv:2406.06484): a state of fixed size",
                          {"mechanism": "deltanet"}),
    "hybrid": Mechanism("a linear-attention layer under a softmax one",
                        {"mechanism": "linear,mha"}),
}


def measurable() -> dict[str, Mechanism]:
    """The rows above, then every other registered model.mechanism, by its name alone: the
    default run measures the rows, and a mechanism added tomorrow is measured when named."""
    from model.mechanisms import MECHANISMS as REGISTERED
    from model.registry import RESERVED
    others = {n: Mechanism(f"model.mechanism={n}", {"mechanism": n}) for n in REGISTERED
              if n != RESERVED and n not in MECHANISMS}
    return {**MECHANISMS, **others}


@dataclass
class Settings:
    """One run's sizes: the defaults fit about 15 minutes on 2 cores; --quick is a test."""
    steps: int = 600                 # training steps of each of a mechanism's three models
    contexts: tuple = (1024, 4096, 16384)   # decode timed with a cache of this many tokens
    decode_steps: int = 12           # tokens decoded (2 untimed) at each context
    factors: tuple = (1, 2, 4)       # retrieval lab: lengths, as multiples of its context
    depths: tuple = (0.0, 0.5, 1.0)
    recall_context: int = 96
    pairs: tuple = (1, 2, 4, 8)      # MQAR: key-value pairs tested (trained on 1..max)
    mqar_length: int = 64
    keys: int = 32                   # MQAR keys, and as many values (chance 1/keys)
    examples: int = 32               # examples per recall cell and per MQAR pair count
    threads: int = 1


DIGITS = 2                           # of the retrieval lab's answer: chance 1%

QUICK = dict(steps=4, contexts=(32, 64), decode_steps=3, factors=(1, 2), depths=(0.0, 1.0),
             recall_context=64, pairs=(2, 4), mqar_length=32, keys=8, examples=2)


def why_not(mechanism: Mechanism) -> str | None:
    """None where the model builds this entry's config; else why not, in one line (a
    field or a name this branch does not have yet)."""
    from attnlab.recall import BASE
    from model import GPT, ModelConfig, ModelError
    fields = {**BASE, **mechanism.model, "vocab_size": 8, "block_size": 64}
    unknown = sorted(set(fields) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        return f"ModelConfig has no field {', '.join(unknown)}"
    try:
        GPT.skeleton(ModelConfig(**fields))
    except ModelError as err:
        return str(err)
    return None


def model_args(mechanism: Mechanism) -> str:
    """train.py options for the base model with this entry's fields over it."""
    from attnlab.recall import BASE
    return " ".join(f"--model.{k}={v}" for k, v in {**BASE, **mechanism.model}.items())


# ---------------------------------------------------------------- decoding and memory

@torch.no_grad()
def decode_at(model, context: int, steps: int, seed: int = 0) -> tuple[float, int]:
    """(seconds per token, bytes the cache holds) decoding the last `steps` tokens of
    `context` one at a time; the cache is filled with the tokens before them first
    (random ids: the time and the size do not depend on what the tokens say)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (1, context), generator=g)
    cache = model.new_cache(context)
    # Chunks no longer than a rolling cache's window, which would otherwise grow to fit one.
    chunk = min(512, getattr(cache, "window", 0) or 512)
    for start in range(0, context - steps, chunk):
        model(ids[:, start:min(start + chunk, context - steps)], cache=cache)
    times = []
    for i in range(context - steps, context):
        started = time.perf_counter()
        model(ids[:, i:i + 1], cache=cache)
        times.append(time.perf_counter() - started)
    # The first two steps warm up; the median of the rest is least moved by other work.
    return statistics.median(times[2:] or times), cache.nbytes()


def memory_facts(held: dict[int, int]) -> tuple[float, float]:
    """(bytes per token, fixed bytes) from the bytes a cache held at several contexts:
    the growth between the shortest and the longest, and what is left at the shortest.
    Softmax attention's cache grows by 2·n_layer·n_kv_head·d_k numbers a token (K and V)
    and has nothing fixed; a window's stops growing at its capacity; a recurrent state
    does not grow at all."""
    lo, hi = min(held), max(held)
    per_token = (held[hi] - held[lo]) / (hi - lo)
    return per_token, held[lo] - per_token * lo


def memory_per_token(row: dict, length: int) -> float:
    """Bytes held to decode at `length` tokens of context, per token of it."""
    return (row["state_bytes"] + row["cache_bytes_per_token"] * length) / length


def decode_columns(mechanism: Mechanism, s: Settings, vocab_size: int) -> dict:
    from attnlab.recall import BASE
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    cfg = ModelConfig(**{**BASE, **mechanism.model, "vocab_size": vocab_size,
                         "block_size": min(s.contexts)})
    model = GPT(cfg).eval()
    row, held = {}, {}
    for n in s.contexts:
        seconds, held[n] = decode_at(model, n, s.decode_steps)
        row[f"decode_ms_at_{n}"] = 1000 * seconds
    row["cache_bytes_per_token"], row["state_bytes"] = memory_facts(held)
    return row


# ---------------------------------------------------------------- the three trainings

# train.py options every language model gets (a test adds its own token cache folder).
LM_OPTIONS = ["--train.eval_iters=10", "--train.wandb=disabled"]


def language_model(name: str, mechanism: Mechanism, s: Settings, out: Path) -> dict:
    """Val loss and training speed on the bundled corpus, from train.py (attnlab.compare's
    runner: one process, the run folder kept)."""
    from attnlab.compare import run_variant
    earlier = out / "lm" / name
    if (earlier / "config.json").is_file() and (earlier / "metrics.jsonl").is_file():
        shutil.rmtree(earlier)               # this command's own run of it, from before: replaced
    common = [f"--train.eval_interval={max(1, s.steps // 4)}",
              f"--train.log_interval={max(1, s.steps // 20)}", *LM_OPTIONS]
    r = run_variant(name, model_args(mechanism), "compare-cpu", s.steps, out / "lm", common)
    return {"params": r["params"], "val_loss": r["val_loss"], "train_tokens_per_s": r["tokens_per_s"]}


def retrieval(mechanism: Mechanism, s: Settings, task) -> dict:
    """The retrieval lab's fact (attnlab/recall.py): share of whole answers right, over
    every depth, at each length."""
    from attnlab.recall import Variant, grid, train_variant
    model = train_variant(task, Variant(mechanism.about, mechanism.model), s.recall_context,
                          s.steps, log=lambda line: None)
    rows = grid(model, task, s.recall_context, s.factors, s.depths, s.examples)
    return {f"recall_{f}x": statistics.mean(r["correct"] for r in rows if r["factor"] == f)
            for f in s.factors}


def mqar(mechanism: Mechanism, s: Settings) -> dict:
    """MQAR accuracy at each number of key-value pairs, of a model trained on 1..max."""
    from attnlab.mqar_task import MQARTask, score
    from attnlab.recall import Variant, train_variant
    task = MQARTask(s.keys, s.keys, max(s.pairs))
    model = train_variant(task, Variant(mechanism.about, mechanism.model), s.mqar_length,
                          s.steps, log=lambda line: None)
    return {f"mqar_{p}": score(model, task, s.mqar_length, p, s.examples) for p in s.pairs}


def measure(name: str, mechanism: Mechanism, s: Settings, out: Path, recall_task, bar) -> dict:
    row = {"mechanism": name, "about": mechanism.about}
    for stage, work in (("language model", lambda: language_model(name, mechanism, s, out)),
                        ("retrieval", lambda: retrieval(mechanism, s, recall_task)),
                        ("MQAR", lambda: mqar(mechanism, s)),
                        ("decoding", lambda: decode_columns(mechanism, s,
                                                            recall_task.tokenizer.vocab_size))):
        bar.set_description(f"{name}: {stage}")
        row.update(work())
        bar.update()
    return row


# ---------------------------------------------------------------- the table and the figure

def columns(s: Settings) -> list[str]:
    return (["mechanism", "params", "val_loss", "train_tokens_per_s"]
            + [f"decode_ms_at_{n}" for n in s.contexts]
            + ["cache_bytes_per_token", "state_bytes"]
            + [f"recall_{f}x" for f in s.factors] + [f"mqar_{p}" for p in s.pairs] + ["about"])


# What each column holds, printed under the table and written with it.
MEANING = {
    "params": "parameters of the model",
    "val_loss": "validation loss of the language model on the bundled plays (nats per token)",
    "train_tokens_per_s": "training tokens per second of that run",
    "decode_ms_at_N": "milliseconds to decode one token after a cache of N tokens",
    "cache_bytes_per_token": "bytes the cache grows by with each token (keys and values, or "
                             "MLA's latent)",
    "state_bytes": "bytes the cache holds whatever the length: a recurrent state, or a "
                   "window's rolling buffer",
    "recall_Nx": "the retrieval lab's fact found at N times the trained length, all depths",
    "mqar_N": "multi-query associative recall with N key-value pairs",
}


def legend() -> list[str]:
    return [f"- `{name}`: {meaning}" for name, meaning in MEANING.items()]


def cell(key: str, value) -> str:
    if isinstance(value, str):
        return value
    if key.startswith(("recall_", "mqar_")):
        return f"{value:.0%}"
    if key == "val_loss":
        return f"{value:.3f}"
    if key.startswith("decode_ms"):
        return f"{value:.2f}"
    return f"{value:,.0f}"


def write_table(rows: list[dict], s: Settings, out: Path, header: str) -> None:
    cols = columns(s)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, cols)
    w.writeheader()
    w.writerows({c: r[c] for c in cols} for r in rows)
    write_text_atomic(out / "frontier.csv", text.getvalue())
    shown = cols[:-1]
    lines = [header, "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(c, r[c]) for c in shown) + " |" for r in rows]
    lines += ["", *legend()]
    write_text_atomic(out / "frontier.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows: list[dict], s: Settings, out: Path) -> Path:
    """Recall against memory per token of context, one point per mechanism: MQAR at the
    most pairs, and the retrieval lab's fact at the trained length."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = ((axes[0], f"mqar_{max(s.pairs)}", s.mqar_length,
               f"MQAR, {max(s.pairs)} pairs in {s.mqar_length} tokens", 1 / s.keys),
              (axes[1], f"recall_{min(s.factors)}x", s.recall_context * min(s.factors),
               f"retrieval lab, {s.recall_context * min(s.factors)} tokens", 10.0 ** -DIGITS))
    for ax, key, length, title, chance in panels:
        for r in rows:
            x = max(memory_per_token(r, length), 1e-3)     # log axis: nothing at 0
            ax.scatter(x, r[key], s=40)
            ax.annotate(r["mechanism"], (x, r[key]), textcoords="offset points", xytext=(5, 4),
                        fontsize=8)
        ax.axhline(chance, color="red", linewidth=1, label=f"chance {chance:.0%}")
        ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel(f"cache or state bytes per token, at {length} tokens of context")
        ax.set_ylabel("accuracy")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Recall against memory (Zoology arXiv:2312.04927, Based arXiv:2402.18668)",
                 fontsize=10)
    return save_figure(fig, out / "frontier.png")


# ---------------------------------------------------------------- the command

def whole(lo: int, hi: int):
    """An argparse type: a whole number in [lo, hi], refused while parsing."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {lo} to {hi}")
        return value
    return parse


def parser() -> Parser:
    p = Parser("python -m attnlab.frontier", __doc__)
    p.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), metavar="NAME",
                   help="mechanisms to measure, in this order (default: all of "
                        + ", ".join(MECHANISMS) + "; any other model.mechanism by its name)")
    p.add_argument("--out", type=out_option, default="runs/frontier",
                   help="folder for frontier.md, .csv, .png and the language models' runs")
    p.add_argument("--quick", action="store_true", help="a test-sized run: a few steps, short "
                   "contexts, a few examples (seconds per mechanism; the numbers mean nothing)")
    p.add_argument("--steps", type=whole(1, 100_000), default=None,
                   help=f"training steps of each model (default {Settings.steps}; --quick {QUICK['steps']})")
    p.add_argument("--contexts", type=whole(16, 65_536), nargs="+", default=None, metavar="N",
                   help="contexts (tokens in the cache) to time decoding at, 2 to 5 of them "
                        f"(default {' '.join(map(str, Settings.contexts))})")
    p.add_argument("--pairs", type=whole(1, 64), nargs="+", default=None, metavar="N",
                   help="MQAR key-value pairs to test; the model trains on 1 to the largest "
                        f"(default {' '.join(map(str, Settings.pairs))})")
    p.add_argument("--examples", type=whole(1, 1024), default=None,
                   help=f"examples per recall cell and per MQAR pair count (default {Settings.examples})")
    p.add_argument("--threads", type=whole(1, os.cpu_count() or 1), default=Settings.threads,
                   help="torch threads, here and in train.py (default 1: models this small spend "
                        "their time in dispatch, and a second thread on a busy machine waits)")
    return p


def settings_of(args) -> Settings:
    """The run's sizes, checked: --quick's, then what was given over them."""
    s = Settings(**(QUICK if args.quick else {}), threads=args.threads)
    for key in ("steps", "examples"):
        if getattr(args, key) is not None:
            setattr(s, key, getattr(args, key))
    if args.contexts is not None:
        s.contexts = tuple(sorted(set(args.contexts)))
        if not 2 <= len(s.contexts) <= 5:
            raise AttnlabError(f"--contexts: give 2 to 5 different lengths (the cache's growth "
                               f"per token is read between them), not {len(s.contexts)}")
    if min(s.contexts) < 4 * s.decode_steps:
        raise AttnlabError(f"--contexts {min(s.contexts)}: give at least {4 * s.decode_steps}, "
                           f"room for the {s.decode_steps} tokens decoded after the cache")
    if args.pairs is not None:
        s.pairs = tuple(sorted(set(args.pairs)))
    most = min(s.mqar_length // 4, s.keys)
    if max(s.pairs) > most:
        raise AttnlabError(f"--pairs {max(s.pairs)}: an MQAR sequence of {s.mqar_length} tokens "
                           f"over {s.keys} keys holds at most {most} pairs")
    known = measurable()
    unknown = [m for m in args.mechanisms if m not in known]
    if unknown:
        from common.errors import closest
        close = closest(unknown[0], sorted(known))
        others = [n for n in known if n not in MECHANISMS]
        raise AttnlabError(f"--mechanisms {unknown[0]}: not a mechanism the frontier measures"
                           + (f" (did you mean {close!r}?)" if close else "")
                           + f"; it measures {', '.join(MECHANISMS)} by default"
                           + (f", and by name {', '.join(others)}" if others else ""))
    return s


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    s = settings_of(args)
    out = writable_folder(args.out)        # now, not after the training it would lose
    use_threads(s.threads, os.environ)                  # train.py's too: one setting, one run
    chosen, known = {}, measurable()
    for name in dict.fromkeys(args.mechanisms):
        reason = why_not(known[name])
        if reason:
            print(f"{name}: skipped, this model cannot build it yet: {reason}")
        else:
            chosen[name] = known[name]
    if not chosen:
        raise AttnlabError("none of the mechanisms asked for can be built by this model: "
                           "give some of " + ", ".join(n for n in known if not why_not(known[n])))
    from attnlab.recall_task import char_task
    recall_task = char_task(DIGITS, chars=20_000 if args.quick else 200_000)
    rows = []
    with tqdm(total=4 * len(chosen), unit="stage", dynamic_ncols=True) as bar:
        for name, mechanism in chosen.items():
            rows.append(measure(name, mechanism, s, out, recall_task, bar))
            bar.write(f"{name}: val loss {rows[-1]['val_loss']:.3f}, MQAR at {max(s.pairs)} pairs "
                      f"{rows[-1][f'mqar_{max(s.pairs)}']:.0%}")
    header = (f"Frontier, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
              f"{s.threads} thread(s) of {os.cpu_count()} cores, {s.steps} steps per model; "
              "timings are this machine's at this moment (other work makes them slower).")
    write_table(rows, s, out, header)
    written = plot(rows, s, out)
    print(f"wrote {out}/frontier.md, frontier.csv and {written}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
