"""Today's model cards on one table, each beside itself with one piece switched off: val
loss at equal wall time, training tokens/s, decoding ms at 1k/4k/16k tokens of context,
cache bytes per token and state bytes, and MQAR recall, with the `cpu` preset as the
baseline row measured in the same sitting.

    python bench/cards.py                               # every card and piece: the full run
    python bench/cards.py --cards gpt-oss gemma3        # those cards (and the baseline)
    python bench/cards.py --plan runs/cards/plan.json   # the same steps again, no probe
    python bench/cards.py --quick                       # a test of the script, seconds a row
    python bench/cards.py --plan runs/cards/plan.json --out runs/cards   # a killed sitting, on

A model card shows the whole model and never the model without one of its pieces. Each
piece here is switched off on the same card (PIECES): gpt-oss without its sinks is plain
multi-head attention with the same windows, qwen3-next without its gate, without its
experts, and so on; the row says what the card loses with it.

Equal wall time, and still the same numbers from the same command: a timing plans,
never decides numerics during a run. Before anything trains, each row's training step is
timed once here (engine/budget.py's probe, on a batch of the bundled plays, taken again
if other programs held a core) and its steps are set to what `--seconds` buys at that
rate. The plan is printed and written to plan.json; each run is then an ordinary
`train.py --config CARD --train.max_iters=N` whose numbers depend on N alone, and
`--plan plan.json` runs the same N again without timing anything. (train.py's --budget
is not used: it chooses the model's size, which an ablation must keep, and its schedule
follows the clock.)

The decoding and memory columns are attnlab/frontier.py's (decode_columns: a model of
the row's config, random weights, timed a token at a time after a cache of N tokens, the
bytes read from the cache itself), and so is MQAR (Zoology's task, attnlab/mqar_task.py:
the row's layers and pieces at the frontier's width and with its short convolution
before the mixers, so the cells read beside the frontier's rows, trained at the longest
length, then scored in every cell beside its key-blind floor). The MQAR models train in
a second process, on the second core, while this one runs the language models, as the
frontier does. Writes cards.md, cards.csv and plan.json into
--out, keeps each language model's run folder under lm/ and each row's figures under
rows/ as they are measured: a sitting killed part way, started again with its plan and
folder, resumes a language model's run where it stopped and measures again only the
rows it had not finished.
"""

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import csv
import io
import json
import math
import os
import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnlab import frontier  # noqa: E402
from capability import cpu_model  # noqa: E402
from common.errors import AttnlabError  # noqa: E402
from common.files import writable_folder, write_text_atomic  # noqa: E402
from engine.cli import errors_as_lines  # noqa: E402
from engine.machine import describe_cpu, use_threads  # noqa: E402
from model.config import ModelConfig  # noqa: E402

BASELINE = "cpu"


def at_default(*names: str) -> dict:
    """Fields put back to ModelConfig's defaults: a piece switched off leaves none of its
    own fields set, which the model would refuse as changing nothing."""
    return {n: ModelConfig.__dataclass_fields__[n].default for n in names}


# Switching the experts off leaves a dense SwiGLU: the experts' default hidden width is
# SwiGLU's shared out among the experts a token uses, so the dense row does the same
# multiply-adds a token with fewer weights.
NO_EXPERTS = {"mlp": "swiglu", **at_default("moe_experts", "moe_top_k", "moe_shared",
                                            "moe_router", "moe_expert", "moe_bias_rate",
                                            "moe_shared_gate", "moe_routed_scale", "moe_groups",
                                            "moe_group_top", "moe_dense_layers")}
NO_WINDOWS = at_default("sliding_window", "full_attention_every")

