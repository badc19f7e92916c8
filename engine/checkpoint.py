"""Checkpoints that survive kills and never execute code.

A checkpoint is a folder, checkpoints/step_0000500/, holding
  model.safetensors        the weights (safetensors: raw tensors, no pickle)
  train_state.safetensors  optimizer moments and RNG states, as tensors
  state.json               step, optimizer hyper-parameters, a SHA-256 of each file
  config.json, tokenizer.json   so the folder stands on its own
It is written under a temporary name and renamed into place only when complete, so a
kill during a write leaves the previous checkpoint as it was. Loading checks every
file against its recorded hash and refuses a corrupt folder, naming it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.errors import CheckpointError
from common.files import file_in_the_way, file_sha256, fsync, inside, odd_kind, read_json, write_json_atomic
from common.schema import Field, config_problems, count, first_problems
from common.shell import word
from engine.hf_files import MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, refuse_too_large
from engine.optim import PARAM_STATE

CKPT_DIR = "checkpoints"
PREFIX = "step_"
TRAIN_STATE = "train_state.safetensors"
SAVED_FOR = "attnlab_model"     # model.safetensors' header: the model section it was saved with

# What state.json must hold before any of it is used; the fields a resume reads beyond
# these are checked by engine/state.py, which says what each is for.
STATE_SCHEMA = {"step": count(1 << 62, low=0), "files": Field(dict, required=True)}
# What a run's config.json must hold before a model is built from it: its sections as
# objects, and the sizes within the caps a transformers folder's are held to
# (engine/hf_files.py), so an edited width is refused by name, not tried.
RUN_CONFIG_SCHEMA = {
    "model": Field(dict, required=True, fields={
        "n_layer": count(MAX_LAYERS, required=False), "n_embd": count(MAX_WIDTH, required=False),
        "n_head": count(MAX_HEADS, required=False), "vocab_size": count(MAX_VOCAB, required=False),
        "block_size": count(MAX_POSITIONS, required=False)}),
    "data": Field(dict), "train": Field(dict)}


def storage_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts (a sharded DTensor: its local shard's), to spot
    tied weights, which share it."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def model_tensors(model: torch.nn.Module, whole=lambda t: t) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared memory),
    on the CPU; `whole` turns a sharded tensor into the full one (engine/sharding.py)."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        ptr = storage_ptr(tensor)
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = whole(tensor).detach().cpu().contiguous()
    return out


def optimizer_split(optimizer) -> tuple[dict, dict]:
    """The state of named optimizers ({name: state_dict}) as (tensors, JSON-able rest)."""
    tensors, info = {}, {}
    for name, sd in optimizer.state_dict().items():
        plain = {}
        for idx, state in sd["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    tensors[f"optim.{name}.{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    plain.setdefault(str(idx), {})[key] = value
        info[name] = {"param_groups": sd["param_groups"], "plain_state": plain}
    return tensors, info


def optimizer_join(tensors: dict, info: dict) -> dict:
    out = {}
    for name, parts in info.items():
        state: dict[int, dict] = {}
        prefix = f"optim.{name}."
        for key, value in tensors.items():
            if key.startswith(prefix):
                idx, field = key[len(prefix):].split(".", 1)
                state.setdefault(int(idx), {})[field] = value
        for idx, rest in parts.get("plain_state", {}).items():
            state.setdefault(int(idx), {}).update(rest)
        out[name] = {"state": state, "param_groups": parts["param_groups"]}
    return out


def refuse_unfit_optimizer_state(optimizer, tensors: dict, info, ckpt: Path) -> None:
    """Before any of it is loaded: the optimizer's tensors in train_state.safetensors
    (optim.NAME.INDEX.KEY) are those a step of `optimizer` keeps (optim.PARAM_STATE),
    each of its parameter's shape and dtype, all of a parameter's or none (one never
    stepped); and state.json's description names the same optimizers and parameters,
    with no state beside those tensors. The hashes catch damage, not an edit with hashes
    recomputed: without this a moment of another shape is broadcast into every step, and
    a missing one stops the first step with a KeyError."""
    for wrong, name in ((_optimizer_tensor_problems(optimizer.indexed_params(), tensors), TRAIN_STATE),
                        (_optimizer_info_problems(optimizer, info), "state.json")):
        if wrong:
            raise CheckpointError(f"checkpoint file {ckpt / name} does not hold the optimizer state "
                                  f"of this model ({'; '.join(wrong[:3])}); it is corrupt or edited: "
                                  f"{use_another(ckpt)}")


def _optimizer_tensor_problems(params: dict[str, list], tensors: dict) -> list[str]:
    """What is wrong with the optim.* tensors of a train state, for the optimizers'
    parameters `params` ({name: parameters in state_dict order})."""
    described = lambda shape, dtype: f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
    expected = {f"optim.{name}.{idx}": {key: described(p.shape, p.dtype) if kind == "param"
                                        else described((), torch.float32)
                                        for key, kind in PARAM_STATE.get(name, {}).items()}
                for name, owned in params.items() for idx, p in enumerate(owned)}
    problems, found = [], {}
    for key, tensor in tensors.items():
        if not key.startswith("optim."):
            continue
        owner, _, field = key.rpartition(".")
        want, have = expected.get(owner, {}).get(field), described(tensor.shape, tensor.dtype)
        if want is None:
            problems.append(f"{key[:200]} is no tensor this model's optimizer keeps")
        elif have != want:
            problems.append(f"{key} is {have}, not {want}")
        elif not _finite(tensor):
            problems.append(f"{key} holds NaN or infinite values")
        found.setdefault(owner, set()).add(field)
    for owner, fields in found.items():
        if owner in expected and (missing := sorted(set(expected[owner]) - fields)):
            problems.append(f"{owner} lacks {', '.join(missing)}")
    return problems


def _optimizer_info_problems(optimizer, info) -> list[str]:
    """What is wrong with state.json's `optimizer` entry for `optimizer`: other
    optimizers, parameters grouped otherwise (a saved index would land on another
    parameter), or state that is not a tensor."""
    if not isinstance(info, dict) or set(info) != set(optimizer.named):
        shown = (", ".join(sorted(info)[:4]) or "none") if isinstance(info, dict) else "nothing"
        return [f"its optimizer entry names {shown[:200]}, where this run has "
                f"{', '.join(sorted(optimizer.named))}"]
    problems = []
    for name, opt in optimizer.named.items():
        parts = info[name] if isinstance(info[name], dict) else {}
        groups = parts.get("param_groups")
        saved = [g.get("params") if isinstance(g, dict) else None
                 for g in (groups if isinstance(groups, list) else [])]
        if saved != [g["params"] for g in opt.state_dict()["param_groups"]]:
            problems.append(f"optimizer.{name}.param_groups does not hold this model's "
                            "parameters, grouped as its optimizer groups them")
        if parts.get("plain_state"):
            problems.append(f"optimizer.{name}.plain_state holds state that is not a tensor, "
                            "which no optimizer here keeps")
    return problems


def own_root(run_dir: Path) -> Path:
    """The run's checkpoints/ folder, refused where it is a symbolic link: what a run
    writes and prunes is inside its own folder, never in one a link leads to (another
    run's). engine/rundir.py refuses it with the other links before the run starts; this
    holds for every writer."""
    root = Path(run_dir) / CKPT_DIR
    if root.is_symlink():
        raise CheckpointError(f"{root} is a symbolic link, and a run writes only files of its "
                              "own folder; replace the link with the folder itself (or remove "
                              "it) and run the same command again")
    return root


def linked_checkpoints(run_dir: Path) -> list[Path]:
    """What in the run's checkpoints/ folder is a symbolic link (a step folder, a
    temporary one): never written, read as the run's latest, or pruned through."""
    root = Path(run_dir) / CKPT_DIR
    if root.is_symlink() or not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_symlink())


