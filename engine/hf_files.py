"""The files of a transformers folder, read as untrusted input.

A folder downloaded from the Hub is written by someone else, so everything in it is
checked before it costs memory or reaches outside the folder, as safetensors and
transformers' loading do:

* every file is read through `folder_file`: a plain relative name that, symlinks
  resolved, stays inside the folder (a Hub cache snapshot may also link into its own
  blobs folder); the refusal reads the same whether a file outside exists or not;
* JSON files are read only when they are plain files no larger than a bound (a
  symlink to /dev/zero or a pipe is refused before it is read);
* config.json is checked against a schema (`Field`: type and range of each value the
  reader uses), and the model it describes against the memory there is, before the
  model is built;
* the tensors the safetensors headers list must be exactly the ones the config needs,
  with the shapes it gives and a floating-point dtype (`WeightFiles.check`), before a
  tensor is read.
Each refusal is one CheckpointError naming the file. The readers of each architecture
(engine/interop.py) say what their config and tensors must be.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from common.errors import CheckpointError
from common.files import inside, parse_json_object, read_bounded
from common.schema import Field, config_problems, count, first_problems  # noqa: F401 (re-exported)

CONFIG_LIMIT = 4 << 20         # bytes of config.json (real ones are a few KB)
INDEX_LIMIT = 64 << 20         # of the shard index (one line per tensor: well under 1 MB)
TOKENIZER_LIMIT = 256 << 20    # of tokenizer.json (the largest vocabularies' are ~35 MB)
INDEX = "model.safetensors.index.json"
# What to do about a folder whose files are cut short, garbled or not of one model: a
# download that stopped part-way is the usual cause, and a fresh copy the cure.
FETCH_AGAIN = ("download the folder again (a transfer cut short leaves such files), or "
               "write it anew with save_pretrained (python -m attnlab.export for a run)")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")     # safetensors' names; others are refused

# Caps no real model of these architectures comes near (the largest have ~256k tokens,
# 128k positions, 126 layers and a width of 16k); within them the memory check decides.
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 22
MAX_LAYERS = 1 << 10
MAX_WIDTH = 1 << 16
MAX_HEADS = 1 << 12


# -- where a folder's files may be ----------------------------------------------------

def folder_roots(folder: Path) -> tuple[Path, ...]:
    """Where the files of `folder` may be once symlinks are resolved: the folder, and
    for a snapshot in the Hugging Face cache (.../models--NAME/snapshots/REVISION, whose
    files are links to ../../blobs/HASH) that repository's blobs folder."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return tuple(roots)


def folder_file(folder: Path, name, named_in: Path | None = None) -> Path:
    """The resolved path of the file `name` in `folder` (a name the file `named_in`
    gives, or one of the folder's own), refused unless it stays inside the folder
    (common/files.py's `inside`, the one confinement rule)."""
    target = inside(folder, name, folder_roots(folder))
    if target is None:
        what = (f"{named_in} names {str(name)[:200]!r}, which is not a file inside {folder}"
                if named_in else f"{folder / name} leads outside {folder}")
        raise CheckpointError(f"{what}; a transformers folder holds its own files (copy the "
                              "file in instead of naming or linking a path outside the folder)")
    return target


def read_folder_bytes(folder: Path, name: str, limit: int) -> bytes:
    """The bytes of folder/name: confined to the folder, a plain file, at most `limit`."""
    path = folder_file(folder, name)
    try:
        return read_bounded(path, limit)
    except FileNotFoundError:
        raise CheckpointError(f"{folder / name} is missing; {FETCH_AGAIN}") from None
    except ValueError as err:
        raise CheckpointError(f"{folder / name} {err}; it cannot be this folder's {name}") from None
    except OSError as err:
        raise CheckpointError(f"{folder / name} cannot be read ({err.strerror or err})") from None


