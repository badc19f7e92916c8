"""Generate text from a trained run, printing each token the moment it is sampled.

    python sample.py                              # the latest run, its best checkpoint
    python sample.py --run runs/cpu-20261129-0900 --prompt "ROMEO:" --num_samples 3
    python sample.py --temperature 0 --max_new_tokens 200     # greedy
    python sample.py --explain --max_new_tokens 20             # watch each step's choice

Sampling options are also accepted as --sample.KEY=VALUE; those not given come from the
run's own [sample] settings (its preset's max_new_tokens, temperature, ...). The latest
run is the one in runs/ whose newest checkpoint was written last; its best checkpoint
is the one best.json names, or the latest where nothing after step 0 was evaluated.
"""
from __future__ import annotations

import sys

from common.cpu import refuse_unrunnable_capability, wait_passively_if_busy
from common.errors import interrupt_at_start
from common.shell import word

refuse_unrunnable_capability()      # before torch loads, which would die of it: common/cpu.py
WAITING = wait_passively_if_busy()  # before torch loads, which reads it once: common/cpu.py
with interrupt_at_start():          # torch loads here
    from attnlab.options import add_run_options, find_run
    from engine.cli import Parser, add_config_options, errors_as_lines


def parser() -> Parser:
    p = Parser("python sample.py", __doc__, usage="python sample.py [--run DIR] "
               "[--checkpoint best|latest|STEP] [--device D] [--KEY=VALUE ...]")
    add_run_options(p)
    p.set_defaults(device="auto")
    add_config_options(p, sections=("sample",), short=("sample",))
    return p


def main(argv: list[str]) -> int:
    from attnlab.exercises import plug
    plug.install()                        # `yours`: the learner's code, as a registry entry
    args = parser().parse_args(argv)
    from engine.cli import apply_overrides
    from engine.config import RunConfig
    from engine.device import pick_device
    from engine.machine import pick_dtype
    from engine.inference import StepExplainer, encode_prompt, load_run, pick_decode, stream_text
    from model.decode import check_sinks, check_speculation, prompt_read

    apply_overrides(RunConfig(), args)            # a bad option fails before any loading
    device = pick_device(args.device)

    run = find_run(args.run)          # a folder, or a run's name in runs/

    def bind_yours(cfg):
        for note in plug.prepare(cfg.model, plug.folder_for(cfg.model, args.exercises, run)):
            print(note, file=sys.stderr)
    loaded = []                       # what loading says, printed once nothing is refused
    model, cfg, tokenizer, ckpt = load_run(run, args.checkpoint, device,
                                           before_build=bind_yours, log=loaded.append)
    s = sample_settings(cfg, args)
    dtype = pick_dtype(s.dtype, device, cfg.model.n_embd, decoding=True)
    model = model.to(dtype)
    refuse_what_cannot_write(cfg, run)
    model.check_generates()          # an encoder is refused before anything is printed
    decode = pick_decode(s.decode, device, model) if s.use_cache else "full"
    if s.sinks:                       # so are sinks and drafts the model cannot decode with
        check_sinks(model.config, decode, s.sinks)
    if decode == "mtp":
        check_speculation(model, s.sinks or None, None)
    for line in [*loaded, WAITING] if WAITING else loaded:   # once work starts, not
        print(line, file=sys.stderr)                          # before an error line
    prompt_ids = encode_prompt(tokenizer, s.prompt)
    print(header(ckpt, model, cfg, s, device, dtype, decode), file=sys.stderr)
    warn_if_cut(len(prompt_ids), prompt_read(model, len(prompt_ids), decode, s.sinks or None))
    for n in range(s.num_samples):
        if s.num_samples > 1:
            print(f"\n--- sample {n + 1} ---", flush=True)
        explainer = StepExplainer(tokenizer, s.temperature, s.top_k, s.top_p, s.explain_top) \
            if s.explain else None
        text = s.prompt
        sys.stdout.write("" if explainer else s.prompt)
        for piece in stream_text(model, tokenizer, prompt_ids, s.max_new_tokens, s.temperature,
                                 s.top_k, s.top_p, s.seed + n, on_step=explainer,
                                 decode=decode, sinks=s.sinks or None):
            text += piece
            if explainer:                  # the step's candidates, then the text so far
                print(explainer.render(explainer.steps[-1], len(explainer.steps)))
                print(f"   text: {text[-60:]!r}\n", flush=True)
            else:
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if decode == "mtp" and model.mtp.drafted:   # how often the draft was the token
            print(f"mtp: {model.mtp.accepted} of {model.mtp.drafted} drafts kept "
                  f"({model.mtp.accepted / model.mtp.drafted:.0%})", file=sys.stderr)
    return 0