def save(run_dir: Path, step: int, model, optimizer, tensors: dict, state: dict,
         files: dict[str, str], keep_last: int) -> Path:
    """Write checkpoint `step` atomically; prune to the last `keep_last` plus the best."""
    root = own_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    weights = model_tensors(model)
    bad = [name for name, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"the weights hold NaN or infinite values ({', '.join(bad[:3])}); "
                              f"{final} was not written, so the last one stays the last good one")
    tmp.mkdir()
    try:
        _write(tmp, weights, optimizer, tensors, state, files, step)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)      # a full disk leaves no half checkpoint behind
        if isinstance(err, (OSError, SafetensorError)):
            # safetensors reports a failed write as its own error, the OS's reason inside
            reason = err.strerror if isinstance(err, OSError) and err.strerror else \
                str(err).rpartition("I/O error: ")[2]
            raise CheckpointError(
                f"checkpoint {final.name} could not be written in {root} ({reason}); the run "
                f"is intact up to its last checkpoint: make room and continue with python "
                f"train.py --resume {word(run_dir)}") from None
        raise
    if final.exists():                      # the same step saved again (e.g. Ctrl-C right after)
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync(root)
    prune(run_dir, keep_last)
    return final


def _write(tmp: Path, weights: dict, optimizer, tensors: dict, state: dict,
           files: dict[str, str], step: int) -> None:
    # The model section of the config saved beside the weights, in the weights file's
    # own header: a config.json edited to another model of the same shapes (linear
    # attention's weights under a config that says mha), its hash recomputed, is
    # refused where the weights are loaded (`_refuse_other_model`).
    model = json.loads(files["config.json"]).get("model") if "config.json" in files else None
    save_file(weights, tmp / "model.safetensors",
              metadata={SAVED_FOR: json.dumps(model, sort_keys=True)} if model else None)
    opt_tensors, opt_info = optimizer_split(optimizer)
    save_file({**opt_tensors, **tensors}, tmp / TRAIN_STATE)
    for name, text in files.items():
        (tmp / name).write_text(text, encoding="utf-8")
    names = ["model.safetensors", TRAIN_STATE, *files]
    manifest = {}
    for name in names:
        fsync(tmp / name)
        manifest[name] = file_sha256(tmp / name)
    write_json_atomic(tmp / "state.json", {**state, "step": step, "optimizer": opt_info,
                                           "files": manifest})


