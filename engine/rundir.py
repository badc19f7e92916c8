"""A run's folder: one training process writes to it at a time (its lock), a new run
without a name takes a fresh one (the preset and the second it started, then -2, -3,
...), set-up writes its config and tokenizer there, and a stop before training says
what it left, removing a folder this process made and never wrote a checkpoint to."""
from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from common.errors import CheckpointError, ConfigError
from common.files import file_in_the_way, lock_file, lock_holder, odd_kind, write_text_atomic
from common.shell import word
from engine import checkpoint
from engine.config import RunConfig
from engine.state import Run


# The files a run keeps beside its checkpoints: each is opened, read or replaced as a
# plain file, and a pipe in its place would make the open wait for a writer.
RUN_FILES = (".lock", "config.json", "tokenizer.json", "metrics.jsonl", "best.json")


def _try_lock_run_dir(run_dir: Path):
    """The run directory made and locked for this process, or None where another
    training process holds it."""
    if blocking := file_in_the_way(run_dir):
        raise ConfigError(f"{blocking} is a file, where the run {run_dir} needs a folder; give "
                          "--train.out_dir a folder (it is made if missing)")
    refuse_odd_run_files(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return lock_file(run_dir / ".lock", wait=False)


def refuse_odd_run_files(run_dir: Path) -> None:
    """Before a run opens any of its files: each that is there is a plain file (found
    without opening it), its checkpoints/ a folder, and none of them, nor a checkpoint
    in that folder, a symbolic link. Every file a run writes or removes is its own: a
    link in a run someone shares would have the lock truncate the file it points to, or
    the checkpoints be written (and the old ones pruned) in another run's folder."""
    for path in [*(run_dir / name for name in RUN_FILES), run_dir / checkpoint.CKPT_DIR,
                 *checkpoint.linked_checkpoints(run_dir)]:
        if path.is_symlink():
            raise CheckpointError(f"{path} is a symbolic link, and a run writes only files of "
                                  "its own folder; replace the link with the file or folder "
                                  "itself (or remove it) and run the same command again")
    for name in RUN_FILES:
        if kind := odd_kind(run_dir / name):
            raise CheckpointError(f"{run_dir / name} is {kind}, not a plain file, where the run "
                                  f"keeps its {name}; move it out of the way and run the same "
                                  "command again")
    ckpts = run_dir / checkpoint.CKPT_DIR
    if ckpts.exists() and not ckpts.is_dir():
        raise CheckpointError(f"{ckpts} is not a folder, where the run keeps its checkpoints; "
                              "move it out of the way and run the same command again")


def lock_run_dir(run_dir: Path):
    """One training process per run directory: a second one writing into the same run
    would interleave its metrics and checkpoints with the first's."""
    lock = _try_lock_run_dir(run_dir)
    if lock is None:
        raise CheckpointError(f"{run_dir} is being written by another training process (pid "
                              f"{lock_holder(run_dir / '.lock')}); wait for it to finish, or "
                              "choose another train.run_name")
    return lock


def claim_fresh_dir(run: Run) -> None:
    """A run named for its preset and the second it started: a second run started in
    the same second (two trainings at once on one laptop) takes the name with -2, -3, ...
    instead of being refused for the first one's folder. (One process: under torchrun
    every rank must name the same folder.)"""
    base = run.run_dir
    for n in range(1, 100):
        run.run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        run.made_dir = not run.run_dir.exists()
        lock = _try_lock_run_dir(run.run_dir)
        if lock is not None and not checkpoint.list_checkpoints(run.run_dir):
            run.lock = lock
            return
        if lock is not None:
            lock.close()
    raise CheckpointError(f"{base} and 98 more names after it are taken; choose a "
                          "train.run_name")


def fresh_name(cfg: RunConfig) -> str:
    return f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}"


def write_run_files(run: Run) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run.run_dir / "config.json", run.cfg.to_json())
    run.data.tokenizer.save(run.run_dir)


def stopped_line(run: Run, how: str) -> str:
    """What a stop outside the training loop's own save leaves, for errors_as_lines to
    say: writes are atomic, so the run goes on from its last whole checkpoint. A folder
    this process made and stopped before its first checkpoint holds only what set-up
    wrote, and is removed, so that the same command again starts it afresh rather than
    leave it beside a new one."""
    run_dir = run.run_dir
    last = checkpoint.list_checkpoints(run_dir)
    if not last and run.made_dir:
        run.release()
        shutil.rmtree(run_dir, ignore_errors=True)
        return (f"{how}, before the run had a checkpoint; its folder {run_dir} was removed, so "
                "nothing of it is left: run the same command again")
    if not last:
        return (f"{how}, before {run_dir} had a checkpoint; nothing half-written was kept: "
                "run the same command again")
    return (f"{how}, nothing half-written was kept; python train.py --resume "
            f"{word(run_dir)} continues from its last checkpoint, {last[-1].name}")