# card -> piece -> (what the row keeps in its place, the model fields that switch it off)
PIECES = {
    "gpt-oss": {
        "sinks": ("softmax attention without sinks, the same heads and windows", {"mechanism": "mha"}),
        "windows": ("every layer sees the whole context", NO_WINDOWS),
        "experts": ("a dense SwiGLU MLP", NO_EXPERTS),
    },
    "qwen3-next": {
        "gate": ("the softmax layer ungated", {"mechanism": "gated_deltanet_norm,"
                                                            "gated_deltanet_norm,"
                                                            "gated_deltanet_norm,mha"}),
        "gated_deltanet": ("gated softmax attention in every layer",
                           {"mechanism": "gated", **at_default("delta_conv")}),
        "experts": ("a dense SwiGLU MLP", NO_EXPERTS),
    },
    "deepseek-v3": {
        "mla": ("multi-head attention, its keys and values cached",
                {"mechanism": "mha", **at_default("mla_q_rank")}),
        "experts": ("a dense SwiGLU MLP", NO_EXPERTS),
        "mtp": ("no multi-token prediction module", at_default("mtp_depth")),
    },
    "deepseek-v3.2": {
        "indexer": ("latent attention over every key",
                    {"mechanism": "mla", **at_default("sparse_top_k", "indexer_heads",
                                                      "indexer_dim")}),
        "experts": ("a dense SwiGLU MLP", NO_EXPERTS),
    },
    "gemma3": {
        "windows": ("every layer sees the whole context, one RoPE base",
                    {**NO_WINDOWS, **at_default("rope_local_theta")}),
        "qk_norm": ("queries and keys not normalised", at_default("qk_norm", "qk_norm_weight")),
        "sandwich": ("a norm before each sublayer only", at_default("block")),
    },
    "kimi-linear": {
        "kda": ("latent attention in every layer", {"mechanism": "mla", **at_default("delta_conv")}),
        "mla": ("the softmax layer plain multi-head attention",
                {"mechanism": "kda,kda,kda,mha", **at_default("mla_nope")}),
        "experts": ("a dense SwiGLU MLP", NO_EXPERTS),
    },
}


@dataclass(frozen=True)
class Row:
    """One line of the table: a preset, with `off` switched off by `fields`."""
    preset: str
    off: str = ""
    about: str = ""
    fields: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The row's name, also its run folder's: no spaces, no slashes."""
        return f"{self.preset}--no-{self.off}" if self.off else self.preset

    def options(self) -> list[str]:
        return [f"--model.{k}={v}" for k, v in self.fields.items()]


def rows_of(cards: list[str]) -> list[Row]:
    """The baseline, then each card followed by its pieces switched off in turn."""
    rows = [Row(BASELINE, about="the baseline: the article's model")]
    for card in cards:
        rows.append(Row(card, about="the card as its preset"))
        rows += [Row(card, piece, f"without {piece}: {keeps}", changed(card, fields))
                 for piece, (keeps, fields) in PIECES[card].items()]
    return rows


def changed(preset: str, fields: dict) -> dict:
    """The fields whose value differs from the preset's: the options train.py is given."""
    from engine.cli import build
    model = build(preset, []).model
    return {k: v for k, v in fields.items() if getattr(model, k) != v}


def config_of(row: Row):
    """The run's config, as train.py builds it from the same options (checked there)."""
    from engine.cli import build
    return build(row.preset, row.options())


def check(row: Row) -> None:
    """The row's model builds (a field its piece left set is refused here, in one line,
    before anything trains)."""
    from model import GPT
    GPT.skeleton(replace(config_of(row).model, vocab_size=8))


# ---------------------------------------------------------------- the plan

@dataclass
class Settings:
    """One sitting's sizes: the full run's by default; QUICK is a test of the script."""
    seconds: float = 120.0        # training time each row's steps are planned to take
    probe_s: float = 3.0          # timing each row's step, before anything trains
    eval_iters: int = 20          # batches per evaluation, every row alike
    frontier_sizes: frontier.Settings = field(default_factory=frontier.Settings)   # decoding and MQAR


QUICK = dict(seconds=1.0, probe_s=0.2, eval_iters=2,
             frontier_sizes=frontier.Settings(**frontier.QUICK))
OUT, QUICK_OUT = "runs/cards", "runs/cards-quick"
QUICK_NOTE = ("--quick: a test of the script, not a measurement: every number below is "
              "noise. The measurement is `python bench/cards.py` on a quiet machine.")


def probe(rows: list[Row], s: Settings, log=print) -> dict[str, float]:
    """Training steps per second of each row's model, timed here once, in this process:
    engine/budget.py's probe at the precision and kernel the run will use, on the same
    batch of the bundled plays for every row."""
    from data.tokens import Batches, load_tokens
    from engine.budget import measure, probe_again_if_busy
    from engine.machine import pick_dtype
    rates, corpora = {}, {}
    for row in rows:
        cfg = config_of(row)
        d = cfg.data
        key = (d.path, d.tokenizer, d.vocab_size, d.val_fraction, d.cache_dir)
        if key not in corpora:
            corpora[key] = load_tokens(*key, log=lambda line: None)
        data = corpora[key]
        cfg.model.vocab_size = data.tokenizer.vocab_size
        batch = Batches(data.train, cfg.train.batch_size, cfg.model.block_size, seed=0).next()
        device = torch.device("cpu")
        dtype = pick_dtype(cfg.train.dtype, device, cfg.model.n_embd)
        busy = (lambda line, name=row.name: log(
            f"probe: other programs held a core while {name} was timed, twice: its steps "
            "are those of a machine this busy"))
        rates[row.name] = probe_again_if_busy(
            lambda: measure(cfg, device, dtype, s.probe_s, batch), busy)
        log(f"probe: {row.name}: {rates[row.name]:.2f} steps/s")
    return rates