def copy_checkpoint(ckpt: Path, run_dir: Path) -> Path:
    """A copy of checkpoint folder `ckpt` in run_dir, appearing whole. Its files are
    hard links where the file system allows: a checkpoint's files are never changed in
    place (only written whole, renamed or removed), so two runs can share them, and
    pruning one run's copy leaves the other's."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    root = own_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / ckpt.name
    tmp = root / f".tmp-{ckpt.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp, copy_function=link)
    os.rename(tmp, final)
    fsync(root)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    # Only the names save() writes: a stray step_old/ or step_copy/ a user left there
    # would otherwise sort after every real step and stand as the run's latest.
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
                  and p.name.removeprefix(PREFIX).isdigit())


def best_step(run_dir: Path) -> int | None:
    step = (read_json(Path(run_dir) / "best.json") or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def prune(run_dir: Path, keep_last: int) -> None:
    ckpts = list_checkpoints(run_dir)
    best = best_step(run_dir)
    own_root(run_dir)
    for path in ckpts[:-keep_last]:
        if path.is_symlink():                  # removed through, it would be another's
            continue
        if best is None or path.name != f"{PREFIX}{best:07d}":
            shutil.rmtree(path, ignore_errors=True)


def use_another(ckpt: Path) -> str:
    """What to do about a damaged checkpoint: the other steps its run keeps that are
    whole (one damaged too is named as such, not offered), and the options that read
    one (sampling, looking inside) or train on from one."""
    ckpt = Path(ckpt)
    if ckpt.parent.name != CKPT_DIR:
        return "use another checkpoint"
    run = ckpt.parent.parent
    others = [c for c in list_checkpoints(run) if c.name != ckpt.name]
    whole = [c for c in others if _intact(c)]
    damaged = [c for c in others if c not in whole]
    also = (f" (step{'s' if len(damaged) > 1 else ''} {_steps(damaged)} "
            f"{'are' if len(damaged) > 1 else 'is'} damaged too)") if damaged else ""
    if not whole:
        return f"{run} keeps no other whole checkpoint{also}: train it again"
    return (f"use another checkpoint: {run} also keeps step{'s' if len(whole) > 1 else ''} "
            f"{_steps(whole)}{also} (--checkpoint STEP samples or looks inside one; "
            f"--resume {word(whole[-1])} trains on from it in a new run)")


def _steps(ckpts: list[Path]) -> str:
    return ", ".join(str(int(c.name.removeprefix(PREFIX))) for c in ckpts)


def remove_partial(run_dir: Path) -> None:
    """Temporary folders left by a write that was killed."""
    root = own_root(run_dir)
    if root.is_dir():
        for path in root.glob(".tmp-*"):
            if not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


def misplaced(path: Path) -> str | None:
    """What is wrong with `path` given for a run's folder where it is a file (a run's own
    config.json, a device), the checkpoints/ folder inside a run, or a folder of runs
    (an out_dir): the folder to give."""
    if path.exists() and not path.is_dir():
        holder = path.parent
        inside = (holder / "state.json").is_file() or (holder / "config.json").is_file()
        return (f"{path} is a file, not a folder; give "
                + (f"the folder it is in, {holder}" if inside else
                   "a run directory, one of its checkpoint folders, or a transformers folder"))
    if path.name == CKPT_DIR and (path.parent / "config.json").is_file():
        return (f"{path} is the {CKPT_DIR}/ folder of run {path.parent}: give the run itself "
                f"({path.parent}), or one of the {PREFIX}NNNNNNN folders in it")
    if path.is_dir() and not (path / "config.json").exists() and not (path / "state.json").exists():
        runs = sorted(d.name for d in path.iterdir()
                      if (d / "config.json").is_file() and (d / CKPT_DIR).is_dir())
        if runs:
            shown = ", ".join(runs[:4]) + (f" and {len(runs) - 4} more" if len(runs) > 4 else "")
            return (f"{path} is a folder of runs ({shown}), not a run: give one of them, "
                    f"e.g. {path / runs[-1]}")
    return None


def resolve(path: str | Path, which: str = "latest") -> Path:
    """A checkpoint folder from a run directory (its latest or best) or the folder itself."""
    return choose(path, which)[0]


def choose(path: str | Path, which: str = "latest") -> tuple[Path, str, bool]:
    """(checkpoint folder, why it was chosen, whether that departs from what was asked).
    `which` is best, latest, or a step number ("500"). `best` is the step best.json
    names, except where that is step 0, the weights before any training, and no later
    step was evaluated (a run stopped before its first evaluation): then the latest,
    which has trained."""
    path = Path(path)
    if (path / "state.json").exists():           # one that is not a plain file is refused as such
        return path, "the checkpoint folder given", False
    if not path.exists():
        raise CheckpointError(f"run directory {path} does not exist; train one with "
                              "`python train.py`, or pass the folder printed by train.py")
    if wrong := misplaced(path):
        raise CheckpointError(wrong)
    ckpts = list_checkpoints(path)
    if not ckpts:
        if (path / "config.json").is_file():
            raise CheckpointError(f"run {path} holds no checkpoint (its {CKPT_DIR}/ has no "
                                  f"{PREFIX}NNNNNNN/ folder): it stopped before its first one, or "
                                  f"they were removed; {train_into(path)}, or point at another run")
        if any(path.glob("*.safetensors")) or (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path} has weights but no config.json: a transformers "
                                  "folder needs the config.json save_pretrained writes beside "
                                  "them (and a run, its checkpoints/ folder)")
        raise CheckpointError(f"{path} holds no checkpoint (no {CKPT_DIR}/{PREFIX}NNNNNNN/); "
                              "train first, or point at another run")
    latest = ckpts[-1]
    if str(which).isdigit():
        step = int(which)
        for ckpt in ckpts:
            if ckpt.name == f"{PREFIX}{step:07d}":
                return ckpt, f"the checkpoint at step {step}", False
        kept = _steps(ckpts)
        raise CheckpointError(f"{path} has no checkpoint at step {step}; it keeps steps "
                              f"{kept}: give one of those, or --checkpoint best or latest")
    if which != "best":
        return latest, "the latest checkpoint", False
    step = best_step(path)
    best = path / CKPT_DIR / f"{PREFIX}{step:07d}" if step is not None else None
    if best is None or not best.is_dir():
        return latest, ("the latest checkpoint: no best.json names an evaluated checkpoint "
                        "that is still there"), True
    if step == 0 and latest != best and _last_eval(latest) == 0:
        return latest, ("the latest checkpoint: the best by validation loss is step 0, the "
                        "weights before training, and no later step was evaluated "
                        "(--checkpoint 0 for step 0)"), True
    loss = (read_json(path / "best.json") or {}).get("val_loss")
    shown = f"{loss:.4f} " if isinstance(loss, float) else ""
    return best, f"the best by validation loss: {shown}at step {step}", False


def _last_eval(ckpt: Path) -> int | None:
    """The last step evaluated when `ckpt` was written (a checkpoint from before this
    was recorded was always written right after evaluating its own step)."""
    state = read_json(ckpt / "state.json") or {}
    last = state.get("last_eval", state.get("step"))
    return last if isinstance(last, int) else None


def verified_json(ckpt: Path, name: str) -> dict:
    """One JSON file of a checkpoint, checked against the hash its state.json records."""
    path = ckpt / name
    wrong = _file_problem(ckpt, name, readable_state(ckpt)["files"].get(name))
    if wrong:
        raise CheckpointError(f"{wrong} {use_another(ckpt)}")
    data = read_json(path)
    if data is None:
        raise CheckpointError(f"checkpoint file {path} is not a JSON object")
    return data


def run_config_json(ckpt: Path) -> dict:
    """A checkpoint's config.json, hash-checked and held to RUN_CONFIG_SCHEMA; else the
    error naming it. The hashes catch damage, not an edit with hashes recomputed: the
    schema and `refuse_too_large_model` are what stand between such a file and a model
    built from it."""
    data = verified_json(ckpt, "config.json")
    problems = config_problems(data, RUN_CONFIG_SCHEMA)
    if problems:
        raise CheckpointError(f"{ckpt / 'config.json'} cannot describe a model of this project "
                              f"({first_problems(problems)}); it is corrupt or edited: "
                              f"{use_another(ckpt)}")
    return data


def refuse_too_large_model(cfg, path: Path) -> None:
    """The one size check before a model is built from a config read from a file (a
    run's or a transformers folder's): refused, naming `path`, when loading it would
    take more memory than this machine has free. The sizes are the built model's
    (engine.budget.model_sizes), so no field that sizes a tensor is left out."""
    from engine.budget import available_bytes, model_sizes
    from model import ModelError
    try:
        params, buffers, largest = model_sizes(cfg)
    except ModelError as err:
        raise CheckpointError(f"{path}: {err}") from err      # the cause: a value refused
    refuse_too_large(params, path, available_bytes(torch.device("cpu")), buffers, largest)


def readable_state(ckpt: Path) -> dict:
    """A checkpoint's state.json with its step and file hashes, or the error that names
    it (not the file whose hash it would have given)."""
    state, wrong = _read_state(ckpt)
    if wrong:
        raise CheckpointError(f"{wrong} {use_another(ckpt)}")
    return state


def verify(ckpt: Path, train_state: bool = True) -> dict:
    """state.json, once it and every file it lists (but the optimizer's, without
    `train_state`) are checked against its hashes; else the error naming the file."""
    state = readable_state(ckpt)
    wrong = _damaged_file(ckpt, state, train_state)
    if wrong:
        raise CheckpointError(f"{wrong} {use_another(ckpt)}")
    return state


def _read_state(ckpt: Path) -> tuple[dict, str]:
    """(state.json, "") or ({}, what is wrong with it), without the remedy, which looks
    at the run's other checkpoints through here."""
    if kind := odd_kind(ckpt / "state.json"):
        return {}, (f"checkpoint file {ckpt / 'state.json'} is {kind}, not a plain file; the "
                    "checkpoint is incomplete or corrupt:")
    state = read_json(ckpt / "state.json")
    problems = config_problems(state, STATE_SCHEMA) if state is not None else ["not a JSON object"]
    manifest = (state or {}).get("files")
    if not problems and not all(isinstance(v, str) for v in manifest.values()):
        problems = ["files holds a hash that is not a string"]
    if problems:
        return {}, (f"checkpoint {ckpt} has no readable state.json ({ckpt / 'state.json'} is "
                    "missing, not JSON, or without its step, a whole number from 0, and file "
                    f"hashes: {first_problems(problems)}); it is incomplete or corrupt:")
    # A name is read from the file, so it may point anywhere: it is hashed or read only
    # where it stays inside the checkpoint's folder.
    outside = [name for name in manifest if inside(ckpt, name) is None]
    if outside:
        return {}, (f"checkpoint {ckpt / 'state.json'} names {outside[0][:200]!r}, which is not "
                    f"a file inside {ckpt}; it is corrupt or edited:")
    named = ckpt.name.removeprefix(PREFIX)
    if ckpt.name.startswith(PREFIX) and named.isdigit() and int(named) != state["step"]:
        # state.json is not covered by its own hashes: an edited step would resume the
        # schedule, the data and the checkpoint names from somewhere else.
        return {}, (f"checkpoint {ckpt} is named for step {int(named)} but its state.json "
                    f"says step {state['step']} ({ckpt / 'state.json'}); it is corrupt or edited:")
    return state, ""


