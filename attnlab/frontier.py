"""The recall-against-memory frontier: what each attention mechanism keeps to decode the
next token, and what it can still recall with it, side by side.

    python -m attnlab.frontier                                      # every mechanism
    python -m attnlab.frontier --mechanisms mha gqa mqa window --out runs/frontier-kv
    python -m attnlab.frontier --quick                              # a test of the command

Softmax attention keeps every earlier token's key and value, so its memory grows with
the text; grouped-query (GQA) and multi-query (MQA) attention share keys and values
between heads, latent attention (MLA) caches a small latent, a sliding window keeps
only the newest tokens, and linear attention and the delta rule a state of fixed size.
Zoology (arXiv:2312.04927) and Based (arXiv:2402.18668) measured what that costs:
recall of what came earlier falls as the memory shrinks. This command measures the
same trade on a laptop.

Each mechanism is an entry of MECHANISMS, model config fields over one small base
model (BASE: the retrieval lab's 2 layers of 64, with the short causal convolution
that Based, DeltaNet and Gated DeltaNet put before their mixers, for every row alike);
any other registered model.mechanism is measured when named (`--mechanisms
differential`). Each is trained twice: as a language model on the bundled corpus (by
train.py, as attnlab.compare does: val loss and training tokens/s), and on multi-query
associative recall (attnlab/mqar_task.py, Zoology's task) with 1..N key-value pairs at
the longest MQAR length, then tested at every length and number of pairs that fits; the
MQAR models train in a second process, on the second core, while this one runs the
language models and times decoding.
Beside every MQAR score stands its floor: what a model that never matches a query to
its key scores on the same examples (1/N). Decoding is timed one token at a time after
a cache filled with `context` tokens, and the bytes that cache holds are read from it
(the model's own cache says its size), so a mechanism that keeps something else than
keys and values reports its own. An entry whose config this model cannot build yet
(a mechanism not registered on this branch) is skipped with one line.

Writes into --out (runs/frontier; with --quick, runs/frontier-quick): frontier.md and
frontier.csv (one row per mechanism, and the floor's row) and frontier.png (MQAR
accuracy against memory per token at the longest length, and against the number of
pairs), and keeps the language models' run folders under lm/ (a run of the same
mechanism into the same folder replaces them). Timings are of this machine at this
moment: other work on it makes them slower and noisier.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab.options import out_option
from attnlab.plotting import pyplot, save_figure
from common.errors import AttnlabError, terminate_as_interrupt
from common.files import writable_folder, write_text_atomic
from engine.cli import Parser, errors_as_lines
from engine.machine import use_threads


@dataclass(frozen=True)
class Mechanism:
    """A mechanism to measure: model config fields over the base model (BASE)."""
    about: str
    model: dict = field(default_factory=dict)


# The retrieval lab's small model (2 layers, 4 heads, 64 wide), with a causal convolution
# over each position and the 3 before it ahead of every mixer: Based (arXiv:2402.18668)
# and the DeltaNet and Gated DeltaNet models (arXiv:2406.06484, arXiv:2412.06464) put one
# there, and it hands each token its predecessor, so a key and its value meet in one
# position and the lookup MQAR asks for is learned in hundreds of steps, not thousands.
BASE = dict(n_layer=2, n_head=4, n_embd=64, mlp="gelu", position="rope", token_mix=4)

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
    "gated_deltanet": Mechanism("the gated delta rule (arXiv:2412.06464): a state that "
                                "also fades", {"mechanism": "gated_deltanet"}),
    # Softmax first: with the layers the other way round (linear,mha) the model did not
    # learn MQAR's lookup in the frontier's steps (docs/after_the_article.md).
    "hybrid": Mechanism("a softmax layer under a linear-attention one",
                        {"mechanism": "mha,linear"}),
}


def measurable(asked=()) -> dict[str, Mechanism]:
    """The rows above, then every other registered model.mechanism, by its name alone: the
    default run measures the rows, and a mechanism added tomorrow is measured when named;
    and of `asked`, the per-layer lists of them (linear,mha: the layers in turn)."""
    from model.mechanisms import MECHANISMS as REGISTERED
    from model.registry import is_reserved
    others = {n: Mechanism(f"model.mechanism={n}", {"mechanism": n}) for n in REGISTERED
              if not is_reserved(n) and n not in MECHANISMS}
    layered = {n: Mechanism(f"model.mechanism={n}: the layers' mechanisms in turn", {"mechanism": n})
               for n in asked if "," in n and all(
                   part.strip() in REGISTERED and not is_reserved(part.strip()) for part in n.split(","))}
    return {**MECHANISMS, **others, **layered}


@dataclass
class Settings:
    """One run's sizes: the defaults take about a quarter of an hour on 2 cores; --quick is a test."""
    steps: int = 600                 # training steps of each language model
    contexts: tuple = (1024, 4096, 16384)   # decode timed with a cache of this many tokens
    decode_steps: int = 12           # tokens decoded (2 untimed) at each context
    mqar_steps: int = 800            # MQAR training steps, at the longest length
    mqar_batch: int = 32
    mqar_lr: float = 3e-3
    mqar_lengths: tuple = (64, 128)  # MQAR tested at each; trained at the longest
    pairs: tuple = (1, 2, 4, 8, 16, 32)   # tested where they fit (4 tokens a pair)
    vocab: int = 256                 # MQAR tokens: keys the lower half, values the upper
    examples: int = 256              # test examples per MQAR cell
    threads: int = 1


