"""A run that starts from another's weights (train.init_from): the source's model and
tokenizer (`Pretrained`), and the run's config made to fit them (`adopt_source`), an
override that would change the architecture or the tokenizer refused by name."""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.errors import ConfigError
from engine.config import RunConfig, apply_to
from engine.objectives import OBJECTIVES
from data.tokenizer import TOKENIZERS, Tokenizer
from model import GPT


# Model fields a fine-tuning run may change: the same weights fit (causal only changes
# which positions a query sees).
SWAPPABLE_MODEL_FIELDS = ("attention", "dropout", "causal")


@dataclass
class Pretrained:
    """The weights and tokenizer a run starts from (train.init_from), as against the
    corpus it trains on (data.sources)."""
    model: GPT
    tokenizer: Tokenizer


def adopt_source(cfg: RunConfig, model_overrides: dict[str, str],
                 train_overrides: dict[str, str] | None = None,
                 data_overrides: dict[str, str] | None = None) -> Pretrained:
    """Load train.init_from and make cfg's model its model: the architecture comes from
    the source, and a command-line override that would change it is refused. An encoder
    (model.causal=false) keeps its bidirectional objective unless the command line names
    one. The run records its parent (path and a hash of its weights)."""
    from engine.inference import load_run
    from engine.interop import describe_parent
    src = cfg.train.init_from
    model, source_cfg, tokenizer, _ = load_run(src, "best")
    if tokenizer.kind not in TOKENIZERS:
        # The data pipeline encodes a corpus with the tokenizers it can build (char, BPE);
        # a BERT-family folder's WordPiece is read for the tools, not for training.
        raise ConfigError(f"{src} is a BERT-family encoder with a {tokenizer.kind} tokenizer; "
                          "train.py fine-tunes GPT-2/Llama-family folders and runs trained "
                          "here, encoders included (see docs/interop.md)")
    wanted = replace(source_cfg.model)                 # a copy the overrides go into
    apply_to(wanted, "model", model_overrides, "the command line")
    conflicts = [f"model.{k}={getattr(wanted, k)!r} (the source has {getattr(source_cfg.model, k)!r})"
                 for k in model_overrides
                 if k not in SWAPPABLE_MODEL_FIELDS and getattr(wanted, k) != getattr(source_cfg.model, k)]
    if conflicts:
        raise ConfigError("with train.init_from the model comes from its source, and these "
                          f"overrides would change it: {'; '.join(conflicts)}; drop them (only "
                          f"{', '.join(SWAPPABLE_MODEL_FIELDS)} may change), or train a new model")
    cfg.model = wanted
    if "objective" not in (train_overrides or {}) and not wanted.causal:
        # The preset's next-token objective would let every position see the token it
        # is asked for; an encoder goes on with what it was trained on (a folder: the
        # bidirectional objective, the only one its head fits).
        own = source_cfg.train.objective
        cfg.train.objective = own if OBJECTIVES[own].bidirectional else next(
            name for name, o in OBJECTIVES.items() if o.bidirectional)
    if not OBJECTIVES[cfg.train.objective].bidirectional and not wanted.causal:
        raise ConfigError(f"{src} is an encoder (model.causal=false), and "
                          f"train.objective={cfg.train.objective} would let every position see "
                          "the token it is asked to predict; drop --train.objective (the "
                          "encoder's own is kept) or add --model.causal=true")
    named = (data_overrides or {}).get("tokenizer")
    if named is not None and named != tokenizer.kind:
        # The embedding's rows are the source's tokens: another tokenizer would read them
        # as other tokens, so it is refused rather than dropped.
        raise ConfigError(f"with train.init_from the tokenizer comes from its source ({src}: "
                          f"{tokenizer.kind}, {tokenizer.vocab_size:,} tokens), and "
                          f"--data.tokenizer={named} would give its embeddings other tokens; "
                          "drop it, or train a new model with that tokenizer")
    cfg.data.tokenizer = tokenizer.kind
    cfg.parent = describe_parent(cfg.train.init_from, model)
    cfg.validate()
    return Pretrained(model, tokenizer)