def _damaged_file(ckpt: Path, state: dict, train_state: bool = True) -> str:
    """The first file of `ckpt` that is missing or does not match its hash, said as a
    refusal without the remedy; "" where all match."""
    for name, digest in state["files"].items():
        if name == TRAIN_STATE and not train_state:
            continue
        if wrong := _file_problem(ckpt, name, digest):
            return wrong
    return ""


def _file_problem(ckpt: Path, name: str, digest) -> str:
    """What is wrong with file `name` of `ckpt` against its recorded `digest`, said as a
    refusal without the remedy; "" where it matches. A folder or a pipe in its place is
    named for what it is, found without opening it (a pipe's open would wait)."""
    file = inside(ckpt, name)                   # _read_state refused any name outside
    if file is not None and (kind := odd_kind(file)):
        return f"checkpoint file {ckpt / name} is {kind}, not a plain file, so it is not the one saved;"
    if not isinstance(digest, str) or file is None or not file.is_file() or file_sha256(file) != digest:
        return f"checkpoint file {ckpt / name} is missing or corrupt (its hash does not match state.json);"
    return ""


def _intact(ckpt: Path) -> bool:
    """Whether a checkpoint passes the checks a load makes of its files: the refusal of
    another checkpoint offers only those that would load."""
    state, wrong = _read_state(ckpt)
    return not wrong and not _damaged_file(ckpt, state)