QUICK = dict(steps=4, contexts=(32, 64), decode_steps=3, mqar_steps=4, mqar_lengths=(16, 32),
             pairs=(1, 2, 4, 8), examples=8)
OUT, QUICK_OUT = "runs/frontier", "runs/frontier-quick"

# Said in the table of a --quick run, where a reader meets its numbers.
QUICK_NOTE = ("--quick: a test of the command, not a measurement: a few steps a model, so "
              "every val loss and MQAR cell below is noise. The measurement is "
              "`python -m attnlab.frontier` (about a quarter of an hour on 2 cores).")


def mqar_cells(s: Settings) -> list[tuple[int, int]]:
    """(length, pairs) of every MQAR cell: each length with every number of pairs it holds."""
    from attnlab.mqar_task import most_pairs
    return [(n, p) for n in s.mqar_lengths for p in s.pairs if p <= most_pairs(n)]


def why_not(mechanism: Mechanism) -> str | None:
    """None where the model builds this entry's config; else why not, in one line (a
    field or a name this branch does not have yet)."""
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


# ---------------------------------------------------------------- the two trainings

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


def mqar_task(s: Settings):
    from attnlab.mqar_task import MQARTask, most_pairs
    return MQARTask(s.vocab, min(max(p for _, p in mqar_cells(s)), most_pairs(max(s.mqar_lengths))))


def mqar(mechanism: Mechanism, s: Settings) -> dict:
    """MQAR accuracy in every cell, of one model trained at the longest length on 1..the
    most pairs it holds (RoPE and the convolution see only offsets, so the shorter
    lengths test the same lookup with the pairs nearer)."""
    from attnlab.mqar_task import score, train
    use_threads(s.threads)                   # in a worker process too
    task = mqar_task(s)
    model = train(task, {**BASE, **mechanism.model}, max(s.mqar_lengths), s.mqar_steps,
                  batch=s.mqar_batch, lr=s.mqar_lr, log=lambda line: None)
    return {f"mqar_{n}_{p}": score(model, task, n, p, s.examples)[0] for n, p in mqar_cells(s)}


def mqar_floors(s: Settings) -> dict:
    """The key-blind floor of every MQAR cell, on the examples each model is scored on."""
    from attnlab.mqar_task import floor, test_batch
    task = mqar_task(s)
    return {f"mqar_{n}_{p}": floor(*test_batch(task, n, p, s.examples), s.vocab)
            for n, p in mqar_cells(s)}