def plan_steps(rates: dict[str, float], seconds: float) -> dict[str, int]:
    """Steps that take `seconds` at each measured rate (at least one)."""
    return {name: max(1, round(seconds * rate)) for name, rate in rates.items()}


def read_plan(path: Path, rows: list[Row], quick: bool) -> tuple[float, int, dict[str, float], dict[str, int]]:
    """(seconds, threads, steps/s, steps) of a plan.json an earlier run wrote: the steps and
    the threads are used as they are, so the runs compute what that run's did (a sum split
    over another number of threads rounds differently); a --quick plan only with --quick,
    whose evaluations and MQAR are smaller."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        seconds, threads = float(data["seconds"]), int(data["threads"])
        was_quick = bool(data.get("quick", False))
        rates = {name: float(r["steps_per_s"]) for name, r in data["rows"].items()}
        steps = {name: r["steps"] for name, r in data["rows"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise AttnlabError(f"--plan {path}: not a plan this script wrote ({err}); give the "
                           "plan.json a run of bench/cards.py wrote, or leave --plan out to "
                           "time each row again") from None
    if was_quick != quick:
        raise AttnlabError(f"--plan {path} was written by a run {'with' if was_quick else 'without'} "
                           f"--quick, which sizes the evaluations and MQAR too: give --plan "
                           f"{'with' if was_quick else 'without'} --quick to compute what it did")
    bad = [n for n, v in steps.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    missing = [r.name for r in rows if r.name not in steps]
    if bad or missing:
        raise AttnlabError(f"--plan {path}: " + (f"no whole number of steps for {bad[0]}" if bad
                           else f"no steps for {missing[0]}") + "; give a plan written for "
                           "these cards, or leave --plan out to time each row again")
    wrong = ([f"seconds {seconds:g}"] if not 0 < seconds <= 24 * 3600 else []) + \
            ([f"threads {threads}"] if not 1 <= threads <= (os.cpu_count() or 1) else []) + \
            [f"{n}'s {steps[n]} steps at {rates[n]:g} steps/s" for n in steps
             if not 0 < rates[n] < 1e6 or steps[n] != max(1, round(seconds * rates[n]))]
    if wrong:
        raise AttnlabError(f"--plan {path}: {wrong[0]} is not what this script plans (steps are "
                           "seconds times the rate timed, seconds up to a day, threads up to "
                           f"{os.cpu_count()}): an edited plan; give the one a run wrote, or "
                           "leave --plan out to time each row again")
    return seconds, threads, rates, steps


def write_plan(path: Path, s: Settings, threads: int, rates: dict, steps: dict,
               quick: bool = False) -> None:
    rows = {n: {"steps_per_s": rates[n], "steps": steps[n]} for n in steps}
    write_text_atomic(path, json.dumps({"seconds": s.seconds, "threads": threads, "quick": quick,
                                        "rows": rows}, indent=1) + "\n")


# ---------------------------------------------------------------- the measurements

def language_model(row: Row, steps: int, s: Settings, out: Path) -> dict:
    """train.py for the planned steps (attnlab/compare.py's runner), nothing timed that
    decides anything: the warm-up a tenth of the steps, at most the presets' 50."""
    from attnlab.compare import run_variant
    resume = earlier_run(row, steps, out)
    common = [f"--train.eval_interval={steps}",          # at the start and the end: the end is the figure
              f"--train.log_interval={max(1, steps // 20)}",
              f"--train.eval_iters={s.eval_iters}", f"--train.warmup_iters={min(50, max(1, steps // 10))}",
              "--train.wandb=disabled"]
    r = run_variant(row.name, " ".join(row.options()), row.preset, steps, out / "lm", common,
                    resume)
    metrics = (out / "lm" / row.name / "metrics.jsonl").read_text().splitlines()
    trained = max((json.loads(line).get("elapsed_s", 0.0) for line in metrics), default=0.0)
    return {"params": r["params"], "val_loss": r["val_loss"], "train_s": trained,
            "train_tokens_per_s": r["tokens_per_s"]}


def as_json(value):
    """`value` as it reads back from JSON (tuples as lists): what a kept file compares with."""
    return json.loads(json.dumps(value))


def earlier_run(row: Row, steps: int, out: Path) -> bool:
    """Whether lm/ holds this row's run from an earlier start of the same plan, killed or
    finished: it is then resumed (train.py --resume), not trained again. A folder holding
    another config's or another plan's run is refused, not mixed into the table."""
    run_dir = out / "lm" / row.name
    if not (run_dir / "checkpoints").is_dir():
        return False
    try:
        if (run_dir / "config.json").stat().st_size > 2**20:
            raise ValueError("config.json over 1 MiB")
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        model, iters = saved["model"], saved["train"]["max_iters"]
        want = as_json(asdict(config_of(row).model))
        same = iters == steps and all(model.get(k) == v for k, v in want.items()
                                      if k != "vocab_size")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise AttnlabError(f"{run_dir}: not a run of this script's ({err}); remove it, or "
                           "give another --out") from None
    if not same:
        raise AttnlabError(f"{run_dir} holds a run of another config or plan than "
                           f"{row.name}'s {steps} steps; give the --plan it was started "
                           "with, remove the folder, or give another --out")
    return True


def kept(out: Path, name: str, part: str, key: dict) -> dict | None:
    """A row's `part` (its language model and decoding, or its MQAR) measured by an
    earlier start of this sitting and kept in rows/, if it was measured under `key` (the
    same steps and sizes); so a killed run loses at most the row it was on."""
    path = out / "rows" / f"{name}.{part}.json"
    try:
        if path.stat().st_size > 2**20:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    result = data.get("result")
    whole = isinstance(result, dict) and result.get("row", name) == name and all(
        isinstance(v, str) if k in ("row", "about") else
        type(v) in (int, float) and math.isfinite(v) for k, v in result.items())
    if not whole:
        print(f"{path}: not a row this script wrote; measuring {name} again")
    return result if whole else None


def keep(out: Path, name: str, part: str, key: dict, result: dict) -> None:
    (out / "rows").mkdir(exist_ok=True)
    write_text_atomic(out / "rows" / f"{name}.{part}.json",
                      json.dumps({"key": key, "result": result}, indent=1) + "\n")


# MQAR's model: the frontier's width, heads and short convolution (frontier.BASE), so a
# card's cells read beside the frontier's rows; the row's own layers, pattern and pieces.
MQAR_SIZE = {k: frontier.BASE[k] for k in ("n_embd", "n_head", "token_mix")}


def as_mechanism(row: Row, mqar: bool = False) -> frontier.Mechanism:
    """The row's whole model config as one of the frontier's entries: for decoding, as the
    language model is; for MQAR, at the frontier's size (MQAR_SIZE)."""
    fields = {k: v for k, v in asdict(config_of(row).model).items()
              if k not in ("vocab_size", "block_size")}
    if mqar:
        fields.update(MQAR_SIZE)
    return frontier.Mechanism(row.about, fields)


def decoding(row: Row, s: Settings) -> dict:
    return frontier.decode_columns(as_mechanism(row), s.frontier_sizes, s.frontier_sizes.vocab)


# ---------------------------------------------------------------- the table

def columns(s: Settings) -> list[str]:
    f = s.frontier_sizes
    return (["row", "params", "steps", "train_s", "val_loss", "val_vs_card", "train_tokens_per_s"]
            + [f"decode_ms_at_{n}" for n in f.contexts]
            + ["cache_bytes_per_token", "state_bytes"]
            + [f"mqar_{n}_{p}" for n, p in frontier.mqar_cells(f)])


RATIO_OF = ("train_tokens_per_s", "decode_ms_at_", "cache_bytes_per_token")


def shown(key: str, row: dict, base: dict, floors: dict) -> str:
    """A cell, and beside a speed or a size its ratio to the baseline row's."""
    value = row[key]
    if key in ("row", "steps"):
        return str(value)
    if key == "val_vs_card":
        return "" if value is None else f"{value:+.3f}"
    if key == "train_s":
        return f"{value:.0f}"
    text = frontier.cell(key, value, floors.get(key))
    if key.startswith(RATIO_OF) and row is not base and base[key]:
        text += f" ({value / base[key]:.2f}x)"
    return text


def table(rows: list[dict], floors: dict, s: Settings, header: list[str]) -> str:
    cols = columns(s)
    base = rows[0]
    lines = [*header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(shown(c, r, base, floors) for c in cols) + " |" for r in rows]
    lines += ["", f"- `steps`: training steps, planned to take {s.seconds:g} s at the rate each "
              "row's step was timed at before anything trained (plan.json)",
              "- `train_s`: the seconds those steps took (evaluations left out): how near "
              "equal the rows' wall times came",
              "- `val_vs_card`: val loss minus the card's own, in the same sitting: above 0, "
              "the piece switched off was worth that much",
              f"- ratios in brackets: to the `{BASELINE}` preset's row, in the same sitting",
              *frontier.legend()]
    lines += [f"- `{r['row']}`: {r['about']}" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], s: Settings, path: Path) -> None:
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, [*columns(s), "about"], extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(path, text.getvalue())


