"""The run configuration: one dataclass per concern, one place for every default.

    python train.py --config cpu --model.n_layer=6 --train.lr 3e-4

A preset (configs/NAME.toml) overrides some defaults; `--section.key=value` overrides
anything after that (engine/cli.py turns these fields into the command line). Every
value is checked against its field's type, every variant name against its registry,
and an unknown key is refused with the valid ones listed, all before any work starts.
"""
from __future__ import annotations

import copy
import json
import math
import tomllib
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePath

from common.errors import ConfigError, choices_hint
from common.fields import opt
from common.files import odd_kind
from data.tokenizer import TOKENIZERS
from data.tokens import SAMPLINGS
from engine.machine import CPU_KINDS
from engine.objectives import OBJECTIVES
from engine.optim import LR_SCHEDULES
from model import REGISTRIES, ModelConfig, ModelError
from model import registry as model_registry
from model.mechanisms import MECHANISMS, names_used

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MAX_NEW_TOKENS = 1_000_000          # one sample.py call: hours of text on a CPU already
MAX_SAMPLES = 10_000                # one sample.py call: more is a loop of calls, each seeded
MAX_RUN_NAME = 200                  # bytes: a folder name is at most 255, and a branch adds to it

# The version a run config is saved with (config.json's "version"; none means 1). A
# config of an older version is migrated when it is read, so old runs and checkpoints
# load under today's names: RENAMED_IN[v] is what version v renamed, section by field.
CONFIG_VERSION = 3
RENAMED_IN = {
    # GELU named as torch and transformers name it: gelu the exact form, gelu_tanh the
    # approximation (before, gelu was the tanh form and gelu_erf the exact one).
    2: {"model": {"mlp": {"gelu": "gelu_tanh", "gelu_erf": "gelu"}}},
    # The CPU's attention routes became the engine's choice for `auto` (engine/machine.py).
    3: {"model": {"attention": {"cpu": "auto"}}},
}


@dataclass
class DataConfig:
    path: str = opt("", "corpus: a text file (.gz allowed), folder, glob, JSONL/CSV/Parquet, or a "
                    "folder from python -m data.prepare; empty = bundled Shakespeare")
    tokenizer: str = opt("char", "tokenizer", registry="tokenizer")
    vocab_size: int = opt(2048, "BPE vocabulary size (ignored by the char tokenizer)")
    val_fraction: float = opt(0.1, "share of the text, from its end, held out for validation")
    cache_dir: str = opt("", "where token files are cached; empty = data/cache")
    sampling: str = opt("random", "how training windows are drawn: " + "; ".join(
        f"{name}, {what}" for name, what in SAMPLINGS.items()) + " (--budget reads in "
        "epochs unless this is given)", choices=tuple(SAMPLINGS))