def read_folder_json(folder: Path, name: str, limit: int = CONFIG_LIMIT) -> dict:
    """A JSON object from folder/name, read as `read_folder_bytes` reads."""
    data = read_folder_bytes(folder, name, limit)
    try:
        return parse_json_object(data)
    except ValueError as err:
        raise CheckpointError(f"{folder / name} {err}; {FETCH_AGAIN}") from None


# -- config.json against a schema (common/schema.py) ---------------------------------

def checked_config(config: dict, schema: dict[str, Field], path: Path) -> dict:
    """`config` when every value `schema` names has its type and range; else one
    CheckpointError naming the file and the first few values that are wrong."""
    problems = config_problems(config, schema)
    if problems:
        raise CheckpointError(f"{path} cannot describe a model attnlab reads: "
                              + first_problems(problems) + "; fix those values, or " + FETCH_AGAIN)
    return config


def refuse_too_large(params: int, path: Path, memory: int | None, buffers: int = 0,
                     largest: str = "") -> None:
    """Before anything is allocated: a model of `params` parameters is mapped and used
    as float32, 4 bytes a parameter, with room for a file of another precision converted
    beside its mapping and the tensors the mapping rebuilds: 8 bytes a parameter at
    most, and 4 for each number of its `buffers` (computed, not read). Refuse it when
    that is more than the `memory` free (None: unknown, then 64 GiB); `largest` names
    its largest tensor, in words."""
    need, have = 8 * params + 4 * buffers, memory if memory is not None else 64 << 30
    if need > have:
        raise CheckpointError(
            f"{path} describes a model of about {params:,.3g} parameters"
            + (f" and {buffers:,.3g} buffer numbers" if 4 * buffers > have / 8 else "")
            + f", which takes {need / 2**30:,.3g} GiB to load, and {have / 2**30:,.1f} GiB is "
            "free; it is too large for this machine (or its config.json is wrong"
            + (f": its largest tensor is {largest}" if largest else "") + ")")


# -- the safetensors files ----------------------------------------------------------

