"""`python train.py --budget 5m`: the best model this machine can train in the time given.

1. Measure: a few training steps of the preset's model on this device give the FLOP/s
   it sustains (model FLOPs per token × tokens/s).
2. Choose: from a ladder of sizes, the one whose tokens per parameter in the time left
   comes closest to 10 (TOKENS_PER_PARAM): a larger model would see too few tokens to
   learn what it can hold, a smaller one would stop improving while time is left.
3. Measure the chosen model itself, set the number of steps, the warm-up, evaluations
   sized to a few percent of the budget, and a hard time limit; the run stops on time
   with a final evaluation and checkpoint.
Before all that, a large vocabulary whose frequent tokens are few gets the adaptive
softmax as its output layer (choose_readout), the training text is read in passes and,
on a CPU, a wsd schedule decays over the whole run and each token is mixed with its
neighbours before attention (PLAN_DEFAULTS). Only the sizes, that readout, the sampling,
the schedule and the mixing change: attention, positions, optimizer and data stay as the
preset and the command line set them.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, replace

import torch

from common.errors import ConfigError
from engine.machine import (HELD, built_for, fix_threads, other_cores, pick_dtype, read_machine,
                            routes_experts)
from model.mechanisms import MECHANISMS
from model.readout import READOUTS, SHORTLIST_COVERAGE, head_macs, shortlist_for

# Chinchilla's compute-optimal ratio is about 20 (Hoffmann et al., arXiv:2203.15556),
# fitted to runs that saw each token about once. The runs this planner makes on a CPU
# are 10^4 times smaller and read a small corpus many times over, and there the rung at
# 5-7 tokens per parameter beat or tied the one nearest 20 (docs/benchmarks.md, "Tokens
# per parameter").
TOKENS_PER_PARAM = 10.0
# (n_layer, n_embd), by parameters: depth grows with width, as in GPT-2's and nanoGPT's
# sizes, except 2 x 128 beside 3 x 96. On a CPU a layer costs a step a fixed time besides
# its arithmetic, so at about the same parameters two layers 128 wide take more steps than
# three 96 wide and end lower (docs/benchmarks.md, "Width before depth").
LADDER = [
    (2, 64), (3, 96), (2, 128), (4, 128), (4, 160), (5, 192), (6, 256), (6, 320), (6, 384),
    (8, 512), (10, 640), (12, 768), (16, 1024), (24, 1024), (24, 1536),
]
EVAL_SHARE = 0.06            # of the budget, for all evaluations together
EVALS = 4                    # evaluations in a budget run (the last one at the end)
BETWEEN_SHARE = 1 / 8        # of the last evaluation's batches, for each one before it
MARGIN_S = 1.0               # the final checkpoint write and process exit (train.py skips teardown)
OVERPLAN = 1.2               # steps planned over what the probe measured
CEILING = 8                  # max_iters, this many times the steps planned: see plan()
MIN_STEPS = 300              # fewer, and the batch is halved (down to MIN_BATCH)
MIN_BATCH = 8
MIN_TRAIN_S = 5.0            # of training, or the plan is refused
SHORTEST_PROBE_S = 0.5
LONGEST_S = 7 * 24 * 3600    # a week: beyond, a typo more likely than a plan
# The sizes and the schedule the plan sets itself: given next to --budget they would be
# overridden, so they are refused. The plan honours the rest; batch_size, warmup_iters and
# log_interval as upper bounds, dtype unless it is auto, the readout when one is named.
PLANNED = ("model.n_layer", "model.n_embd", "model.n_head", "model.n_kv_head",
           "train.max_iters", "train.time_limit", "train.eval_interval", "train.eval_iters",
           "train.final_eval_iters")
READOUT_OPTIONS = ("readout", "readout_shortlist", "tie_embeddings")
READOUT_SHARE = 0.2          # of a token's multiply-adds, the least the output layer must be
# Settings a budget run takes in place of the preset's, each unless the command line
# names it: (section, key) -> (value, whether it applies to a config on a device, what
# the plan says of it).
PLAN_DEFAULTS = {
    # A budget run on a CPU reads a small corpus a few times over, where reading it in
    # passes beat drawing windows at random (data/tokens.py, Batches; docs/benchmarks.md,
    # "Reading in passes").
    ("data", "sampling"): ("epochs", lambda cfg, device: True,
                           "the text read in passes, each window once a pass"),
    # A wsd schedule decays over all of a budget run's steps after the warm-up, straight
    # to min_lr (as in arXiv:2502.15938): on a CPU, 0.009 lower than decaying over the
    # last 60% over four seeds (docs/benchmarks.md, "The decay of a budget run").
    ("train", "decay_frac"): (1.0, lambda cfg, device: device.type == "cpu"
                              and cfg.train.schedule == "wsd",
                              "the rate decays over all the steps after the warm-up"),
    # Each token mixed with the 3 before it ahead of attention (model/layers.py, TokenMix):
    # on a CPU's small models, lower on each of four seeds at the same steps and the same
    # speed (docs/benchmarks.md, "Mixing neighbours before attention").
    ("model", "token_mix"): (4, lambda cfg, device: device.type == "cpu",
                             "each token mixed with the 3 before it ahead of attention"),
}


def shortest_budget() -> float:
    """The budget below which no machine leaves MIN_TRAIN_S to train, as plan() counts:
    the first probe at its shortest, then the evaluations' share, the margin and one more
    probe (of the chosen size, in one precision)."""
    return SHORTEST_PROBE_S + (MIN_TRAIN_S + MARGIN_S + 1.5 * SHORTEST_PROBE_S) / (1 - EVAL_SHARE)


def seconds(s: float) -> str:
    """'0.5 s' below ten seconds, '90 s' above."""
    return (f"{s:.1f}".rstrip("0").rstrip(".") if s < 10 else f"{s:.0f}") + " s"


def parse_duration(text: str) -> float:
    """'5m', '90s', '1h30m', '300' (seconds) -> seconds; more than a week is refused."""
    t = text.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(h|m|s)", t)
    refused = ConfigError(f"--budget {text!r} is not a duration of at most a week; examples: "
                          "90s, 5m, 1h30m, 300")
    if re.fullmatch(r"\d+(\.\d+)?", t):
        total = float(t)
    elif parts and "".join(n + u for n, u in parts) == t.replace(" ", ""):
        total = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    else:
        raise refused
    if total > LONGEST_S:
        raise refused
    return total


def budget_seconds(text: str, overrides: dict[str, dict[str, str]]) -> float:
    """The seconds of --budget TEXT, refused with what to do, before any work, when no
    plan can come of it: not a duration, too short, or next to an option the plan sets."""
    budget_s = parse_duration(text)
    if budget_s < shortest_budget():
        raise ConfigError(f"a budget of {seconds(budget_s)} is too short to measure this "
                          f"machine and train; give at least {seconds(math.ceil(shortest_budget()))} "
                          "(a minute or more trains a model worth sampling)")
    given = [name for name in PLANNED if name.partition(".")[2] in overrides.get(name.partition(".")[0], {})]
    if given:
        named = " and ".join(", ".join(f"--{n}" for n in given).rsplit(", ", 1))
        raise ConfigError(f"--budget chooses the model's size and the schedule itself, so "
                          f"{named} cannot be given with it; drop "
                          f"{'it' if len(given) == 1 else 'them'}, or train without --budget "
                          "(--train.time_limit=SECONDS stops any run on time)")
    return budget_s


def model_sizes(model_cfg) -> tuple[int, int, str]:
    """(parameters, buffer numbers, its largest tensor in words or "") of a model of
    `model_cfg`, counted on the model itself built on the meta device (GPT.skeleton:
    every shape, no memory), so every field that sizes a tensor counts, a new one
    included, with no list of fields to fall behind. A vocabulary not yet known (0 until
    the tokenizer is read) counts as two tokens. Building costs time per layer, not per
    weight, so a depth whose W_O matrices alone (n_embd² numbers a layer, which every
    mechanism has) could not fit is counted from that lower bound without building."""
    from model import GPT
    layers_alone = model_cfg.n_layer * model_cfg.n_embd ** 2
    if 4 * layers_alone > (available_bytes(torch.device("cpu")) or 64 << 30):
        return layers_alone, 0, ""
    sized = replace(model_cfg, vocab_size=model_cfg.vocab_size or 2,
                    readout_shortlist=model_cfg.readout_shortlist or 1)
    skeleton = GPT.skeleton(sized)
    tensors = dict(skeleton.named_parameters()) | dict(skeleton.named_buffers())
    name, largest = max(tensors.items(), key=lambda item: item[1].numel())
    return (sum(p.numel() for p in skeleton.parameters()),
            sum(b.numel() for b in skeleton.buffers()),
            f"{name}, {' x '.join(f'{n:,}' for n in largest.shape)}")


def training_bytes(cfg) -> tuple[int, int]:
    """(parameters, bytes) that training cfg needs at least: the sum of training_parts."""
    params, parts = training_parts(cfg)
    return params, sum(parts.values())


def training_parts(cfg) -> tuple[int, dict[str, int]]:
    """(parameters, bytes by what holds them) that training cfg needs at least: "weights",
    12 bytes a parameter (fp32 weights, gradients and one optimizer moment; AdamW keeps
    two) and 4 a buffer number; then the activations backward keeps, 34·T·d + 5·H·T² bytes
    a layer and sequence at 16 bits (Korthikanti et al., arXiv:2205.05198, section 4):
    "activations" the 34·T·d, "attention maps" the 5·H·T², H the T×T maps the layer's
    mechanism keeps (its entry's score_maps: the heads, and a sparse layer's indexer heads
    too), multi-token prediction's blocks counted as layers; "mtp logits" the logits each
    multi-token prediction module keeps. All are lower bounds, so a model refused for
    them could not have fitted."""
    m, t = cfg.model, cfg.train
    params, buffers, _ = model_sizes(m)
    # Counted per name of the pattern, which is cycled over the layers: a list n_layer long
    # would hang on an absurd n_layer before the bound could refuse it.
    # Multi-token prediction's blocks (model.mtp_depth) follow the stack in the same cycle,
    # and each of its modules keeps one more set of logits (4 bytes a vocabulary entry).
    names = [n.strip() for n in m.mechanism.split(",")]
    blocks = m.n_layer + m.mtp_depth
    maps = sum(MECHANISMS[n].score_maps(m) * (blocks // len(names) + (i < blocks % len(names)))
               for i, n in enumerate(names))
    return params, {"weights": 12 * params + 4 * buffers,
                    "activations": t.batch_size * 34 * blocks * m.block_size * m.n_embd,
                    "attention maps": t.batch_size * 5 * maps * m.block_size ** 2,
                    "mtp logits": t.batch_size * 4 * m.mtp_depth * m.block_size * m.vocab_size}


# What to shrink where each part of training_parts is the largest.
SHRINK = {"activations": "model.block_size, train.batch_size, model.n_layer or model.n_embd",
          "attention maps": "model.block_size (the maps grow as its square) or train.batch_size",
          "mtp logits": "model.mtp_depth, model.block_size or train.batch_size"}


def _largest_part(cfg, parts: dict[str, int]) -> str:
    """What dominates the estimate, in words, and the fields to shrink."""
    part = max(parts, key=parts.get)
    share = f"{parts[part] / 2**30:,.3g} GiB of it"
    m, b = cfg.model, cfg.train.batch_size
    maps = parts["attention maps"] // (5 * b * m.block_size ** 2)
    if part == "weights":
        largest = model_sizes(m)[2]
        return (f"the weights and their optimizer state are {share}; " + (
            f"the largest tensor is {largest}: make the field that sizes it, or " if largest
            else "make ") + "model.n_layer or model.n_embd smaller")
    what = {"activations": f"the activations backward keeps ({m.n_layer + m.mtp_depth} layers "
                           f"x {m.block_size:,} positions x {m.n_embd:,} wide, at batch {b})",
            "attention maps": f"the attention maps ({maps:,} of them across the layers, "
                              f"each {m.block_size:,} x {m.block_size:,} scores: "
                              f"model.block_size squared, at batch {b})",
            "mtp logits": f"multi-token prediction's logits ({m.mtp_depth} x {m.block_size:,} "
                          f"positions x {m.vocab_size:,} tokens, at batch {b})"}[part]
    fewer = ""
    if part == "attention maps":            # the heads that keep a map: a sparse layer's indexer too
        indexer = any(getattr(MECHANISMS[n.strip()].layer, "selects_keys", False)
                      for n in m.mechanism.split(","))
        fewer = ", or keep fewer maps (model.n_head" + (", model.indexer_heads" if indexer else "") + ")"
    return f"{what} are {share}: make {SHRINK[part]} smaller{fewer}"


def available_bytes(device) -> int | None:
    """Memory free for this run on the device: the GPU's free memory, or the host's
    available memory for a CPU; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def refuse_what_cannot_fit(cfg, device) -> None:
    """Refuse, in one line, a run whose training cannot fit in the device's free memory,
    naming the part of the estimate that dominates it and the fields that shrink it."""
    params, parts = training_parts(cfg)
    need, have = sum(parts.values()), available_bytes(device)
    if have is not None and need > have:
        raise ConfigError(
            f"this model has about {params:,.3g} parameters and training it takes at least "
            f"{need / 2**30:,.3g} GiB (weights, gradients, optimizer state and activations at "
            f"batch {cfg.train.batch_size}), but this {device.type} has {have / 2**30:,.1f} GiB "
            f"free; {_largest_part(cfg, parts)} (python train.py --budget TIME picks a size "
            "that fits)")