def warn_if_cut(prompt_len: int, read: int) -> None:
    """Past its context the model reads only the prompt's end (model.decode.prompt_read),
    which the learner is told."""
    if read < prompt_len:
        print(f"warning: the prompt is {prompt_len:,} tokens and the model reads its last "
              f"{read:,}; the first {prompt_len - read:,} do not shape the text "
              "(--sinks streams past the context instead)", file=sys.stderr)


def sample_settings(cfg, args):
    """The run's own sampling settings, with what the command line gives on top."""
    from dataclasses import replace
    from common.errors import ConfigError
    from engine.cli import overrides_of
    from engine.config import RunConfig, apply
    settings = RunConfig(sample=replace(cfg.sample))
    for section, values in overrides_of(args).items():
        apply(settings, section, values, "the command line")
    settings.validate()
    s = settings.sample
    if s.sinks >= cfg.model.block_size:        # the run's context, which validate() does not know
        raise ConfigError(f"sample.sinks={s.sinks} keeps more tokens than the model's context of "
                          f"{cfg.model.block_size}; give at most {cfg.model.block_size - 1} "
                          "(StreamingLLM keeps 4)")
    return s


def header(ckpt, model, cfg, s, device, dtype, decode: str) -> str:
    """The line before the text: what samples, in what precision and why, and how. The
    attention kernel that pays on this machine is handed to the model here."""
    from engine.device import dtype_name
    from engine.machine import fit_attention, sampling_kernel_why, why_dtype
    from engine.state import mixing, position_words
    kernel = fit_attention(model, cfg.model, device, dtype)
    kernel += sampling_kernel_why(cfg.model, cfg.train, device, dtype)
    why = why_dtype(device, dtype, s.dtype, cfg.model.n_embd, "sample.dtype")
    return (f"[{ckpt}: {position_words(cfg.model)}{mixing(cfg.model)}, "
            f"{model.num_params() / 1e6:.2f}M parameters, {dtype_name(dtype)} weights{why}, "
            f"attention {kernel}, decode {decode}{streaming(cfg.model, s.sinks)}; "
            f"temperature {s.temperature}, "
            f"top-k {s.top_k}, top-p {s.top_p}, seed {s.seed}]")


def streaming(model_cfg, sinks: int) -> str:
    """What the header says of --sinks: what is kept once the text passes the context
    (model/decode.py, check_sinks has refused a model whose keys cannot be renumbered)."""
    if not sinks:
        return ""
    from model.decode import default_stream_window
    return (f", past the context the first {sinks} tokens (sinks) and the newest "
            f"{default_stream_window(model_cfg, sinks)}, renumbered")


def refuse_what_cannot_write(cfg, run) -> None:
    """A run whose training gave it nothing to write with, refused with what to do
    instead (the model itself refuses any model.causal=false one)."""
    from common.errors import ConfigError
    from engine.objectives import OBJECTIVES
    if not OBJECTIVES[cfg.train.objective].writes:
        raise ConfigError(f"this run is an encoder trained to fill in blanks "
                          f"(train.objective={cfg.train.objective}), not to write text left to "
                          f"right; fill one in: python -m attnlab.fill --run {word(run)} "
                          "--text \"To be, or not to [MASK]\", or sample another run with "
                          "--run DIR")
    from model.readout import READOUTS
    # A decoder's plain output layer trained with no mask is the leak; an encoder (BERT and
    # the like) is refused by the model itself, pointing to fill.
    if not cfg.model.causal and READOUTS[cfg.model.readout].plain:
        raise ConfigError("this run is a language model trained without the causal mask "
                          "(model.causal=false): each position read the very token it was "
                          "asked to predict, which a text being written does not have yet, so "
                          "it never learned to predict; python -m attnlab.article leak trains "
                          "one beside a causal one and shows what each writes")


if __name__ == "__main__":
    with errors_as_lines("sampling stopped; run the same command again for the whole text"):
        try:
            sys.exit(main(sys.argv[1:]))
        except KeyboardInterrupt:
            print(flush=True)             # end the text's line before the one saying so
            raise