def measure(name: str, mechanism: Mechanism, s: Settings, out: Path, bar) -> dict:
    """One row's language model and decoding, here, while the MQAR models train beside."""
    row = {"mechanism": name, "about": mechanism.about}
    for stage, work in (("language model", lambda: language_model(name, mechanism, s, out)),
                        ("decoding", lambda: decode_columns(mechanism, s, s.vocab))):
        bar.set_description(f"{name}: {stage}")
        row.update(work())
        bar.update()
    return row


def share_the_rest(recall: dict, chosen: dict, s: Settings, stack: ExitStack) -> None:
    """Once the language models are done this core is free: the MQAR models the first
    helper has not started move to a second, from the end of the queue. Each model trains
    in a fresh process of its own kind with its own seed and s.threads, so which process
    runs it changes when it finishes, not what it computes."""
    if not helpers(s):
        return
    second = worker_pool(stack)
    for name in reversed(list(recall)):
        if recall[name].cancel():                # not started: the second process takes it
            recall[name] = second.submit(mqar, chosen[name], s)


def worker_pool(stack: ExitStack, workers: int = 1) -> ProcessPoolExecutor:
    """Processes for the MQAR models, closed with `stack`: the models not yet started are
    dropped and the running ones stopped (everything is read from them inside the
    stack, so at its close they hold nothing wanted). A SIGTERM here stops as a Ctrl-C
    does, and a worker dies with this process even when it is killed outright."""
    stack.enter_context(terminate_as_interrupt())
    pool = stack.enter_context(ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_die_with_parent))
    stack.callback(_stop, pool)
    return pool


def _die_with_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)         # Ctrl-C is the parent's to handle
    if sys.platform.startswith("linux"):                 # PR_SET_PDEATHSIG: killed with it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _stop(pool: ProcessPoolExecutor) -> None:
    for process in list((pool._processes or {}).values()):   # the running model too: the
        process.terminate()                                   # pool then fails what is left
    pool.shutdown(wait=True, cancel_futures=True)


def helpers(s: Settings) -> int:
    """Processes to train the MQAR models in, beside this one: one while a second core is
    free for it (each model uses s.threads), else none."""
    return 1 if (os.cpu_count() or 1) >= 2 * s.threads else 0


# ---------------------------------------------------------------- the table and the figure

FLOOR = "key-blind floor"        # the floor's row: a model that never matches a query to its key


def columns(s: Settings) -> list[str]:
    return (["mechanism", "params", "val_loss", "train_tokens_per_s"]
            + [f"decode_ms_at_{n}" for n in s.contexts]
            + ["cache_bytes_per_token", "state_bytes"]
            + [f"mqar_{n}_{p}" for n, p in mqar_cells(s)] + ["about"])


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
    "mqar_L_N": "multi-query associative recall, N key-value pairs in L tokens: share of "
                "queries answered, and in brackets the key-blind floor (guessing among the "
                "example's N values, 1/N), which a score must beat to show any recall",
}


def legend() -> list[str]:
    return [f"- `{name}`: {meaning}" for name, meaning in MEANING.items()]


def cell(key: str, value, floor: float | None = None) -> str:
    if isinstance(value, str):
        return value
    if key.startswith("mqar_"):
        return f"{value:.0%} ({floor:.0%})" if floor is not None else f"{value:.0%}"
    if key == "val_loss":
        return f"{value:.3f}"
    if key.startswith("decode_ms"):
        return f"{value:.2f}"
    return f"{value:,.0f}"


