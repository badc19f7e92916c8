"""Loading a model (a run of this project, or a folder in transformers' format) for
sampling and the tools, and streaming its text as it is generated."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import torch

from engine import checkpoint
from engine.config import RunConfig, from_dict
from common.errors import CheckpointError, ConfigError, TokenizerError
from common.shell import word
from data.tokenizer import Tokenizer
from model import GPT, ModelError
from model.decode import graph_refusal
from model.sampling import next_token_distribution


def load_run(path: str | Path, which: str = "best", device: str | torch.device = "cpu",
             before_build=None, log=None):
    """(model in eval mode, its RunConfig, its tokenizer, the checkpoint folder) from a
    run directory, a checkpoint folder, or a transformers folder (GPT-2, Llama,
    Mistral, GPT-NeoX: engine/interop.py). `before_build(cfg)` runs once the saved
    config is read, before the model is built (a script binding registry entries of
    its own, such as the exercises' `yours`). `log` gets one line saying which
    checkpoint of a run is used and why; without it, that line goes to stderr only when
    the choice is not the one asked for (checkpoint.choose). `which` (best, latest or a
    step) picks among a run's checkpoints: beside a folder that holds one set of
    weights, `best` reads them, and latest or a step is refused rather than ignored."""
    from engine.interop import is_hf_folder, load_hf_folder
    if wrong := checkpoint.misplaced(Path(path)):
        raise CheckpointError(wrong)
    hf = is_hf_folder(path)
    single = ("a transformers folder" if hf else
              "one checkpoint folder" if (Path(path) / "state.json").is_file() else None)
    if which != "best" and single:
        run = Path(path).parent.parent if Path(path).parent.name == checkpoint.CKPT_DIR else None
        raise CheckpointError(f"--checkpoint {which} picks one of a run's checkpoints, and {path} "
                              f"is {single}, with one set of weights; leave --checkpoint out"
                              + (f", or give its run: --run {word(run)} --checkpoint {which}" if run else ""))
    if hf:
        model, model_cfg, tokenizer = load_hf_folder(path, device)
        cfg = RunConfig(model=model_cfg)
        cfg.data.tokenizer = tokenizer.kind
        return model, cfg, tokenizer, Path(path)
    ckpt, why, departs = checkpoint.choose(path, which)
    if log is not None or departs:
        (log or (lambda line: print(line, file=sys.stderr)))(f"checkpoint: {ckpt} ({why})")
    cfg, tokenizer = checked_run_files(ckpt)
    if before_build is not None:
        before_build(cfg)
    weights, _, _ = checkpoint.load(ckpt, train_state=False)
    checkpoint.refuse_misfit(GPT.skeleton(cfg.model), weights, ckpt)
    model = GPT(cfg.model)
    checkpoint.load_weights(model, weights, ckpt)
    return model.to(device).eval(), cfg, tokenizer, ckpt


def checked_run_files(ckpt: Path) -> tuple[RunConfig, Tokenizer]:
    """A checkpoint's config and tokenizer, each checked before it costs memory: the
    config against its schema and the memory the model it describes would take, the
    tokenizer against the config's vocabulary. Every path that builds a model from a
    run's files (sampling, the tools, train.init_from) reads them here."""
    from engine.interop import read_run_tokenizer
    cfg_path = ckpt / "config.json"
    try:
        cfg: RunConfig = from_dict(checkpoint.run_config_json(ckpt), str(cfg_path))
    except (ConfigError, ModelError) as err:
        raise CheckpointError(f"checkpoint file {cfg_path} is an unreadable config ({err}); "
                              f"{checkpoint.use_another(ckpt)}") from None
    checkpoint.refuse_too_large_model(cfg.model, cfg_path)
    tokenizer = read_run_tokenizer(ckpt, cfg.model)
    refuse_a_tokenizer_not_its_own(tokenizer, cfg, ckpt)
    return cfg, tokenizer


def refuse_a_tokenizer_not_its_own(tokenizer: Tokenizer, cfg: RunConfig, ckpt: Path) -> None:
    """A run that learned its tokenizer sized its embedding table by it, so one token
    fewer means the file is another run's: the model would sample ids it cannot name.
    A run from pretrained weights keeps their vocabulary, which may be padded past it."""
    if cfg.train.init_from or cfg.parent or tokenizer.vocab_size == cfg.model.vocab_size:
        return
    raise TokenizerError(
        f"{ckpt / 'tokenizer.json'} has {tokenizer.vocab_size:,} tokens but config.json's "
        f"vocab_size is {cfg.model.vocab_size:,}, and this run built its model for its own "
        f"tokenizer: the file is edited or another run's; {checkpoint.use_another(ckpt)}")


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids for a prompt. An empty prompt starts a new line (character models)
    or a new document (BPE models, from the end-of-text token)."""
    if prompt:
        return tokenizer.encode(prompt)
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    if tokenizer.can_encode("\n"):
        return tokenizer.encode("\n")
    raise TokenizerError("the prompt is empty and this vocabulary has no newline to start "
                         "from; give a prompt with --prompt")


def pick_decode(decode: str, device, model=None) -> str:
    """`auto`: on CUDA the static cache's step recorded as a CUDA graph (one launch per
    token instead of ~100 kernels, which bound batch-1 decoding of a small model
    there), or the static cache stepped eagerly for a `model` whose step cannot be
    recorded (model.decode.graph_refusal); elsewhere the growing cache, which reads only
    the keys it has."""
    on_cuda = torch.device(device).type == "cuda"
    if decode == "graph" and not on_cuda:
        raise ConfigError("sample.decode=graph records a CUDA graph and needs a CUDA device; "
                          "use --decode static or --decode cache here")
    if decode == "graph" and model is not None and graph_refusal(model):
        raise ConfigError(f"sample.decode=graph replays one recorded step, and "
                          f"{graph_refusal(model)}: use --decode static or --decode cache")
    if decode != "auto":
        return decode
    if on_cuda:
        return "static" if model is not None and graph_refusal(model) else "graph"
    return "cache"


def stream_text(model: GPT, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int,
                temperature: float, top_k: int, top_p: float, seed: int,
                on_step=None, decode: str = "auto", sinks: int | None = None) -> Iterator[str]:
    """Yield the generated text piece by piece, as soon as each token is sampled.

    Byte-level BPE tokens can end inside a multi-byte character; a piece is released
    only once the bytes decode to whole characters."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    decoder = IncrementalDecoder(tokenizer)
    for token in model.generate(idx, max_new_tokens, temperature, top_k, top_p,
                                generator=generator, on_step=on_step,
                                decode=pick_decode(decode, device, model), sinks=sinks):
        piece = decoder.add(int(token[0, 0]))
        if piece:
            yield piece
    rest = decoder.flush()
    if rest:
        yield rest