def heads_for(n_embd: int) -> int:
    """Heads of 32 dimensions up to 256 wide, of 64 beyond (GPT-2's head size)."""
    return max(1, n_embd // (32 if n_embd <= 256 else 64))


@dataclass
class Candidate:
    n_layer: int
    n_embd: int
    params: int                  # non-embedding parameters (the scaling-law count)
    flops_per_token: int
    tokens_per_s: float = 0.0    # estimated from the measured FLOP/s
    tokens: float = 0.0          # in the training time
    ratio: float = 0.0           # tokens per parameter


def sized(model_cfg, n_layer: int, n_embd: int):
    return replace(model_cfg, n_layer=n_layer, n_embd=n_embd, n_head=heads_for(n_embd),
                   n_kv_head=0)


def candidates(model_cfg) -> list[Candidate]:
    from model import GPT
    out = []
    for n_layer, n_embd in LADDER:                  # sizes only: no memory, no init time
        m = GPT.skeleton(sized(model_cfg, n_layer, n_embd))
        out.append(Candidate(n_layer, n_embd, m.num_params(non_embedding=True),
                             m.flops_per_token()))
    return out


def choose(cands: list[Candidate], flops_per_s: float, train_s: float) -> Candidate:
    """The candidate whose tokens per parameter is closest to TOKENS_PER_PARAM (in log
    ratio), given the sustained FLOP/s and the seconds of training."""
    for c in cands:
        c.tokens_per_s = flops_per_s / c.flops_per_token
        c.tokens = c.tokens_per_s * train_s
        c.ratio = c.tokens / c.params
    return min(cands, key=lambda c: abs(math.log(c.ratio / TOKENS_PER_PARAM)))


def choose_readout(model_cfg, counts: torch.Tensor, log=print) -> None:
    """The adaptive softmax (model/readout.py) where it at least halves the output
    layer's work and that layer is a fifth or more of the model's (READOUT_SHARE): a
    large vocabulary whose frequent tokens are few, such as Chinese characters. An
    alphabet keeps the full layer: a few percent of the work, nothing worth saving, and
    the adaptive one cannot be exported (docs/benchmarks.md, "The adaptive readout")."""
    if not READOUTS[model_cfg.readout].plain or model_cfg.zero_head or model_cfg.logit_softcap:
        return
    d, vocab = model_cfg.n_embd, model_cfg.vocab_size
    shortlist = shortlist_for(counts)
    full = head_macs(d, vocab)
    blocks = 12 * model_cfg.n_layer * d * d             # a block's matrices: 12·d² a token
    if shortlist >= vocab or head_macs(d, vocab, shortlist) > 0.5 * full \
            or full < READOUT_SHARE * (blocks + full):
        return
    adaptive = next(name for name, r in READOUTS.items() if r.shortlisted)
    model_cfg.readout, model_cfg.readout_shortlist, model_cfg.tie_embeddings = adaptive, shortlist, False
    log(f"readout: adaptive softmax, the {shortlist:,} most frequent of {vocab:,} tokens "
        f"({SHORTLIST_COVERAGE:.0%} of the training text) in its shortlist: "
        f"{head_macs(d, vocab, shortlist) / head_macs(d, vocab):.0%} of the full output "
        "layer's work; no transformers architecture has one, so to export the run give "
        "--model.readout=full")


def measure(cfg, device, dtype, seconds: float, batch=None, counts=None) -> float:
    """Training steps per second of cfg.model at cfg.train's batch, for about `seconds`
    after one warm-up step, on `batch` (x, y) or on random tokens. An adaptive readout
    must be timed on real text ranked by the training tokens' `counts`: its tail works
    only for the rare tokens, and uniformly random ones are mostly rare."""
    from engine.device import autocast, synchronize
    from engine.optim import configure_optimizer
    from model import GPT
    train_cfg = cfg.train
    model = GPT(built_for(cfg.model, device, dtype)).to(device)     # the kernel the run will run
    opt = configure_optimizer(model, train_cfg, device)
    ctx = autocast(device, dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    if batch is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.model.vocab_size, (train_cfg.batch_size, cfg.model.block_size), generator=g)
        batch = (x, x)
    x, y = (t.to(device) for t in batch)
    if counts is not None and READOUTS[model.config.readout].shortlisted:
        model.adaptive.set_frequencies(counts)

    def step():
        for _ in range(train_cfg.grad_accum):
            with ctx:
                loss = model(x, y).loss
            loss.backward()
        opt.step(scaler)
        opt.zero_grad()

    step()
    synchronize(device)
    steps, start = 0, time.perf_counter()
    while steps < 2 or time.perf_counter() - start < seconds:
        step()
        synchronize(device)
        steps += 1
        if steps >= 50:
            break
    return steps / (time.perf_counter() - start)


def probe_again_if_busy(probe, log, read=read_machine, cores: int | None = None):
    """probe()'s (steps/s, FLOP/s), taken a second time where other programs held a core
    while it ran, and the faster kept: the size it chooses is for the whole run, and a
    burst of load (a browser tab, a build finishing) would choose a smaller model than
    the machine trains once it is gone. Load through both probes is said, with what it
    costs. The plan is then the run's config: the run is as reproducible as any other."""
    cores = cores or os.cpu_count() or 1
    results = []
    for _ in range(2):
        before = read()
        results.append(probe())
        other = other_cores(before, read(), cores)
        if other is None or other < HELD:
            break
    else:
        log(f"budget: other programs held {other:.1f} of {cores} cores while this machine was "
            "measured, twice: the size below fits a machine this busy; with nothing else "
            "running, the same time trains a larger model")
    return max(results)


def plan(cfg, budget_s: float, started: float, log=print,
         given: dict[str, dict[str, str]] | None = None):
    """Set cfg's model size and schedule for a run that ends `budget_s` seconds after
    `started` (a time.perf_counter() value). What the command line named (`given`, its
    options by section) stays as it is: a readout, and the PLAN_DEFAULTS. The precision
    is the machine's kind's (engine/machine.py), written into the config with the rest
    of the plan. Returns cfg."""
    from engine.device import pick_device
    from data.tokens import Batches, load_tokens

    given = given or {}
    data_cfg, train_cfg = cfg.data, cfg.train
    device = pick_device(train_cfg.device)
    fix_threads(train_cfg, say=lambda line: None)    # the run's count, said at set-up
    take_plan_defaults(cfg, device, given, log)
    data = load_tokens(data_cfg.path, data_cfg.tokenizer, data_cfg.vocab_size, data_cfg.val_fraction, data_cfg.cache_dir, log=log)
    cfg.model.vocab_size = data.tokenizer.vocab_size
    counts = torch.from_numpy(data.train.counts(cfg.model.vocab_size))
    if not any(k in given.get("model", {}) for k in READOUT_OPTIONS):
        choose_readout(cfg.model, counts, log)
    # Each probe: 0.5% of the budget. Half a second already times a step closely enough
    # to choose the size (the rungs are 2-10x apart), and the schedule follows the clock
    # anyway (docs/benchmarks.md, "The --budget probe").
    probe_s = min(10.0, max(SHORTEST_PROBE_S, 0.005 * budget_s))
    batch = Batches(data.train, train_cfg.batch_size, cfg.model.block_size, seed=0).next()
    tokens_per_step = train_cfg.batch_size * train_cfg.grad_accum * cfg.model.block_size

    def step_rate(model_cfg) -> tuple[float, float]:
        dtype = pick_dtype(train_cfg.dtype, device, model_cfg.n_embd,
                           experts=routes_experts(model_cfg))
        rate = measure(replace(cfg, model=model_cfg), device, dtype, probe_s, batch, counts)
        from model import GPT
        return rate, rate * tokens_per_step * GPT.skeleton(model_cfg).flops_per_token()

    _, flops_per_s = (probe_again_if_busy(lambda: step_rate(cfg.model), log)
                      if device.type == "cpu" else step_rate(cfg.model))
    left = budget_s - (time.perf_counter() - started)
    train_s = left * (1 - EVAL_SHARE) - MARGIN_S - probe_s * 1.5      # the probe below
    if train_s < MIN_TRAIN_S:
        raise ConfigError(f"a budget of {seconds(budget_s)} leaves {seconds(max(train_s, 0))} to "
                          "train after measuring this machine; give more (a minute or more "
                          "trains a model worth sampling)")
    pick = choose_size(cfg, device, flops_per_s, train_s, budget_s, log)
    if train_cfg.dtype == "auto":            # the kind's precision, recorded with the plan
        train_cfg.dtype = dtype_name(pick_dtype("auto", device, cfg.model.n_embd,
                                                experts=routes_experts(cfg.model)))
    # Small models run below the FLOP/s the probe found: time the chosen one itself.
    steps_per_s = step_rate(cfg.model)[0]
    schedule(cfg, len(data.train), len(data.val), pick, steps_per_s,
             budget_s - (time.perf_counter() - started), budget_s, log)
    return cfg


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def take_plan_defaults(cfg, device, given: dict, log) -> None:
    """The PLAN_DEFAULTS that apply on this device, where the command line named none."""
    taken = []
    for (section, key), (value, applies, what) in PLAN_DEFAULTS.items():
        if key not in given.get(section, {}) and applies(cfg, device):
            if getattr(getattr(cfg, section), key) != value:
                taken.append(f"{section}.{key}={value} ({what})")
            setattr(getattr(cfg, section), key, value)
    if taken:
        log(f"set for a budget run on this {device.type}, each lower in the same time on small "
            f"corpora (docs/benchmarks.md): {'; '.join(taken)}; give one on the command line "
            "to keep your own")


def choose_size(cfg, device, flops_per_s: float, train_s: float, budget_s: float, log) -> Candidate:
    """The rung of the ladder whose tokens per parameter in train_s come closest to the
    target, set on cfg.model, with the table it was chosen from."""
    cands = candidates(cfg.model)
    pick = choose(cands, flops_per_s, train_s)
    log(f"budget {seconds(budget_s)}: this {device.type} sustains {flops_per_s / 1e12:.3f} TFLOP/s "
        f"on the preset's model; {train_s:.0f} s left to train. Sizes (non-embedding "
        f"parameters, tokens in that time, tokens per parameter; the target is "
        f"{TOKENS_PER_PARAM:.0f}, half Chinchilla's compute-optimal 20 at these small sizes):")
    for c in cands:
        mark = "  <- chosen" if c is pick else ""
        log(f"  {c.n_layer:>2} layers x {c.n_embd:>4} wide: {c.params / 1e6:8.2f}M params, "
            f"{c.tokens / 1e6:9.1f}M tokens, {c.ratio:8.1f} tokens/param{mark}")
    cfg.model = sized(cfg.model, pick.n_layer, pick.n_embd)
    cfg.model.validate()
    return pick


def schedule(cfg, n_train: int, n_val: int, pick: Candidate, steps_per_s: float, left: float,
             budget_s: float, log) -> None:
    """Evaluations, steps, batch, warm-up and time limit for `left` seconds at the chosen
    model's measured rate."""
    train_cfg = cfg.train
    eval_step_s = 1 / steps_per_s / train_cfg.grad_accum / 3               # forward only: ~1/3 of a step
    # The last evaluation, the run's result, reads the whole validation split where half the
    # evaluations' share of the budget affords it: a sample misjudges the loss by a few
    # hundredths either way (of one run on tiny Shakespeare, 20 spaced batches of 16 x 128
    # said 1.517, the whole 1.497). The ones before only show the way and write
    # checkpoints: a sample of BETWEEN_SHARE of those batches, the time saved trains.
    whole = math.ceil(n_val / (train_cfg.batch_size * cfg.model.block_size))
    train_cfg.final_eval_iters = int(max(2, min(whole, EVAL_SHARE * budget_s / 2 / eval_step_s)))
    train_cfg.eval_iters = max(2, int(train_cfg.final_eval_iters * BETWEEN_SHARE))
    eval_s = (train_cfg.final_eval_iters + (EVALS - 1) * train_cfg.eval_iters) * eval_step_s
    steps = max(1, int((left - eval_s - MARGIN_S) * steps_per_s * OVERPLAN))
    # Too few optimizer steps leave no room for warm-up and decay: trade batch for steps
    # (a step on half the batch takes about half the time).
    batch_note = f"batch {train_cfg.batch_size}"
    while steps < MIN_STEPS and train_cfg.batch_size >= 2 * MIN_BATCH:
        train_cfg.batch_size //= 2
        steps *= 2
        train_cfg.eval_iters *= 2            # the same tokens per evaluation, in the same time
        train_cfg.final_eval_iters *= 2
        eval_step_s /= 2
        batch_note = f"batch halved to {train_cfg.batch_size} for at least {MIN_STEPS} steps"
    # Under a time limit the schedule follows the clock (engine.loop.schedule_step: the
    # share of the limit spent times max_iters), and so do the evaluations, so max_iters
    # is only a ceiling: CEILING times the steps planned, the run still uses its whole
    # time when the probe, on a busy machine, underestimates the speed several times over.
    # The step counts of the schedule are in the same units, scaled alike, so that the
    # warm-up and Muon's momentum take the share of the time they would over the steps
    # planned.
    train_cfg.max_iters = steps * CEILING
    train_cfg.warmup_iters = min(train_cfg.warmup_iters, max(1, steps // 10)) * CEILING
    train_cfg.muon_momentum_warmup *= CEILING
    train_cfg.eval_interval = max(1, math.ceil(train_cfg.max_iters / (EVALS - 1)))
    train_cfg.log_interval = max(1, min(train_cfg.log_interval, steps // 20))     # real steps
    train_cfg.time_limit = max(1.0, left - train_cfg.final_eval_iters * eval_step_s - MARGIN_S)
    log_chosen(cfg, pick, steps, steps_per_s, batch_note, n_train, log)


def log_chosen(cfg, pick: Candidate, steps: int, steps_per_s: float, batch_note: str,
               n_train: int, log) -> None:
    train_cfg = cfg.train
    tokens_per_step = train_cfg.batch_size * train_cfg.grad_accum * cfg.model.block_size
    epochs = steps * tokens_per_step / max(n_train, 1)
    log(f"chosen: {pick.n_layer} layers, {cfg.model.n_head} heads, {pick.n_embd} wide "
        f"({pick.params / 1e6:.2f}M non-embedding parameters, {train_cfg.dtype}); measured "
        f"{steps_per_s:.2f} steps/s -> about {steps} steps of {tokens_per_step:,} tokens "
        f"({batch_note}, {steps * tokens_per_step / pick.params:.1f} tokens/param, {epochs:.1f} "
        f"epochs of the training split, "
        f"{'in passes' if cfg.data.sampling == 'epochs' else 'at random'}; as many more as "
        f"come in the time, up to {train_cfg.max_iters}), {train_cfg.final_eval_iters} "
        f"validation batches at the end ({train_cfg.eval_iters} before), training stops by "
        f"{seconds(train_cfg.time_limit)} from now")
