"""Resuming a run: which checkpoint `--resume` names and the config it goes on with
(`resume_config`), what it refuses to change and what it says it changes
(`resume_changes`), what it says instead of training where the checkpoint has already
reached its end (`nothing_to_train`), and where it goes on: its own run, or a branch, a
new run that records the checkpoint as its parent and starts with a copy of it
(`branch`), so that a run's history is never rewritten."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from common.errors import CheckpointError, ConfigError
from common.files import file_in_the_way, odd_kind, read_json, write_json_atomic, write_text_atomic
from common.shell import options, word
from engine import checkpoint
from engine.config import RunConfig, apply, from_dict, migrate
from model.config import ModelError
from engine.pretrained import SWAPPABLE_MODEL_FIELDS
from engine.rundir import write_run_files
from engine.state import Run, recorded_seconds, restore
from engine.tracking import read_metrics_lines


# Training options a resume cannot change, and why: a new value would be recorded and
# never used. Every other one (rates, betas, weight decay, the schedule, max_iters, ...)
# takes effect from the first step after the checkpoint.
FIXED_ON_RESUME = {
    "optimizer": "the optimizer's state in the checkpoint is for it",
    "seed": "the random streams come back from the checkpoint",
    "init_from": "the weights come from the checkpoint",
    "objective": "the tokenizer and the model's head were built for it",
}


def nothing_to_train(cfg: RunConfig, ckpt: Path, given: str,
                     overrides: dict[str, dict[str, str]] | None = None) -> str | None:
    """What a resume of `ckpt` with `cfg` says instead of training, where the checkpoint
    has already reached cfg's target loss, last step or time limit: that, and the
    command that goes further, `--resume GIVEN` with the `overrides` given (the command
    line's) and the options to add. Said before the run is set up, so its folder is
    left untouched, and only of a checkpoint whose files are whole: one that is damaged
    is refused as such, naming the file."""
    state = checkpoint.readable_state(ckpt)
    t, step = cfg.train, state["step"]
    used, best = recorded_seconds(state, "limit_s", ckpt), state.get("best_val")
    reached = []                       # (what it reached, what to give, the option)
    if t.target_val_loss and type(best) in (int, float) and best <= t.target_val_loss:
        reached.append((f"its target (val loss {best:.4f} <= train.target_val_loss="
                        f"{t.target_val_loss:g})", "a lower target (0 for none)",
                        "--train.target_val_loss=0"))
    if t.time_limit and used >= t.time_limit:
        # The clock is the run's own, summed over resumes: a higher limit trains only for
        # the seconds it gives beyond those already trained, so the advice adds them.
        more = math.ceil(t.time_limit)
        reached.append((f"its time limit ({used:.1f} s trained, train.time_limit={t.time_limit:g} s)",
                        f"a limit past the {used:.1f} s trained (here {more} s more)",
                        f"--train.time_limit={math.ceil(used) + more}"))
    if step >= t.max_iters:
        reached.append((f"its last step (train.max_iters={t.max_iters})", "more steps",
                        f"--train.max_iters={2 * max(t.max_iters, 1)}"))
    if not reached:
        return None
    checkpoint.verify(ckpt)
    what, give, adds = zip(*reached)
    named = {o.partition("=")[0] for o in adds}
    # The options given stay in the command, so following it drops none of them.
    kept = options(overrides or {}, leave=named)
    return (f"nothing to train: {ckpt} had already reached {' and '.join(what)} at step "
            f"{step}; to train on, give {' and '.join(give)}: python train.py --resume "
            f"{' '.join([word(given), *kept, *adds])}")


def resume_config(resume: str, out_dir: str, overrides: dict[str, dict[str, str]]
                  ) -> tuple[RunConfig, Path, Path]:
    """(config, run directory, checkpoint) to resume: RESUME is a run directory (its
    latest checkpoint), one of its checkpoint folders, or empty (the latest run). The
    config is the checkpoint's own, hash-checked copy, with the command line's training
    options applied; a run-level config.json that disagrees about the model or data is
    refused, and so is a change to either on the command line, or to an option a resume
    cannot honour (FIXED_ON_RESUME). New checkpoints always go to a run directory, never
    inside a checkpoint: the checkpoint's own run when it is that run's latest, else (or
    when --train.run_name or --train.out_dir names another place) a new run that records
    it as its parent, so a run's history is never rewritten."""
    run_dir, ckpt = _find_checkpoint(resume, out_dir)
    saved, cfg = _checkpoint_config(run_dir, ckpt)
    for section, values in overrides.items():
        apply(cfg, section, values, "the command line")
    cfg.validate()
    _refuse_what_a_resume_keeps(saved, cfg, ckpt)
    step = (read_json(ckpt / "state.json") or {}).get("step", 0)
    if cfg.train.max_iters < step:
        raise ConfigError(f"train.max_iters={cfg.train.max_iters} is before step {step}, where "
                          f"{ckpt} stands; give a larger one to train on")
    return cfg, _where_it_goes_on(cfg, run_dir, ckpt, step, overrides.get("train", {})), ckpt


def _find_checkpoint(resume: str, out_dir: str) -> tuple[Path, Path]:
    """(run directory, checkpoint) that RESUME names: a run directory or its name (its
    latest checkpoint), one of its checkpoint folders, or empty (the latest run)."""
    path = Path(resume) if resume else checkpoint.latest_run(out_dir, other="--resume DIR")
    if resume and not path.exists() and not path.is_absolute() and (Path(out_dir) / path).is_dir():
        path = Path(out_dir) / path                       # a run's name, as --run takes it
    if wrong := checkpoint.misplaced(path):
        raise CheckpointError(f"cannot resume: {wrong}")
    if (path / "state.json").exists():                    # a checkpoint folder
        run_dir = path.parent.parent
        if path.parent.name == checkpoint.CKPT_DIR:
            _refuse_odd_config(run_dir, (checkpoint.list_checkpoints(run_dir) or [path])[-1])
        if path.parent.name != checkpoint.CKPT_DIR or not (run_dir / "config.json").is_file():
            raise CheckpointError(f"cannot resume: {path} is a checkpoint outside a run "
                                  "directory; start a new run from it with "
                                  f"{word(f'--train.init_from={path}')}")
        return run_dir, path
    if (path / "config.json").is_file():
        run_dir = path                   # partial writes are cleared by restore(), under the lock
        return run_dir, checkpoint.resolve(run_dir, "latest")
    if found := checkpoint.list_checkpoints(path):
        _refuse_odd_config(path, found[-1])
        raise CheckpointError(f"cannot resume: {path / 'config.json'} is missing; copy its latest "
                              f"checkpoint's: cp {word(found[-1] / 'config.json')} {word(path / 'config.json')}")
    if not path.exists():
        raise CheckpointError(f"cannot resume: {path} does not exist, nor a run of that name "
                              f"in {out_dir}/; give a run directory or its name, or one of its "
                              "checkpoint folders, or --resume alone for the latest run")
    raise CheckpointError(f"cannot resume: {path} is not a run directory (no config.json)")


def _refuse_odd_config(run_dir: Path, ckpt: Path) -> None:
    """A run whose config.json is a folder or a pipe (found without opening it, which
    for a pipe would wait) is refused for that: copying the checkpoint's over it would
    not help until it is moved away."""
    if kind := odd_kind(run_dir / "config.json"):
        raise CheckpointError(f"cannot resume: {run_dir / 'config.json'} is {kind}, not a plain "
                              "file; move it out of the way, then copy the checkpoint's in its "
                              f"place: cp {word(ckpt / 'config.json')} {word(run_dir / 'config.json')}")


def _checkpoint_config(run_dir: Path, ckpt: Path) -> tuple[dict, RunConfig]:
    """The config `ckpt` was trained with (as saved, and read), held against its run's
    config.json: one that disagrees about the model or data is refused; a branch's gives
    its parent, its own name and the options it was started with."""
    saved = migrate(checkpoint.verified_json(ckpt, "config.json"), str(ckpt / "config.json"))
    try:
        cfg = from_dict(saved, str(ckpt / "config.json"))
    except (ConfigError, ModelError) as err:     # as sampling from it says (engine/inference.py)
        raise CheckpointError(f"checkpoint file {ckpt / 'config.json'} is an unreadable config "
                              f"({err}); {checkpoint.use_another(ckpt)}") from None
    run_level = read_json(run_dir / "config.json")
    restore_it = f"cp {word(ckpt / 'config.json')} {word(run_dir / 'config.json')}"
    if run_level is None or any(not isinstance(run_level.get(s, {}), dict)
                                for s in ("model", "data", "train")):     # else written over
        raise CheckpointError(f"{run_dir / 'config.json'} is not a readable run config "
                              "(corrupt or edited); put it back as it was, or copy the "
                              f"checkpoint's own: {restore_it}")
    run_level = migrate(run_level, str(run_dir / "config.json"))
    _refuse_changes(saved, run_level, f"{run_dir / 'config.json'} disagrees with the config "
                    f"{ckpt.name} was trained with", f"put config.json back as it was ({restore_it})")
    recorded = run_level.get("parent")
    if isinstance(recorded, dict) and recorded and not cfg.parent:
        # The checkpoint a branch starts with is its parent's copy, whose config names the
        # parent's run: where this run came from, its own name and the options it was
        # started with (--train.max_iters=N and the like) are in its config.json.
        cfg = from_dict({**saved, "train": {**saved.get("train", {}), **run_level.get("train", {})},
                         "parent": recorded}, str(run_dir / "config.json"))
    return saved, cfg


def _refuse_what_a_resume_keeps(saved: dict, cfg: RunConfig, ckpt: Path) -> None:
    """Refuse a change, on the command line, to the model or data `ckpt` was trained
    with, or to an option a resume cannot honour (FIXED_ON_RESUME), naming the way on."""
    asked = cfg.to_dict()
    reshaped = [k for s, k in _changed_fields(saved, asked)
                if s == "model" and k not in SWAPPABLE_MODEL_FIELDS]
    # init_from keeps its source's shape, so it is the way on only for what it can change.
    way_on = (f"a model of another {', '.join(reshaped)} starts from scratch: a new run with "
              "--config PRESET and those options" if reshaped else
              f"start a new run from these weights with them: {word(f'--train.init_from={ckpt}')}")
    _refuse_changes(saved, asked, f"the checkpoint {ckpt} was trained with a "
                    "different model or data config", f"resume without those overrides, or {way_on}")
    fixed = [f"train.{k}: {saved.get('train', {}).get(k)!r} -> {getattr(cfg.train, k)!r} ({why})"
             for k, why in FIXED_ON_RESUME.items()
             if k in saved.get("train", {}) and saved["train"][k] != getattr(cfg.train, k)]
    if fixed:
        raise CheckpointError(f"a resume keeps these options of {ckpt}: {'; '.join(fixed)}; "
                              f"resume without them, or start a new run from its weights with "
                              f"{word(f'--train.init_from={ckpt}')}")


def _where_it_goes_on(cfg: RunConfig, run_dir: Path, ckpt: Path, step: int,
                      train_overrides: dict[str, str]) -> Path:
    """The run a resume of `ckpt` writes to: its own, where `ckpt` is that run's latest
    and the command line names no other run_name or out_dir; else a branch (_branch_dir)."""
    name = train_overrides.get("run_name") or ""
    out = train_overrides.get("out_dir")
    latest = checkpoint.list_checkpoints(run_dir)[-1]
    # Another --train.out_dir is a wish to go on elsewhere: a new run there, as for another
    # run_name, rather than the option dropped while the old folder grows.
    elsewhere = out is not None and Path(out).resolve() != run_dir.parent.resolve()
    if elsewhere and (blocking := file_in_the_way(out)):   # before "nothing to train" offers it
        raise ConfigError(f"{blocking} is a file, where --train.out_dir={out} needs a folder "
                          "for the new run; give a folder (it is made if missing)")
    if elsewhere and Path(out).resolve().is_relative_to(run_dir.resolve()):
        raise ConfigError(f"--train.out_dir={out} is inside the run {run_dir}, where a new run "
                          "would mix with its files; drop it to continue the run in place, or "
                          f"give another folder for a new run there (not {run_dir} or below)")
    if ckpt.resolve() != latest.resolve() or (name and name != run_dir.name) or elsewhere:
        return _branch_dir(cfg, run_dir, ckpt, step, name, out)
    return run_dir


def _branch_dir(cfg: RunConfig, run_dir: Path, ckpt: Path, step: int, name: str,
                out_dir: str | None) -> Path:
    """Where a resume from `ckpt`, not its run's latest checkpoint (or into another
    --train.run_name), goes on: a new run beside the old one, named for it and the step
    unless named, and recording `ckpt` as its parent."""
    out = Path(out_dir) if out_dir else run_dir.parent
    if name:
        target = out / name
        if checkpoint.list_checkpoints(target):
            raise CheckpointError(f"{target} already holds checkpoints; choose another "
                                  f"--train.run_name to continue {ckpt} in a new run")
    else:
        base = f"{run_dir.name}-from-{step}"
        target, n = out / base, 1
        while target.exists() and not _unfinished_branch(target, ckpt):
            n += 1
            target = out / f"{base}-{n}"
    previous = cfg.parent
    # Absolute: the record must lead back from wherever a later command runs.
    cfg.parent = {"path": os.path.abspath(ckpt), "step": step, **({"parent": previous} if previous else {})}
    cfg.train.run_name, cfg.train.out_dir = target.name, str(out)
    return target


def _unfinished_branch(folder: Path, ckpt: Path) -> bool:
    """Whether `folder` is a branch from `ckpt` stopped before the checkpoint was copied
    in: the same command takes it up again rather than leave it and make another."""
    recorded = (read_json(folder / "config.json") or {}).get("parent")
    return (isinstance(recorded, dict) and recorded.get("path") == os.path.abspath(ckpt)
            and not checkpoint.list_checkpoints(folder))


def resume_changes(cfg: RunConfig, ckpt: Path) -> list[str]:
    """The training options a resume changes from those `ckpt` was trained with, as
    `train.lr: 0.001 -> 1e-09`, so the run says what it now does differently."""
    trained = checkpoint.verified_json(ckpt, "config.json").get("train", {})
    now = cfg.to_dict()["train"]
    # Where the run goes on is not a change to its training: a branch names its new run
    # itself (_branch_dir), and the "run directory:" line says where it is.
    return [f"train.{k}: {v!r} -> {now[k]!r}" for k, v in trained.items()
            if k in now and now[k] != v and k not in ("run_name", "out_dir")]


def _changed_fields(trained: dict, other: dict) -> list[tuple[str, str]]:
    """(section, field) of each model or data field `other` gives another value."""
    return [(s, k) for s in ("model", "data") for k, v in trained.get(s, {}).items()
            if k in other.get(s, {}) and other[s][k] != v]


def _refuse_changes(trained: dict, other: dict, what: str, fix: str) -> None:
    changed = [f"{s}.{k}: {trained[s][k]!r} -> {other[s][k]!r}"
               for s, k in _changed_fields(trained, other)]
    if changed:
        raise CheckpointError(f"{what} ({'; '.join(changed)}); {fix}")


def branch(run: Run, ckpt: Path) -> None:
    """Continue from `ckpt` of another run in run.run_dir, a new run that records it as
    its parent: the checkpoint (and the best before it) are copied in, with the metrics
    up to its step, and nothing of the other run is touched."""
    source = ckpt.parent.parent
    if run.dist.is_main:                      # under the new run's lock
        if checkpoint.list_checkpoints(run.run_dir):
            raise CheckpointError(f"{run.run_dir} already holds checkpoints; choose another "
                                  f"--train.run_name to continue {ckpt} in a new run")
        # Its config.json first: a stop while the files are copied leaves a run that the
        # same command takes up again (_branch_dir), not a folder of another's files.
        write_run_files(run)
        _branch_files(source, ckpt, run.run_dir)
    run.dist.barrier()
    run.log(f"branched: {run.run_dir} is a new run from {ckpt} (recorded as its parent); "
            f"{source} stays as it was")
    restore(run, run.run_dir / checkpoint.CKPT_DIR / ckpt.name)
    run.progress.wandb_id = None              # a run of its own in the tracker too
    record_parent_weights(run)


def record_parent_weights(run: Run) -> None:
    """The checksum of the weights a branch starts from, as fine-tuning records its
    source's; taken while the model still holds them (a branch stopped before its first
    step of training takes it when resumed)."""
    parent = run.cfg.parent
    if (not run.sharded and isinstance(parent, dict) and "path" in parent
            and "weights_sha256" not in parent and parent.get("step") == run.progress.step):
        from engine.interop import weights_sha256
        parent["weights_sha256"] = weights_sha256(run.model)


def _branch_files(source: Path, ckpt: Path, run_dir: Path) -> None:
    """What a run branched from `ckpt` of run `source` starts with: the checkpoint, the
    metrics up to its step, and the best checkpoint up to it with its best.json."""
    step = (read_json(ckpt / "state.json") or {}).get("step", 0)
    records = []
    for line in read_metrics_lines(source / "metrics.jsonl"):
        try:
            record = json.loads(line)
        except ValueError:                    # a torn last line
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            records.append(record)
    write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    checkpoint.copy_checkpoint(ckpt, run_dir)
    evaluated = [r for r in records if isinstance(r.get("val_loss"), (int, float))]
    best = min(evaluated, key=lambda r: r["val_loss"], default=None)
    if best is not None:
        name = f"{checkpoint.PREFIX}{best['step']:07d}"
        if name != ckpt.name and (source / checkpoint.CKPT_DIR / name).is_dir():
            checkpoint.copy_checkpoint(source / checkpoint.CKPT_DIR / name, run_dir)
        if (run_dir / checkpoint.CKPT_DIR / name).is_dir():
            write_json_atomic(run_dir / "best.json",
                              {"step": best["step"], "val_loss": best["val_loss"], "path": name})