class IncrementalDecoder:
    """Text of a growing token sequence, piece by piece, at a cost that does not grow
    with its length: each step decodes the tokens not yet shown together with a few
    shown ones before them (so a tokenizer that spaces words by context decodes them as
    it would in the whole text) and keeps what is new. Byte-level BPE tokens can end
    inside a multi-byte character; those wait until the character is whole."""
    CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._new(final=False)

    def flush(self) -> str:
        return self._new(final=True)

    def _new(self, final: bool) -> str:
        before = self.ids[max(0, self.shown - self.CONTEXT):self.shown]
        text = self.tokenizer.decode(before + self.ids[self.shown:])
        if text.endswith("\ufffd") and not final:    # an incomplete UTF-8 sequence
            return ""
        piece = text[len(self.tokenizer.decode(before)):]
        self.shown = len(self.ids)
        return piece


class StepExplainer:
    """Records, at each generation step, the model's distribution before and after
    temperature / top-k / top-p and the token drawn: generation watched left to right."""

    def __init__(self, tokenizer: Tokenizer, temperature: float, top_k: int, top_p: float,
                 show: int = 5):
        self.tokenizer, self.show = tokenizer, show
        self.settings = (temperature, top_k, top_p)
        self.steps: list[dict] = []

    def __call__(self, logits: torch.Tensor, token: torch.Tensor) -> None:
        before = next_token_distribution(logits[:1], 1.0)[0]           # the model's own belief
        after = next_token_distribution(logits[:1], *self.settings)[0]   # what is sampled from
        top = torch.topk(before, min(self.show, before.numel()))
        chosen = int(token[0, 0])
        self.steps.append({
            "candidates": [(int(i), before[i].item(), after[i].item()) for i in top.indices],
            "chosen": chosen, "p_before": before[chosen].item(), "p_after": after[chosen].item(),
            "after": after, "kept": int((after > 0).sum()),
        })

    def render(self, step: dict, index: int) -> str:
        t, k, p = self.settings
        label = lambda i: repr(self.tokenizer.decode([i]))
        lines = [f"step {index}: {step['kept']} candidate(s) left after temperature {t}, "
                 f"top-k {k or 'off'}, top-p {p}"]
        lines += [f"   {label(i):<14} {b:7.1%} -> {a:7.1%}" + ("   <- chosen" if i == step["chosen"] else "")
                  for i, b, a in step["candidates"]]
        if step["chosen"] not in [i for i, _, _ in step["candidates"]]:
            lines.append(f"   {label(step['chosen']):<14} {step['p_before']:7.1%} -> "
                         f"{step['p_after']:7.1%}   <- chosen")
        return "\n".join(lines)