def machine_line(threads: int) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"machine: {cpu_model()} ({describe_cpu()}), {os.cpu_count()} cores; torch "
            f"{torch.__version__}, {threads} thread(s) a process; load average {load}")


# ---------------------------------------------------------------- the command

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cards", nargs="+", default=list(PIECES), choices=list(PIECES),
                   metavar="CARD", help="cards to measure, each with its pieces switched off "
                   f"in turn (default: all of {', '.join(PIECES)}); the {BASELINE} preset's "
                   "row is always measured")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"training time each row's steps are planned for (default "
                        f"{Settings.seconds:g}; --quick {QUICK['seconds']:g})")
    p.add_argument("--plan", type=Path, default=None,
                   help="a plan.json an earlier run wrote: its steps, seconds and threads are "
                        "used, nothing is timed to plan, so the runs compute what that run's did")
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for cards.md, cards.csv, plan.json and the runs (default "
                        f"{OUT}; with --quick, {QUICK_OUT})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and in train.py (default 1, as the frontier: the "
                        "MQAR models train on the second core; with --plan, the plan's)")
    p.add_argument("--quick", action="store_true",
                   help="a test of the script: a second of training a row, short contexts, "
                        "a few MQAR steps (its numbers are noise, and its table says so)")
    return p


def settings_of(args) -> Settings:
    s = Settings(**(QUICK if args.quick else {}))
    if args.plan and (args.seconds is not None or args.threads is not None):
        raise AttnlabError("--plan brings its own seconds and threads: leave --seconds and "
                           "--threads out, or leave --plan out to plan again")
    args.threads = 1 if args.threads is None else args.threads
    s.frontier_sizes = replace(s.frontier_sizes, threads=args.threads)
    if args.seconds is not None:
        if not 0 < args.seconds <= 24 * 3600:
            raise AttnlabError(f"--seconds {args.seconds:g}: give a time from above 0 to a day")
        s.seconds = args.seconds
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        raise AttnlabError(f"--threads {args.threads}: give 1 to {os.cpu_count()}")
    return s