class WeightFiles:
    """The safetensors of a folder, one file or shards named by the index, each
    confined to the folder; their headers are read at once (names, dtypes, shapes),
    tensors one at a time when asked for (memory stays near the model's own size).
    `prefix` is the architecture's base-model prefix, which a folder saved from the
    base model (no output layer) leaves off every name."""

    def __init__(self, folder: Path, prefix: str = ""):
        from safetensors import safe_open
        self.folder, self.prefix = folder, prefix
        index_path = folder / INDEX
        weight_map = None
        if os.path.lexists(index_path):
            index = read_folder_json(folder, INDEX, INDEX_LIMIT)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} names no tensors (its weight_map is "
                                      f"missing, empty or not an object); {FETCH_AGAIN}")
            odd = [k for k, v in weight_map.items() if not isinstance(v, str)]
            if odd:
                raise CheckpointError(f"{index_path} gives no file name for {odd[0][:100]!r}; "
                                      + FETCH_AGAIN)
            files, self.source = sorted(set(weight_map.values())), index_path
        elif os.path.lexists(folder / "model.safetensors"):
            files, self.source = ["model.safetensors"], folder / "model.safetensors"
        else:
            pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            hint = (f" ({', '.join(pickled)} are pickles, which attnlab never loads: save the model "
                    "again with save_pretrained(folder, safe_serialization=True))") if pickled else ""
            raise CheckpointError(f"{folder} has no model.safetensors or {INDEX}{hint}")
        self.handles, self.where, self.header = {}, {}, {}
        for name in files:
            path = folder_file(folder, name, index_path if weight_map is not None else None)
            if not path.is_file():
                raise CheckpointError(f"{self.source} names {name!r}, which is not a file in "
                                      f"{folder}; {FETCH_AGAIN}")
            try:
                handle = safe_open(str(path), framework="pt")
                for key in handle.keys():
                    if key in self.where:
                        raise CheckpointError(f"{folder / name} and {folder / self.where[key]} "
                                              f"both hold {key}; {FETCH_AGAIN}")
                    part = handle.get_slice(key)
                    self.header[key] = (part.get_dtype(), tuple(part.get_shape()))
                    self.where[key] = name
            except CheckpointError:
                raise
            except Exception as err:        # safetensors raises its own error types
                raise CheckpointError(f"{folder / name} cannot be read as safetensors ({err}); "
                                      + FETCH_AGAIN) from None
            self.handles[name] = handle
        if weight_map is not None:
            elsewhere = [k for k, v in weight_map.items() if self.where.get(k) != v]
            if elsewhere:
                k = elsewhere[0]
                raise CheckpointError(f"{index_path} puts {k[:100]} in {weight_map[k][:100]}, "
                                      f"which does not hold it; {FETCH_AGAIN}")
            unlisted = [k for k in self.where if k not in weight_map]
            if unlisted:
                raise CheckpointError(f"{folder / self.where[unlisted[0]]} holds {unlisted[0]}, "
                                      f"which {INDEX} does not list; {FETCH_AGAIN}")

    def find(self, *names: str) -> str | None:
        """The name under which the files hold the first of `names` that they hold
        (with or without the base-model prefix)."""
        for name in names:
            short = name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else None
            for candidate in (name, short):
                if candidate in self.where:
                    return candidate
        return None

    def check(self, expected: dict[str, tuple], aliases: dict[str, tuple[str, ...]] | None = None,
              ignored: tuple[str, ...] = (), allowed: dict[str, tuple] | None = None,
              n_layer: int | None = None) -> None:
        """Refuse, naming the tensors, unless the files hold every `expected` tensor
        (or one of its `aliases`) with that shape, nothing else except names matching an
        `ignored` pattern (buffers transformers also skips) and the `allowed` ones with
        their shapes, and only floating-point dtypes. Reads headers only."""
        aliases, allowed = aliases or {}, allowed or {}
        seen, missing, wrong, dtypes = set(), [], [], []
        wanted = [(name, shape, (name, *aliases.get(name, ()))) for name, shape in expected.items()]
        wanted += [(name, shape, (name,)) for name, shape in allowed.items()]
        for name, shape, names in wanted:
            key = self.find(*names)
            if key is None:
                if name not in allowed:
                    missing.append(name)
                continue
            seen.add(key)
            dtype, got = self.header[key]
            if dtype not in FLOAT_DTYPES:
                dtypes.append(f"{key} ({dtype})")
            elif got != tuple(shape):
                wrong.append(f"{key} {list(got)} where config.json gives {list(shape)}")
        extra = sorted(k for k in self.where if k not in seen and not any(re.search(p, k) for p in ignored))
        if not (missing or wrong or dtypes or extra):
            return
        layers = [int(m.group(1)) for k in extra for m in [re.search(r"\.(\d+)\.", k)] if m]
        deeper = (f" (the files have {max(layers) + 1} layers, config.json says {n_layer})"
                  if n_layer is not None and layers and max(layers) >= n_layer else "")
        listed = lambda names: ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts = [f"missing {listed(missing)}" if missing else "",
                 f"unexpected {listed(extra)}{deeper}" if extra else "",
                 f"shape differs: {listed(wrong)}" if wrong else "",
                 f"not floating point: {listed(dtypes)} (attnlab reads float16, bfloat16, "
                 "float32 and float64 weights, not quantised or integer ones)" if dtypes else ""]
        raise CheckpointError(f"{self.source} does not hold the weights its config.json "
                              "describes: " + "; ".join(p for p in parts if p) + "; "
                              + FETCH_AGAIN)

    def get(self, *names: str) -> torch.Tensor:
        """The first of `names` the files hold (also without the base-model prefix)."""
        key = self.find(*names)
        if key is None:
            raise CheckpointError(f"weight {names[0]} is missing from {self.source}; {FETCH_AGAIN}")
        try:
            return self.handles[self.where[key]].get_tensor(key)
        except Exception as err:
            raise CheckpointError(f"{self.folder / self.where[key]} cannot be read ({err}); "
                                  + FETCH_AGAIN) from None