def load(ckpt: Path, train_state: bool = True) -> tuple[dict, dict, dict]:
    """(model tensors, train-state tensors, state.json), every file checked first.
    Without `train_state` (sampling, looking inside: only the weights are needed) the
    optimizer's file is neither checked nor read, so a damaged one blocks a resume alone,
    and the train-state tensors come back empty."""
    state = verify(ckpt, train_state)
    weights = _safetensors(ckpt, "model.safetensors")
    tensors = _safetensors(ckpt, TRAIN_STATE) if train_state else {}
    return weights, tensors, state


def _safetensors(ckpt: Path, name: str) -> dict:
    try:
        return load_file(ckpt / name)
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {ckpt / name} cannot be read as safetensors "
                              f"({err}); {use_another(ckpt)}") from None


def _finite(t: torch.Tensor) -> bool:
    # The extremes are NaN or infinite when any value is: no mask the size of the tensor.
    if not t.is_floating_point() or t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def weights_file(origin: Path) -> Path:
    """The file the weights from `origin` were read from, to name in a refusal: a
    checkpoint folder's model.safetensors; else `origin` (a transformers folder, whose
    weights may be several files)."""
    single = Path(origin) / "model.safetensors"
    return single if single.is_file() else Path(origin)


def refuse_non_finite(weights: dict, origin: Path) -> None:
    bad = [n for n, t in weights.items() if not _finite(t)]
    if bad:
        raise CheckpointError(f"checkpoint {weights_file(origin)} holds NaN or infinite weights ({', '.join(bad[:3])}); "
                              f"{use_another(origin)}")