def start_mqar(todo: dict, s: Settings, stack: ExitStack) -> dict:
    """As the frontier runs its own: the MQAR models train one after another in a second
    process while this one runs the language models and times decoding, then the ones
    not yet started share both cores (frontier.share_the_rest)."""
    if not frontier.helpers(s.frontier_sizes):      # one core: each after the language models
        return {n: frontier.Later(frontier.mqar, m, s.frontier_sizes) for n, m in todo.items()}
    pool = frontier.worker_pool(stack)
    return {n: pool.submit(frontier.mqar, m, s.frontier_sizes) for n, m in todo.items()}


def keep_when_done(futures: dict, done) -> None:
    """Each MQAR model's cells kept (`done`) as it finishes, in whichever process."""
    for n, f in futures.items():
        if hasattr(f, "add_done_callback"):
            f.add_done_callback(lambda f, n=n: f.cancelled() or f.exception()
                                or done(n, f.result()))


def measured_row(row: Row, steps: int, s: Settings, out: Path, key: dict) -> dict:
    """The row's language model and decoding columns, or those an earlier start of this
    sitting kept for it."""
    result = kept(out, row.name, "lm", key)
    if result is None:
        result = {"row": row.name, "about": row.about, "steps": steps}
        result.update(language_model(row, steps, s, out))
        result.update(decoding(row, s))
        keep(out, row.name, "lm", key, result)
    else:
        print(f"{row.name}: kept from an earlier start of this sitting (rows/{row.name}.lm.json)")
    return result