@dataclass
class TrainConfig:
    device: str = opt("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps")
    dtype: str = opt("auto", "autocast precision", choices=("auto", "float32", "bfloat16", "float16"))
    compile: bool = opt(False, "torch.compile the model (pays off on GPUs for long runs)")
    threads: int = opt(0, "torch's CPU threads, fixed for the whole run: 0 = decided at the start "
                          "from OMP_NUM_THREADS, else the cores; the number decided is recorded "
                          "in the run's config and a resume uses it")
    batch_size: int = opt(64, "sequences per micro-batch")
    grad_accum: int = opt(1, "micro-batches whose gradients add up to one optimizer step")
    batch_ramp: float = opt(0.0, "batch-size schedule: over this first share of the steps the "
                                 "batch grows linearly from a quarter of batch_size to all of "
                                 "it (more, cheaper steps early); 0 = off")
    max_iters: int = opt(5000, "optimizer steps")
    objective: str = opt("next", "what the model learns to predict: next (the next token, a "
                                 "language model) or mlm (BERT's masked tokens, an encoder: "
                                 "needs model.causal=false)", choices=tuple(OBJECTIVES))
    optimizer: str = opt("adamw", "adamw, or muon (Muon for hidden matrices, AdamW for the rest)",
                         choices=("adamw", "muon"))
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    min_lr: float = opt(1e-4, "learning rate at the end of the decay")
    schedule: str = opt("cosine", "decay after the warm-up: cosine, or wsd (warmup-stable-decay: "
                                  "the peak rate, then a linear decay over the last decay_frac)",
                        choices=tuple(LR_SCHEDULES))
    decay_frac: float = opt(0.3, "wsd: the share of the steps after warm-up spent decaying")
    warmup_iters: int = opt(100, "steps of linear warm-up from 0 to lr")
    indexer_warmup: int = opt(0, "sparse attention (DSA): the first N steps train only the "
                                 "lightning indexers, against dense attention, the rest of the "
                                 "model frozen (DeepSeek-V3.2's warm-up); 0 = sparse from step 0")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay (matrices only)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    muon_lr: float = opt(0.02, "peak learning rate of Muon's matrices (same schedule)")
    muon_momentum: float = opt(0.95, "Muon momentum")
    muon_momentum_warmup: int = opt(0, "steps over which Muon's momentum rises linearly from "
                                       "0.85 to muon_momentum (the modded-nanogpt speedruns); 0 = off")
    parallel: str = opt("ddp", "under torchrun: ddp (a whole model per process) or fsdp "
                               "(FSDP2: weights, gradients and optimizer state split across them)",
                        choices=("ddp", "fsdp"))
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off")
    eval_interval: int = opt(250, "evaluate and write a checkpoint every N steps")
    eval_iters: int = opt(100, "validation batches per evaluation")
    final_eval_iters: int = opt(0, "validation batches of the last evaluation (at max_iters or "
                                   "the time limit); 0 = eval_iters (train.py --budget reads the "
                                   "whole split there and a sample before)")
    target_val_loss: float = opt(0.0, "stop (with a checkpoint) once val loss reaches this; 0 = off")
    time_limit: float = opt(0.0, "stop with a final evaluation and checkpoint after this many "
                                 "seconds of training, the lr schedule following steps or time, "
                                 "whichever is further along; 0 = off (train.py --budget sets it)")
    log_interval: int = opt(10, "write training metrics every N steps")
    seed: int = opt(1337, "random seed (weights, batches, dropout)")
    init_from: str = opt("", "start from these weights (a run directory, checkpoint folder or "
                             "transformers folder) with a fresh optimizer and schedule; the "
                             "model config and tokenizer come from it")
    out_dir: str = opt("runs", "folder that holds run directories")
    run_name: str = opt("", "run directory name; empty = <preset>-<date>-<time>")
    keep_last: int = opt(3, "checkpoints to keep (the best by val loss is always kept)")
    wandb: str = opt("disabled", "Weights & Biases logging", choices=("disabled", "offline", "online"))
    wandb_project: str = opt("attnlab", "wandb project name")


def decode_widths() -> str:
    """The width from which each CPU kind samples in bf16, for sample.dtype's help."""
    kinds = CPU_KINDS.items()
    return "; ".join([f"{name} from {kind.decode_bf16_from:,} wide" for name, kind in kinds
                      if kind.decode_bf16_from is not None]
                     + ["never on " + ", ".join(n for n, k in kinds if k.decode_bf16_from is None)])


