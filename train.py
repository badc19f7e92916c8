"""Train a small GPT.

    python train.py                         # a preset chosen for this machine
    python train.py --config cpu --train.max_iters=500
    python train.py --data.path=my.txt --model.position=learned
    python train.py --resume                # continue the latest run
    python train.py --budget 5m             # the best model this machine trains in 5 minutes
    python train.py --help                  # every option, with its default
"""
from __future__ import annotations

import sys
import time

from attnlab.errors import friendly_errors

USAGE = """usage: python train.py [--config PRESET|FILE] [--resume [RUN_DIR]] [--section.key=VALUE ...]

  --config NAME     a preset from configs/ (cpu, gpu, mps, ...) or a .toml file;
                    default: chosen from the device found (cuda -> gpu, mps -> mps, else cpu)
  --resume [DIR]    continue a run from its latest checkpoint (default: the latest run)
  --budget TIME     measure this machine, then pick the model size and steps that fit
                    TIME (90s, 5m, 1h) and stop on time with a final evaluation
Several processes or GPUs: torchrun --standalone --nproc_per_node=N train.py ...
Overrides (checked against each field's type; unknown keys are refused):"""


def split_script_args(argv: list[str]) -> tuple[str | None, str | None, bool, str | None, list[str]]:
    preset, resume, resuming, budget, rest = None, None, False, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--budget" or arg.startswith("--budget="):
            if "=" in arg:
                budget = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                budget, i = argv[i + 1], i + 1
            else:
                from attnlab.errors import ConfigError
                raise ConfigError("--budget needs a duration, for example 5m or 90s")
        elif arg in ("--config", "--preset") or arg.startswith(("--config=", "--preset=")):
            if "=" in arg:
                preset = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                preset, i = argv[i + 1], i + 1
            else:
                from attnlab.errors import ConfigError
                raise ConfigError(f"{arg} needs a preset name or a .toml path")
        elif arg == "--resume" or arg.startswith("--resume="):
            resuming = True
            if "=" in arg:
                resume = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                resume, i = argv[i + 1], i + 1
        else:
            rest.append(arg)
        i += 1
    return preset, resume, resuming, budget, rest


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    if any(a in ("-h", "--help") for a in argv):
        from attnlab.config import help_text
        print(USAGE + help_text())
        return 0
    from attnlab import config, distributed
    from attnlab.device import pick_device
    from attnlab.training import Trainer, describe, resolve_resume

    preset, resume, resuming, budget, overrides = split_script_args(argv)
    if budget is not None:
        from attnlab.budget import parse_duration
        from attnlab.errors import ConfigError
        budget_s = parse_duration(budget)
        if resuming or distributed.world_size() > 1:
            raise ConfigError("--budget plans a new single-process run; it cannot be combined "
                              "with --resume or torchrun")
    if resuming:
        out_dirs = [v for s, k, v in config.parse_overrides(overrides) if (s, k) == ("train", "out_dir")]
        cfg, run_dir = resolve_resume(overrides, resume, out_dirs[-1] if out_dirs else "runs")
    else:
        if preset is None:
            asked = [v for s, k, v in config.parse_overrides(overrides) if (s, k) == ("train", "device")]
            device = pick_device(asked[-1] if asked else "auto")
            preset = {"cuda": "gpu", "mps": "mps"}.get(device.type, "cpu")
            print(f"preset: {preset} (chosen for the {device.type} found; --config NAME for another)")
        cfg, run_dir = config.build(preset, overrides), None
        if budget is not None:
            from attnlab.budget import plan
            cfg = plan(cfg, budget_s, started)
    dist = distributed.setup()
    try:
        trainer = Trainer(cfg, run_dir=run_dir, resume=resuming, dist=dist)
        say = trainer.log
        say(f"config:\n{describe(cfg)}")
        say(f"device: {trainer.device}, autocast {str(trainer.dtype)[6:]}"
            + (f", {dist.world} processes" if dist.world > 1 else "") + "; data: "
            f"{cfg.data.path or 'the bundled Shakespeare'} ({trainer.data.tokenizer.kind} tokenizer, vocabulary "
            f"{trainer.data.tokenizer.vocab_size}, {len(trainer.data.train):,} train / "
            f"{len(trainer.data.val):,} val tokens)")
        say(trainer.summary())
        say(f"run directory: {trainer.run_dir}")
        result = trainer.run()
    finally:
        distributed.cleanup(dist)
    if not dist.is_main:
        return 0
    if not result.get("interrupted"):
        print(f"done at step {result['step']}: best val loss {result['best_val']:.4f} "
              f"({trainer.data.bits(result['best_val']):.3f} {trainer.data.bits_unit}); "
              f"sample with: python sample.py --run {trainer.run_dir}")
        return 0
    return 130


if __name__ == "__main__":
    with friendly_errors():
        sys.exit(main(sys.argv[1:]))