def write_table(rows: list[dict], floors: dict, s: Settings, out: Path, header: list[str]) -> None:
    cols = columns(s)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, cols, restval="")
    w.writeheader()
    w.writerows({c: r[c] for c in cols} for r in rows)
    w.writerow({"mechanism": FLOOR, **floors,
                "about": "a model that never matches a query to its key: 1/N"})
    write_text_atomic(out / "frontier.csv", text.getvalue())
    shown = cols[:-1]
    lines = [*header, "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(c, r[c], floors.get(c)) for c in shown) + " |" for r in rows]
    lines += ["", *legend()]
    write_text_atomic(out / "frontier.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


MARKERS = "osD^vP*Xhp<>"


def plot(rows: list[dict], floors: dict, s: Settings, out: Path, note: str = "") -> Path:
    """Based's recall-memory frontier (arXiv:2402.18668, figure 2): MQAR accuracy at the
    longest length and the most pairs it holds, against the bytes each mechanism keeps
    per token of that context (log x); and beside it accuracy against the number of
    pairs at that length. Each mechanism is named once, in a legend outside the axes,
    so no two names can overlap however close their points lie."""
    plt = pyplot()
    length = max(s.mqar_lengths)
    pairs = [p for n, p in mqar_cells(s) if n == length]
    key = f"mqar_{length}_{max(pairs)}"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(rows):
        style = dict(color=colours[i % len(colours)], marker=MARKERS[i % len(MARKERS)])
        x = max(memory_per_token(r, length), 1e-3)     # log axis: nothing at 0
        left.scatter(x, r[key], s=50, label=r["mechanism"], **style)
        right.plot(pairs, [r[f"mqar_{length}_{p}"] for p in pairs], label=r["mechanism"],
                   linewidth=1.2, **style)
    left.axhline(floors[key], color="black", linestyle="--", linewidth=1)
    right.plot(pairs, [floors[f"mqar_{length}_{p}"] for p in pairs], color="black",
               linestyle="--", linewidth=1, label=FLOOR)
    left.set_xscale("log")
    left.set_xlabel(f"cache or state bytes per token, at {length} tokens of context")
    left.set_title(f"MQAR, {max(pairs)} pairs in {length} tokens (dashed: key-blind floor)",
                   fontsize=9)
    right.set_xscale("log", base=2)
    right.set_xticks(pairs, [str(p) for p in pairs])
    right.set_xlabel(f"key-value pairs in {length} tokens")
    right.set_title("MQAR against the number of pairs", fontsize=9)
    for ax in (left, right):
        ax.set_ylim(-0.03, 1.03)
        ax.set_ylabel("accuracy at the queries")
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle("Recall against memory (Zoology arXiv:2312.04927, Based arXiv:2402.18668)"
                 + (f"\n{note}" if note else ""), fontsize=9)
    fig.tight_layout()
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
                        + ", ".join(MECHANISMS) + "; any other model.mechanism by its name, "
                        "or a per-layer list such as linear,mha)")
    p.add_argument("--out", type=out_option, default=None,
                   help=f"folder for frontier.md, .csv, .png and the language models' runs "
                        f"(default {OUT}; with --quick, {QUICK_OUT}, so a test never "
                        "replaces a measurement)")
    p.add_argument("--quick", action="store_true", help="a test of the command: a few steps, "
                   "short contexts, a few examples (seconds per mechanism; its numbers are "
                   "noise, and its table says so)")
    p.add_argument("--steps", type=whole(1, 100_000), default=None,
                   help=f"training steps of each language model (default {Settings.steps}; --quick {QUICK['steps']})")
    p.add_argument("--contexts", type=whole(16, 65_536), nargs="+", default=None, metavar="N",
                   help="contexts (tokens in the cache) to time decoding at, 2 to 5 of them "
                        f"(default {' '.join(map(str, Settings.contexts))})")
    p.add_argument("--pairs", type=whole(1, 64), nargs="+", default=None, metavar="N",
                   help="MQAR key-value pairs to test, each at every length that holds it; "
                        "the model trains on 1 to the largest that fits "
                        f"(default {' '.join(map(str, Settings.pairs))})")
    p.add_argument("--mqar_steps", type=whole(1, 100_000), default=None,
                   help=f"MQAR training steps (default {Settings.mqar_steps}; --quick {QUICK['mqar_steps']})")
    p.add_argument("--examples", type=whole(1, 4096), default=None,
                   help=f"test examples per MQAR cell (default {Settings.examples})")
    p.add_argument("--threads", type=whole(1, os.cpu_count() or 1), default=Settings.threads,
                   help="torch threads, here and in train.py (default 1: models this small spend "
                        "their time in dispatch, and a second thread on a busy machine waits)")
    return p


def settings_of(args) -> Settings:
    """The run's sizes, checked: --quick's, then what was given over them."""
    s = Settings(**(QUICK if args.quick else {}), threads=args.threads)
    for key in ("steps", "mqar_steps", "examples"):
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
    from attnlab.mqar_task import most_pairs
    most = most_pairs(max(s.mqar_lengths))
    if max(s.pairs) > most:
        raise AttnlabError(f"--pairs {max(s.pairs)}: an MQAR sequence of {max(s.mqar_lengths)} "
                           f"tokens holds at most {most} pairs (4 tokens a pair: the pair and "
                           "a query's slot)")
    known = measurable(args.mechanisms)
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


def refuse_to_replace_a_measurement(out: Path, quick: bool) -> None:
    """--quick's noise never replaces a measured table, in its own folder or one named."""
    table = out / "frontier.md"
    if quick and table.is_file() and \
            QUICK_NOTE not in table.read_text(encoding="utf-8", errors="replace")[:4096]:
        raise AttnlabError(f"{out} holds a measured frontier (frontier.md), which --quick's "
                           "numbers would replace; give --quick another --out")


class Later:
    """A future that runs its call when asked for the result (one process, one core)."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def result(self):
        return self.call(*self.args)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    s = settings_of(args)
    out = writable_folder(args.out or (QUICK_OUT if args.quick else OUT))   # now, not after the training
    refuse_to_replace_a_measurement(out, args.quick)
    use_threads(s.threads, os.environ)                  # train.py's too: one setting, one run
    chosen, known = {}, measurable(args.mechanisms)
    for name in dict.fromkeys(args.mechanisms):
        reason = why_not(known[name])
        if reason:
            print(f"{name}: skipped, this model cannot build it yet: {reason}")
        else:
            chosen[name] = known[name]
    if not chosen:
        raise AttnlabError("none of the mechanisms asked for can be built by this model: "
                           "give some of " + ", ".join(n for n in known if not why_not(known[n])))
    if args.quick:
        print(QUICK_NOTE)
    floors = mqar_floors(s)
    last = f"mqar_{max(s.mqar_lengths)}_{max(p for n, p in mqar_cells(s) if n == max(s.mqar_lengths))}"
    rows = []
    # The MQAR models train one after another in a second process (a second core) while
    # this one runs the language models and times the decoding; then the MQAR models not
    # yet started share both cores.
    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=3 * len(chosen), unit="stage", dynamic_ncols=True))
        if helpers(s):
            pool = worker_pool(stack, helpers(s))
            recall = {n: pool.submit(mqar, m, s) for n, m in chosen.items()}
        else:
            recall = {n: Later(mqar, m, s) for n, m in chosen.items()}
        for name, mechanism in chosen.items():
            started = time.perf_counter()
            rows.append(measure(name, mechanism, s, out, bar))
            bar.write(f"{name}: val loss {rows[-1]['val_loss']:.3f}, "
                      f"{time.perf_counter() - started:.0f} s")
        share_the_rest(recall, chosen, s, stack)
        for row in rows:
            bar.set_description(f"{row['mechanism']}: MQAR")
            row.update(recall[row["mechanism"]].result())
            bar.update()
            bar.write(f"{row['mechanism']}: {last} {row[last]:.0%} (floor {floors[last]:.0%})")
    header = [f"Frontier, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
              f"{s.threads} thread(s) of {os.cpu_count()} cores, {s.steps} steps per language "
              f"model and {s.mqar_steps} per MQAR model; timings are this machine's at this "
              "moment (other work makes them slower)."]
    if args.quick:
        header = [f"**{QUICK_NOTE}**", "", *header]
    write_table(rows, floors, s, out, header)
    written = plot(rows, floors, s, out, note="--quick: every score is noise" if args.quick else "")
    print(f"wrote {out}/frontier.md, frontier.csv and {written}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