def refuse_misfit(skeleton: torch.nn.Module, weights: dict, origin: Path) -> None:
    """Before a model is built: refuse weights whose names or shapes the model of
    `skeleton` (GPT.skeleton: shapes only, no memory) would not take, so a config edited
    to a larger model is refused for its shapes without that model being allocated. (A
    missing tensor is load_weights' to find: on the meta device every tensor looks tied.)"""
    _refuse_unfit(skeleton.state_dict(), weights, origin, missing=set())


def _refuse_unfit(own: dict, weights: dict, origin: Path, missing: set) -> None:
    unexpected = set(weights) - set(own)
    wrong = [n for n in weights if n in own and weights[n].shape != own[n].shape]
    # load_state_dict casts whatever it is given: int32 weights would load as floats
    # silently. A float of another width (a transformers folder's fp16) is a weight.
    kind = [n for n in weights if n in own and n not in wrong and _dtype_misfit(weights[n], own[n])]
    if missing or unexpected or wrong or kind:
        detail = "; ".join(filter(None, [
            f"missing {sorted(missing)[:4]}" if missing else "",
            f"unexpected {sorted(unexpected)[:4]}" if unexpected else "",
            "shape differs for " + ", ".join(f"{n} {tuple(weights[n].shape)} vs {tuple(own[n].shape)}"
                                             for n in wrong[:3]) if wrong else "",
            "dtype differs for " + ", ".join(f"{n} {_dtype(weights[n])} vs {_dtype(own[n])}"
                                             for n in kind[:3]) if kind else ""]))
        raise CheckpointError(f"checkpoint {weights_file(origin)} does not fit this model config: {detail}")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dtype_misfit(given: torch.Tensor, own: torch.Tensor) -> bool:
    if own.is_floating_point():
        return not given.is_floating_point()
    return given.dtype != own.dtype


