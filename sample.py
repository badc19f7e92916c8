"""Generate text from a trained run, printing each token the moment it is sampled.

    python sample.py                              # the latest run, its best checkpoint
    python sample.py --run runs/cpu-20261129-0900 --prompt "ROMEO:" --num_samples 3
    python sample.py --temperature 0 --max_new_tokens 200     # greedy
    python sample.py --explain --max_new_tokens 20             # watch each step's choice
"""
from __future__ import annotations

import sys

from attnlab.errors import friendly_errors

USAGE = """usage: python sample.py [--run DIR] [--checkpoint best|latest] [--device D] [--KEY=VALUE ...]

  --run DIR          a run directory or a checkpoint folder (default: runs/LATEST)
  --checkpoint W     best (lowest val loss, the default) or latest
  --device D         auto, cpu, cuda, mps
Sampling options (also accepted as --sample.KEY=VALUE):"""


FLAGS = {"explain", "use_cache", "sample.explain", "sample.use_cache"}


def parse(argv: list[str]):
    from attnlab import config
    from attnlab.errors import ConfigError
    opts = {"run": "", "checkpoint": "best", "device": "auto"}
    overrides = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        key = name[2:] if name.startswith("--") else None
        if key is None:
            raise ConfigError(f"unexpected argument {argv[i]!r}; see python sample.py --help")
        if not eq:
            if key in FLAGS and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                value = "true"                                  # a bare switch: --explain
            elif i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value: {name}=VALUE")
            else:
                value, i = argv[i + 1], i + 1
        if key in opts:
            opts[key] = value
        else:
            overrides.append(f"--{key if '.' in key else 'sample.' + key}={value}")
        i += 1
    if opts["checkpoint"] not in ("best", "latest"):
        raise ConfigError(f"--checkpoint must be best or latest, got {opts['checkpoint']!r}")
    sample = config.RunConfig().sample
    for section, key, value in config.parse_overrides(overrides):
        if section != "sample":
            raise ConfigError(f"sample.py takes sampling options only, not {section}.{key}")
        config.apply_to(sample, "sample", {key: value}, "the command line")
    probe = config.RunConfig(sample=sample)
    probe.validate()
    return opts, sample


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from attnlab.config import help_text
        print(USAGE + help_text().split("[sample]", 1)[1])
        return 0
    from attnlab.device import pick_device, pick_dtype
    from attnlab.inference import StepExplainer, encode_prompt, latest_run, load_run, stream_text

    opts, s = parse(argv)
    run = opts["run"] or latest_run()
    device = pick_device(opts["device"])
    model, cfg, tokenizer, ckpt = load_run(run, opts["checkpoint"], device)
    dtype = pick_dtype(s.dtype, device, cfg.model.n_embd)
    model = model.to(dtype)
    prompt_ids = encode_prompt(tokenizer, s.prompt)
    print(f"[{ckpt}: {cfg.model.position} positions, {model.num_params() / 1e6:.2f}M parameters, "
          f"{str(dtype)[6:]} weights; "
          f"temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}, seed {s.seed}]",
          file=sys.stderr)
    for n in range(s.num_samples):
        if s.num_samples > 1:
            print(f"\n--- sample {n + 1} ---", flush=True)
        explainer = StepExplainer(tokenizer, s.temperature, s.top_k, s.top_p, s.explain_top) \
            if s.explain else None
        text = s.prompt
        sys.stdout.write("" if explainer else s.prompt)
        for piece in stream_text(model, tokenizer, prompt_ids, s.max_new_tokens, s.temperature,
                                 s.top_k, s.top_p, s.seed + n, s.use_cache, on_step=explainer):
            text += piece
            if explainer:                  # the step's candidates, then the text so far
                print(explainer.render(explainer.steps[-1], len(explainer.steps)))
                print(f"   text: {text[-60:]!r}\n", flush=True)
            else:
                sys.stdout.write(piece)
                sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    with friendly_errors():
        sys.exit(main(sys.argv[1:]))