@dataclass
class SampleConfig:
    prompt: str = opt("", "text to continue; empty = start of a new line (or document)")
    max_new_tokens: int = opt(500, "tokens to generate per sample")
    temperature: float = opt(0.8, "divide logits by this; 0 = greedy (always the likeliest "
                                  "token, which can loop: from an empty prompt a character "
                                  "model may write newline after newline; give a prompt)")
    top_k: int = opt(200, "keep only the k most likely tokens; 0 = all")
    top_p: float = opt(1.0, "keep the smallest set of tokens whose probability reaches p")
    seed: int = opt(1337, "random seed for sampling")
    num_samples: int = opt(1, "independent samples to draw")
    use_cache: bool = opt(True, "reuse keys/values of earlier tokens (KV cache)")
    decode: str = opt("auto", "how the KV cache is kept: auto (graph on CUDA, cache elsewhere), "
                              "cache (grows with the text), static (preallocated, one token per "
                              "step), graph (the static step replayed as a CUDA graph; CUDA only), "
                              "mtp (self-speculative: the model's multi-token prediction module "
                              "drafts the token after next and one pass checks both; needs "
                              "model.mtp_depth)",
                      choices=("auto", "cache", "static", "graph", "mtp"))
    dtype: str = opt("auto", "weights while sampling: auto (bfloat16 on a GPU that has it; on a "
                             "CPU, bfloat16 from a model width fixed for its kind, where one "
                             "token's matmuls were measured faster in it (engine/machine.py "
                             f"CPU_KINDS: {decode_widths()}; the width decides, no timing); "
                             "else float32), "
                             "float32, bfloat16 or float16",
                     choices=("auto", "float32", "bfloat16", "float16"))
    sinks: int = opt(0, "past the context, keep the first N tokens (attention sinks) and a "
                        "rolling window of the newest, renumbered, and stream for ever "
                        "(StreamingLLM, arXiv:2309.17453; positions that can be renumbered: "
                        + ", ".join(n for n, p in REGISTRIES["position"].items() if not p.absolute)
                        + "); 0 = re-read the newest half")
    explain: bool = opt(False, "show each step's top candidates before and after "
                               "temperature / top-k / top-p, and the token chosen")
    explain_top: int = opt(5, "candidates shown per step with explain")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    preset: str = ""
    parent: dict = field(default_factory=dict)    # the weights a fine-tuning run started from
    version: int = CONFIG_VERSION                 # of this layout and its names (migrate)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def validate(self, training: bool = True) -> None:
        """Refuses what no run could do; with `training`, also what this machine cannot
        train (a config read to sample or study a run trains nothing)."""
        try:
            model_registry.check(self.model)      # sizes, variant names, what variants need
        except ModelError as err:
            raise ConfigError(str(err)) from None
        _check_choices(self)
        train, sample = self.train, self.sample
        for name in ("batch_size", "grad_accum", "max_iters", "eval_interval",
                     "eval_iters", "log_interval", "keep_last"):
            if getattr(train, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(train, name)}")
        if train.threads < 0:
            raise ConfigError(f"train.threads must be 0 (decided at the start) or positive, got {train.threads}")
        if train.final_eval_iters < 0:
            raise ConfigError(f"train.final_eval_iters must not be negative, got {train.final_eval_iters}")
        if train.warmup_iters < 0:
            raise ConfigError(f"train.warmup_iters must not be negative, got {train.warmup_iters}")
        if train.indexer_warmup < 0:
            raise ConfigError(f"train.indexer_warmup must not be negative, got {train.indexer_warmup}")
        if train.indexer_warmup and not any(hasattr(MECHANISMS[n].layer, "dense_warmup")
                                            for n in names_used(self.model)):
            raise ConfigError(f"train.indexer_warmup trains a sparse layer's lightning indexer, "
                              f"and model.mechanism={self.model.mechanism} has none: add "
                              "--model.mechanism=sparse, or leave it 0")
        if train.muon_momentum_warmup < 0:
            raise ConfigError(f"train.muon_momentum_warmup must not be negative, got {train.muon_momentum_warmup}")
        if not (train.lr > 0 and train.muon_lr > 0):
            raise ConfigError(f"train.lr and train.muon_lr must be positive, got {train.lr}, {train.muon_lr}")
        if not 0 <= train.batch_ramp < 1:
            raise ConfigError(f"train.batch_ramp must be in [0, 1), got {train.batch_ramp}")
        if not 0 < train.decay_frac <= 1:
            raise ConfigError(f"train.decay_frac must be in (0, 1], got {train.decay_frac}")
        if not 0 <= train.min_lr <= train.lr:
            raise ConfigError(f"train.min_lr must be between 0 and train.lr={train.lr}, got {train.min_lr}")
        if not (0 <= train.beta1 < 1 and 0 <= train.beta2 < 1):
            raise ConfigError("train.beta1 and train.beta2 must be in [0, 1)")
        self._check_muon()
        name = train.run_name
        if name and (name in (".", "..") or "/" in name or "\\" in name or name.startswith("~")):
            raise ConfigError(f"train.run_name={name!r} must be a plain folder name inside "
                              "train.out_dir (no '/', '..' or '~'); set train.out_dir for "
                              "another place")
        if len(name.encode()) > MAX_RUN_NAME:      # a folder name's limit is 255 bytes
            raise ConfigError(f"train.run_name is {len(name.encode())} bytes long; give a name of "
                              f"at most {MAX_RUN_NAME} (a branch adds '-from-STEP' to it)")
        if not 0 <= train.seed < 2 ** 63:
            raise ConfigError(f"train.seed must be between 0 and 2**63 - 1, got {train.seed}")
        if train.time_limit < 0:
            raise ConfigError(f"train.time_limit must be 0 (off) or positive, got {train.time_limit}")
        for name in ("weight_decay", "grad_clip"):
            if getattr(train, name) < 0:
                raise ConfigError(f"train.{name} must not be negative, got {getattr(train, name)}")
        _check_train_fits_model(self, training)
        if not 0.0 < self.data.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1, got {self.data.val_fraction}")
        _check_sample(sample)

    def _check_muon(self) -> None:
        """What Muon, which orthogonalises whole two-dimensional matrices, cannot train."""
        train = self.train
        if train.parallel == "fsdp" and train.optimizer == "muon":
            raise ConfigError("train.parallel=fsdp splits each matrix across processes, and "
                              "Muon orthogonalises whole matrices: use train.optimizer=adamw "
                              "with fsdp, or train.parallel=ddp with muon")
        if train.optimizer == "muon" and getattr(REGISTRIES["mlp"][self.model.mlp], "routes_tokens", False):
            raise ConfigError(f"train.optimizer=muon orthogonalises two-dimensional matrices, and "
                              f"model.mlp={self.model.mlp} keeps each layer's experts stacked in "
                              "one tensor of three: use train.optimizer=adamw with it")