def _refuse_other_model(origin: Path) -> None:
    """A checkpoint whose weights file records the model section it was saved with
    (SAVED_FOR), held against its config.json: the names and shapes of two mechanisms
    can be the same (linear attention's and multi-head's), so a config.json edited from
    one to the other, its hash recomputed, would load the weights into the other's maths
    without a word. A file saved before this was recorded has nothing to hold it to."""
    origin = Path(origin)
    if not (origin / "state.json").is_file() or not (origin / "config.json").is_file():
        return                                       # a transformers folder
    try:
        with safe_open(origin / "model.safetensors", "pt") as f:
            saved = (f.metadata() or {}).get(SAVED_FOR)
    except (SafetensorError, OSError, ValueError):
        return                                       # the load itself says what is wrong
    if saved is None:
        return
    try:
        saved = json.loads(saved)
    except ValueError:
        saved = None
    config = (read_json(origin / "config.json") or {}).get("model")
    if saved == config:
        return
    both = isinstance(saved, dict) and isinstance(config, dict)
    differ = sorted(k for k in {*saved, *config} if saved.get(k) != config.get(k)) if both else []
    said = ", ".join(f"model.{k}={saved.get(k)!r:.40} in the weights, {config.get(k)!r:.40} in "
                     "config.json" for k in differ[:2]) or "its model section"
    raise CheckpointError(f"checkpoint {origin / 'model.safetensors'} was saved for another model "
                          f"than its config.json describes ({said}); the config is edited: "
                          f"{use_another(origin)}")