def go_on_with(args, rows: list[Row], out: Path) -> None:
    """A sitting begun in `out` (its plan.json there) goes on when the same command is
    given again, killed or finished: its plan is used as --plan would use it, so the
    rows it kept are not measured again. Other seconds or threads are refused."""
    if args.plan is not None or not (out / "plan.json").is_file():
        return
    try:
        seconds, threads, _, _ = read_plan(out / "plan.json", rows, args.quick)
    except AttnlabError as err:
        raise AttnlabError(f"{out} holds another sitting ({err}); give another --out") from None
    if args.seconds not in (None, seconds) or args.threads not in (None, threads):
        raise AttnlabError(f"{out} holds a sitting planned for {seconds:g} s on {threads} "
                           f"thread(s): give those (or leave --seconds and --threads out) to "
                           "go on with it, or give another --out")
    args.plan, args.seconds, args.threads = out / "plan.json", None, None
    print(f"plan: going on with the sitting in {out} (its plan.json)")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = writable_folder(args.out or (QUICK_OUT if args.quick else OUT))
    rows = rows_of(list(dict.fromkeys(args.cards)))
    for row in rows:
        check(row)
    go_on_with(args, rows, out)
    s = settings_of(args)
    if args.plan:
        s.seconds, args.threads, rates, steps = read_plan(args.plan, rows, args.quick)
        s.frontier_sizes = replace(s.frontier_sizes, threads=args.threads)
    use_threads(args.threads, os.environ)          # train.py's too
    print(machine_line(args.threads))
    if args.quick:
        print(QUICK_NOTE)
    if args.plan:
        print(f"plan: from {args.plan}, nothing timed")
    else:
        rates = probe(rows, s)
        steps = plan_steps(rates, s.seconds)
    for row in rows:                  # a run folder of another plan: refused before any work
        earlier_run(row, steps[row.name], out)
    write_plan(out / "plan.json", s, args.threads, rates, {r.name: steps[r.name] for r in rows},
               args.quick)
    for row in rows:
        print(f"plan: {row.name}: {rates[row.name]:.2f} steps/s -> {steps[row.name]} steps "
              f"(python train.py --config {row.preset} {' '.join(row.options())} "
              f"--train.max_iters={steps[row.name]})")
    floors = frontier.mqar_floors(s.frontier_sizes)
    results = []
    recall_models = {r.name: as_mechanism(r, mqar=True) for r in rows}
    sizes = as_json(asdict(s.frontier_sizes))
    keys = {r.name: {"sizes": sizes, "model": as_json(recall_models[r.name].model)}
            for r in rows}                                 # what a row's MQAR depends on
    earlier = {n: kept(out, n, "mqar", keys[n]) for n in recall_models}
    todo = {n: m for n, m in recall_models.items() if earlier[n] is None}
    with ExitStack() as stack:
        mqar = start_mqar(todo, s, stack)
        keep_when_done(mqar, lambda n, r: keep(out, n, "mqar", keys[n], r))
        for row in rows:
            lm_key = {"steps": steps[row.name], "eval_iters": s.eval_iters, "sizes": sizes,
                      "model": as_json(as_mechanism(row).model)}
            result = measured_row(row, steps[row.name], s, out, lm_key)
            results.append(result)
            print(f"{row.name}: val loss {result['val_loss']:.3f}")
        first = dict(mqar)
        frontier.share_the_rest(mqar, todo, s.frontier_sizes, stack)
        keep_when_done({n: f for n, f in mqar.items() if f is not first[n]},    # moved ones
                       lambda n, r: keep(out, n, "mqar", keys[n], r))
        for result in results:
            name = result["row"]
            result.update(earlier[name] or mqar[name].result())
            keep(out, name, "mqar", keys[name], {k: v for k, v in result.items()
                                                 if k.startswith("mqar_")})
    resumed = [n for n in earlier if earlier[n] is not None]
    if resumed:
        print(f"MQAR kept from an earlier start of this sitting: {', '.join(resumed)}")
    card_loss = {r["row"]: r["val_loss"] for r in results if "--no-" not in r["row"]}
    for r in results:
        r["val_vs_card"] = (r["val_loss"] - card_loss[r["row"].split("--no-")[0]]
                            if "--no-" in r["row"] else None)
    header = [f"Model cards, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
              + machine_line(args.threads)]
    if args.quick:
        header = [f"**{QUICK_NOTE}**", "", *header]
    text = table(results, floors, s, header)
    write_text_atomic(out / "cards.md", text)
    write_csv(results, s, out / "cards.csv")
    print(text)
    print(f"wrote {out}/cards.md, cards.csv and plan.json")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