def _check_train_fits_model(cfg: RunConfig, training: bool) -> None:
    """Refuses a training objective the model's own choices rule out, and (`training`) a
    backend with no backward on the device training would use: a flex run trained on a
    GPU samples on a CPU, where flex's forward works."""
    train = cfg.train
    if OBJECTIVES[train.objective].bidirectional and cfg.model.causal:
        raise ConfigError(f"train.objective={train.objective} guesses a hidden token from "
                          "the words on both sides of it, and model.causal=true hides the "
                          "words after it; set model.causal=false (the encoder preset does)")
    backend = REGISTRIES["attention"][cfg.model.attention]
    if training and not backend.trains_on_cpu and train.device in ("cpu", "auto"):
        from engine.device import pick_device
        if pick_device(train.device).type == "cpu":
            trainable = ", ".join(n for n, b in REGISTRIES["attention"].items() if b.trains_on_cpu)
            raise ConfigError(f"model.attention={cfg.model.attention} has no backward on "
                              "CPU in torch (its forward works, for sampling); to train on "
                              f"a CPU use one of {trainable} (banded for sliding windows)")


def _check_sample(sample: SampleConfig) -> None:
    """Refuses sampling settings out of range or that contradict each other."""
    if sample.temperature < 0:
        raise ConfigError(f"sample.temperature must be 0 (greedy) or positive, got {sample.temperature}")
    if not 0.0 < sample.top_p <= 1.0:
        raise ConfigError(f"sample.top_p must be in (0, 1], got {sample.top_p}")
    for name in ("top_k", "max_new_tokens"):
        if getattr(sample, name) < 0:
            raise ConfigError(f"sample.{name} must not be negative, got {getattr(sample, name)}")
    if sample.num_samples <= 0:
        raise ConfigError(f"sample.num_samples must be at least 1, got {sample.num_samples}")
    if sample.max_new_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"sample.max_new_tokens={sample.max_new_tokens:,} is more than "
                          f"{MAX_NEW_TOKENS:,} tokens in one go; sample in several runs "
                          "(sample.seed differs each time) or ask for fewer")
    if sample.num_samples > MAX_SAMPLES:
        raise ConfigError(f"sample.num_samples={sample.num_samples:,} is more than {MAX_SAMPLES:,} "
                          "samples in one go; sample in several runs (sample.seed differs each "
                          "time) or ask for fewer")
    if sample.num_samples * sample.max_new_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"sample.num_samples={sample.num_samples:,} of sample.max_new_tokens="
                          f"{sample.max_new_tokens:,} is more than {MAX_NEW_TOKENS:,} tokens in "
                          "one go; sample in several runs (sample.seed differs each time) or ask "
                          "for fewer")
    if not 0 <= sample.seed < 2 ** 63:
        raise ConfigError(f"sample.seed must be between 0 and 2**63 - 1, got {sample.seed}")
    if sample.explain_top < 1:
        raise ConfigError(f"sample.explain_top must be at least 1, got {sample.explain_top}")
    if not sample.use_cache and sample.decode != "auto":
        raise ConfigError(f"sample.decode={sample.decode} says how to keep the KV cache, "
                          "and sample.use_cache=false turns the cache off: drop one of "
                          "the two")
    if sample.sinks:
        # Sinks live in a rolling KV cache: say so here, before generate() would raise.
        if sample.sinks < 0:
            raise ConfigError(f"sample.sinks must be 0 (off) or positive, got {sample.sinks}")
        if not sample.use_cache:
            raise ConfigError("sample.sinks keeps the first tokens in a rolling KV cache, "
                              "and sample.use_cache=false turns the cache off: drop one "
                              "of the two")
        if sample.decode in ("static", "graph"):
            raise ConfigError(f"sample.sinks decodes from a rolling cache that grows as "
                              f"it rolls, not a preallocated one: use sample.decode=cache "
                              f"(or auto) with sinks, not {sample.decode}")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
            "sample": SampleConfig}