def load_weights(model: torch.nn.Module, weights: dict, origin: Path, assign: bool = False,
                 finite_checked: bool = False) -> None:
    """Load weights, allowing only tied tensors to be absent; refuse shape mismatches
    and (unless refuse_non_finite already did) NaN or infinite values. assign=True makes
    the given tensors the model's own instead of copying them in (a model built with
    GPT.unfilled, whose weights were never written), and ties again what was tied."""
    if not finite_checked:
        refuse_non_finite(weights, origin)
    own = model.state_dict()
    tied = {n: m for n in own if n not in weights for m in weights
            if m in own and storage_ptr(own[n]) == storage_ptr(own[m])}
    _refuse_unfit(own, weights, origin, missing=set(own) - set(weights) - set(tied))
    _refuse_other_model(origin)
    model.load_state_dict(weights, strict=False, assign=assign)
    if assign:
        for name, source in tied.items():        # assign= replaced the shared tensor on one side
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(source))


def train_into(run: Path) -> str:
    """How to train a run that holds no checkpoint yet: into its own folder again, by
    its name (set-up keeps its folder and writes its config and tokenizer afresh)."""
    return (f"train into it again with python train.py --config PRESET "
            f"{word(f'--train.out_dir={run.parent}')} {word(f'--train.run_name={run.name}')} "
            "(the preset and options it was started with)")


def latest_run(out_dir: str | Path = "runs", log=None, other: str = "--run DIR",
               trained: bool = False) -> Path:
    """The run in OUT_DIR whose newest checkpoint was written last: the one trained
    most recently, not the one created last (a short trial started while a long run
    trains) nor one that stopped before its first checkpoint. With `trained` (the tools
    that read a model), the newest that evaluated past step 0 (a finished run always
    has): a run stopped before that holds weights that learned nothing worth reading,
    and --resume, which wants it, passes no `trained`. `log` gets one line naming it and
    `other`, the option that names another (train.py's is --resume DIR)."""
    out_dir = Path(out_dir)
    if blocking := file_in_the_way(out_dir):
        raise CheckpointError(f"{blocking} is a file, not a folder of runs; give the folder "
                              "the runs are in, or a run directory")
    found = []                                   # (written, name, last step evaluated)
    for run in (out_dir.iterdir() if out_dir.is_dir() else ()):
        ckpts = list_checkpoints(run) if run.is_dir() and (run / "config.json").is_file() else []
        try:
            written = (ckpts[-1] / "state.json").stat().st_mtime if ckpts else None
        except OSError:
            written = None
        if written is not None:
            found.append((written, run.name, _last_eval(ckpts[-1]) or 0))
    if not found:
        # The way on trains into this folder, where the next look for a run will find it.
        into = "" if out_dir == Path("runs") else " " + word(f"--train.out_dir={out_dir}")
        # A run that stopped before its first checkpoint (a crash in set-up) leaves its
        # config and tokenizer: named, so that the folder a user sees is accounted for.
        begun = sorted(r for r in (out_dir.iterdir() if out_dir.is_dir() else ())
                       if r.is_dir() and (r / "config.json").is_file())
        if begun:
            raise CheckpointError(f"no trained run found in {out_dir}/: {begun[-1]} stopped "
                                  "before its first checkpoint" + (f" (and {len(begun) - 1} more)"
                                                                   if len(begun) > 1 else "")
                                  + f"; {train_into(begun[-1])}, train a new one with `python "
                                  f"train.py{into}`, or pass a run directory")
        raise CheckpointError(f"no trained run found in {out_dir}/ (no run directory there "
                              f"holds a checkpoint); train one with `python train.py{into}`, "
                              "or pass a run directory")
    newest = max(found)
    why = "the one whose checkpoint was written last"
    if trained and (learned := [f for f in found if f[2] > 0]):
        newest = max(learned)
        why = f"the latest run that trained, evaluated at step {newest[2]}"
        passed = [str(out_dir / f[1]) for f in sorted(found, reverse=True) if f > newest]
        if passed:
            more = f" and {len(passed) - 2} more" if len(passed) > 2 else ""
            why += (f"; not the newer {', '.join(passed[:2])}{more}, stopped before its "
                    "first evaluation")
    elif trained:
        why = "the latest run; none in the folder has been evaluated past step 0 yet"
    run = out_dir / newest[1]
    (log or (lambda line: print(line, file=sys.stderr)))(f"run: {run} ({why}; {other} for another)")
    return run
