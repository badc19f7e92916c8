"""Metrics: a JSONL file in every run directory, and Weights & Biases when asked.

wandb is optional and never required: `disabled` (the default) imports nothing;
`offline` writes to <run>/wandb for a later `wandb sync`; `online` falls back to
offline, with one line saying so, when the server cannot be reached."""
from __future__ import annotations

import json
import os
from pathlib import Path

from common.errors import AttnlabError
from common.files import read_bounded
from common.shell import word
from engine.checkpoint import list_checkpoints


# Far more than a run writes (a line is about 200 bytes: some two million logged steps),
# and little enough to read whole: a file past it is not one this project wrote.
METRICS_LIMIT = 512 << 20


def read_metrics_lines(path: Path) -> list[str]:
    """The lines of a run's metrics.jsonl ([] where there is none), read bounded: a
    file larger than METRICS_LIMIT, or one that is not a plain file, is refused naming
    it, before it is read whole."""
    try:
        data = read_bounded(path, METRICS_LIMIT)
    except FileNotFoundError:
        return []
    except ValueError as err:
        raise AttnlabError(f"{path} {err}; it is not the metrics a run wrote: move it out of "
                           "the way and run the same command again") from None
    return data.decode("utf-8", errors="replace").splitlines()


class Metrics:
    def __init__(self, run_dir: Path, wandb_mode: str, project: str, config: dict,
                 run_name: str, resume_id: str | None = None, log=print, write: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.write = write                   # only one process of a torchrun job writes
        self.wandb_run = None
        if wandb_mode != "disabled":
            self.wandb_run = _start_wandb(wandb_mode, project, config, run_dir, run_name,
                                          resume_id, log)

    @property
    def wandb_id(self) -> str | None:
        return getattr(self.wandb_run, "id", None)

    def log(self, record: dict) -> None:
        if not self.write:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise self.refused(err) from None
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"},
                               step=record["step"])

    def truncate_after(self, step: int) -> None:
        """On resume: drop records the killed run wrote past its last checkpoint."""
        if not self.write or not self.path.exists():
            return
        keep = [line for line in read_metrics_lines(self.path)
                if _step_of(line) is not None and _step_of(line) < step]
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)
        except OSError as err:
            raise self.refused(err) from None

    def refused(self, err: OSError) -> AttnlabError:
        """A write to metrics.jsonl that failed (a full disk), said with the file and the
        command that goes on: the run's checkpoints are whole, and a resume drops the
        records past the last one; the same command again would refuse a folder that
        already holds checkpoints."""
        run_dir = self.path.parent
        kept = list_checkpoints(run_dir)
        way_on = (f"make room and continue from {kept[-1].name} with python train.py --resume "
                  f"{word(run_dir)}" if kept else
                  f"{run_dir} holds no checkpoint yet: make room and run the same command again")
        return AttnlabError(f"{self.path} could not be written ({err.strerror or err}); "
                            + way_on)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _step_of(line: str) -> int | None:
    """The step of one metrics line; None for a line a killed write left torn."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _start_wandb(mode, project, config, run_dir, run_name, resume_id, log):
    try:
        import wandb
    except ImportError:
        log("wandb is not installed; logging to metrics.jsonl only")
        return None
    kwargs = dict(project=project, config=config, dir=str(run_dir), name=run_name,
                  id=resume_id, resume="allow" if resume_id else None)
    if mode == "online":
        try:
            return wandb.init(mode="online", settings=wandb.Settings(init_timeout=20), **kwargs)
        except Exception as err:  # no network, no API key, server down: all the same to us
            log(f"wandb: cannot log online ({type(err).__name__}); logging offline to "
                f"{run_dir}/wandb instead (upload later with `wandb sync`)")
    try:
        return wandb.init(mode="offline", **kwargs)
    except Exception as err:
        log(f"wandb: offline logging failed too ({err}); metrics.jsonl only")
        return None