def choices_of(f) -> tuple | None:
    """The valid values of a config field: its registry's names, its fixed choices, or
    None for a free value."""
    registry = f.metadata.get("registry")
    if registry == "tokenizer":
        return tuple(TOKENIZERS)
    if registry:
        return tuple(REGISTRIES[registry])
    return f.metadata.get("choices")


def _check_choices(cfg: RunConfig) -> None:
    """Choices of every section but the model's (model.registry.check has those)."""
    for section, cls in SECTIONS.items():
        if cls is ModelConfig:
            continue
        obj = getattr(cfg, section)
        for f in fields(cls):
            value, choices = getattr(obj, f.name), choices_of(f)
            if choices is not None and value not in choices:
                raise ConfigError(f"unknown {section}.{f.name} {value!r}" + choices_hint(value, choices))


def field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


# The words the command line reads as a switch (any capitals); the message of a word
# it refuses lists them all.
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
WORDS = ", ".join(f"{t}/{f}" for t, f in list(zip(TRUE_WORDS, FALSE_WORDS))[1:])


def convert(key: str, raw, typ: type, typed: bool = False):
    """Convert a command-line string (or a TOML/JSON value) to the field's type. A file
    (`typed`) writes a switch as a boolean: a string there ("yes", "false") is refused,
    where the command line's words (true/false, yes/no, on/off, 1/0) are read."""
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if typed:
            got = f"the string {raw!r}" if isinstance(raw, str) else repr(raw)
            raise ConfigError(f"{key} takes true or false, written without quotes in a file "
                              f"(the command line also reads {WORDS}), got {got}")
        if isinstance(raw, str) and raw.lower() in TRUE_WORDS:
            return True
        if isinstance(raw, str) and raw.lower() in FALSE_WORDS:
            return False
        raise ConfigError(f"{key} must be true or false (or {WORDS}), got {raw!r}")
    if typ is int:
        if isinstance(raw, bool) or isinstance(raw, float):
            raise ConfigError(f"{key} must be an integer, got {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    if typ is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{key} must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {raw!r}")
        return value
    if typ is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{key} must be a string, got {raw!r}")
        return raw
    raise ConfigError(f"{key} has an unsupported type {typ}")


def apply(cfg: RunConfig, section: str, values: dict, origin: str, typed: bool = False) -> None:
    """Set section.key = value for each entry, checking keys and types (`typed`: read
    from a TOML or JSON file, whose values carry their type)."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in {origin}"
                          + choices_hint(section, SECTIONS))
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] in {origin} must be a table of key = value")
    apply_to(getattr(cfg, section), section, values, origin, typed)


def apply_to(obj, section: str, values: dict, origin: str, typed: bool = False) -> None:
    types = field_types(SECTIONS[section])
    helps = {f.name: f.metadata.get("help", "") for f in fields(SECTIONS[section])}
    for key, raw in values.items():
        if key not in types:
            raise ConfigError(f"unknown key {section}.{key} in {origin}" + choices_hint(key, types))
        try:
            value = convert(f"{section}.{key}", raw, types[key], typed)
        except ConfigError as err:   # a value of the wrong kind: say what the option takes
            said = f"{err} ({section}.{key}: {helps[key]})" if helps[key] else str(err)
            raise ConfigError(f"{origin}: {said}" if typed else said) from None
        setattr(obj, key, value)


def preset_path(name: str) -> Path:
    """configs/NAME.toml for a preset's name; a path the user gives to a .toml file of
    their own as it is. A name stays a name: `..` or a folder in it would read a file
    outside configs/ (../../etc/passwd as TOML), and a file in the working folder that
    happens to be called `cpu` is not the cpu preset."""
    path = Path(name)
    if path.suffix == ".toml":
        return path
    if not name or "\0" in name or path.name != name or name in (".", ".."):
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"--config {name[:200]!r} is neither a preset's name nor a .toml "
                          f"file: give a name from configs/ ({', '.join(available)}) or the "
                          "path to a .toml file of your own")
    return CONFIG_DIR / f"{name}.toml"


def load_preset(cfg: RunConfig, name: str) -> None:
    path = preset_path(name)
    if kind := odd_kind(path):        # found by stat: opening a named pipe waits for a writer
        raise ConfigError(f"--config {path} is {kind}, not a regular file; give a preset's "
                          "name from configs/ or the path to a .toml file")
    if not path.is_file():
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"no preset {name!r} (looked for {path})" + choices_hint(name, available))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"preset {path} is not valid TOML: {err}") from None
    if not data:
        available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
        raise ConfigError(f"preset {path} sets nothing, so the run would take the built-in "
                          "defaults, which no preset is; write fields under [model] and [train] "
                          f"in it, or give a preset's name ({', '.join(available)})")
    for section, values in data.items():
        apply(cfg, section, values, str(path), typed=True)
    refuse_folders_outside(cfg, path)
    cfg.preset = path.stem


# The folders a run writes into. A config file may be shared, so what it names stays below
# the folder the command runs from; a user who wants a run elsewhere says so on the
# command line, where it is their own choice.
WRITTEN_FOLDERS = (("train", "out_dir"), ("data", "cache_dir"))


def refuse_folders_outside(cfg: RunConfig, path: Path) -> None:
    for section, key in WRITTEN_FOLDERS:
        folder = getattr(getattr(cfg, section), key)
        where = PurePath(folder)
        if folder and (where.is_absolute() or ".." in where.parts or folder.startswith("~")):
            raise ConfigError(f"{path} sets {section}.{key}={folder!r}, outside the folder this "
                              "command runs from: a config file may name only a folder below it "
                              "(a relative path without '..'); to write there, give "
                              f"--{section}.{key}={folder} on the command line")


def migrate(data: dict, origin: str) -> dict:
    """A saved config (config.json of a run or checkpoint) brought to CONFIG_VERSION: the
    renames of every later version applied in order. The file itself is left as it is
    (a checkpoint's hash covers it)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} does not hold a config object")
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"{origin} has version {version!r}; a run config's version is a "
                          "whole number from 1 (or absent, for the first)")
    if version > CONFIG_VERSION:
        raise ConfigError(f"{origin} is a version {version} config, newer than this attnlab "
                          f"reads (version {CONFIG_VERSION}); update attnlab to load it")
    data = copy.deepcopy(data)
    for later in range(version + 1, CONFIG_VERSION + 1):
        for section, renames in RENAMED_IN.get(later, {}).items():
            values = data.get(section)
            for key, names in renames.items():
                if isinstance(values, dict) and isinstance(values.get(key), str):
                    values[key] = names.get(values[key], values[key])
    data["version"] = CONFIG_VERSION
    return data


def from_dict(data: dict, origin: str) -> RunConfig:
    """Rebuild a saved config (config.json of a run), migrated from an older version;
    missing keys keep their defaults."""
    cfg = RunConfig()
    for section, values in migrate(data, origin).items():
        if section == "preset":
            cfg.preset = str(values)
        elif section == "parent":
            cfg.parent = dict(values) if isinstance(values, dict) else {}
        elif section != "version":
            apply(cfg, section, values, origin, typed=True)
    cfg.validate(training=False)      # to sample or study; a resume checks it again to train
    return cfg


def describe(cfg: RunConfig) -> str:
    """The resolved config, one line per section."""
    lines = []
    for section, values in cfg.to_dict().items():
        if isinstance(values, dict):
            lines.append(f"  {section}: " + " ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)
