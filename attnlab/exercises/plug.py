"""Your code in the real training loop: `yours` in the attention, position and mechanism
registries.

`install()` adds one entry to each registry, as any backend, encoding or mechanism is
added, so `--model.attention=yours`, `--model.position=yours` and `--model.mechanism=yours`
pass the config's checks and appear in --help. `prepare(config, folder)` then loads the
learner's functions from their folder, refusing any exercise that has not passed its
check, and binds them. The folder comes from the command line (`folder_for`), never from
a run's files:

* attention: exercise 1's scaled_dot_product_attention, given the mask the project's
  rule builds (causal, window, padding) as a bool matrix;
* position: exercise 5's apply_rope (turning q and k in every layer), or, while that
  one has not passed, exercise 4's sinusoidal_positions (added to the embeddings);
* mechanism: linear attention (model/linear_attention.py, its entry's facts and cache)
  whose sums exercise 9's linear_attention_step makes, token by token.

model/ never imports this floor: the entries are registered from above, by the script."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from model import registry as model_registry
from model.attention import ATTENTION_BACKENDS, Backend
from model.config import ModelConfig
from model.linear_attention import LinearAttention, LinearState
from model.mechanisms import MECHANISMS, names_used
from model.positions import POSITION_ENCODINGS, PositionEncoding
from attnlab.exercises.checks import BY_NAME
from attnlab.exercises.learner import DEFAULT_FOLDER, ExerciseError, passed_function
from attnlab.exercises.reference import over_tokens

NAME = model_registry.RESERVED
_bound: dict = {}              # "attention" -> the learner's function, once prepared


def your_attention(q, k, v, mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The backend signature around the learner's scaled_dot_product_attention."""
    attend = _bound.get("attention")
    if attend is None:
        raise ExerciseError("model.attention=yours has not been prepared: the script that "
                            "builds the model calls attnlab.exercises.plug.prepare first")
    if mask.bias is not None:
        raise ExerciseError("your attention has no score bias; use a position encoding other "
                            "than alibi with model.attention=yours")
    visible = None if mask.sees_everything else mask.dense     # (Tq, Tk) or (B, 1, Tq, Tk)
    out, weights = attend(q, k, v, visible)
    return out, (weights if need_weights else None)


YOUR_BACKEND = Backend(your_attention, returns_weights=True, has_dropout=False)


class YourPositions(PositionEncoding):
    """`yours` before prepare(): no facts yet (prepare swaps in one of the two below)."""


class YourRoPE(YourPositions):
    """Your apply_rope, called on every layer's queries and keys."""
    rotary = True
    learner = None             # set on the subclass prepare() makes

    def rotate(self, x, start):
        # x holds one layer's queries or its keys, (B, heads, T, d_k), as many heads as
        # either has (fewer keys with GQA); apply_rope turns both alike, so x goes in as
        # the queries, beside no keys.
        positions = start + torch.arange(x.shape[-2], device=x.device)
        turned, _ = type(self).learner(x, x[:, :0], positions, self.config.rope_theta)
        return turned


class YourSinusoidal(YourPositions):
    """Your sinusoidal_positions, added to √d_model · the token embeddings (as
    model/positions.py's Sinusoidal does, so the positions do not drown the tokens)."""
    absolute = True
    learner = None

    def embed(self, x, start):
        T, d = x.shape[1], x.shape[2]
        table = torch.as_tensor(type(self).learner(T, d, start))
        return x * math.sqrt(d) + table.to(device=x.device, dtype=x.dtype)


class YourLinearAttention(LinearAttention):
    """Linear attention whose sums your linear_attention_step makes: the RNN form, token
    by token, in place of the chunked parallel form: the same sums in another order, so
    equal within float rounding at each step, near linear's losses over a run, and slower."""
    learner = None             # set on the subclass prepare() makes

    def sums(self, q, k, v, state):
        step = type(self).learner
        if step is None:
            raise ExerciseError("model.mechanism=yours has not been prepared: the script that "
                                "builds the model calls attnlab.exercises.plug.prepare first")
        y, S, z = over_tokens(step, q, k, v, state.S, state.z)     # (B, H, T, D), the state
        return y, LinearState(S, z)


def install() -> None:
    """Register `yours` in the attention, position and mechanism registries (idempotent).
    The mechanism is linear's entry, its cache and facts, with your layer in it."""
    for registry, entry in (("attention", YOUR_BACKEND), ("position", YourPositions),
                            ("mechanism", replace(MECHANISMS["linear"], layer=YourLinearAttention))):
        if model_registry.foreign_reserved(registry):
            raise ExerciseError(f"model.{registry}={NAME}: an entry named {NAME!r} is registered "
                                "by other code, and the exercises plug the learner's code in "
                                "under that name; register it under another name")
        if NAME not in model_registry.REGISTRIES[registry]:
            model_registry.plug_in(registry, NAME, entry)


def _yours(mechanism) -> bool:
    return mechanism is not None and issubclass(mechanism.layer, YourLinearAttention)


def chosen(config: ModelConfig) -> tuple[bool, bool, bool]:
    """(attention, position, mechanism): whether the config picks the learner's entry for
    each (the mechanism in any layer)."""
    position = POSITION_ENCODINGS.get(config.position)
    return (ATTENTION_BACKENDS.get(config.attention) is YOUR_BACKEND,
            isinstance(position, type) and issubclass(position, YourPositions),
            any(_yours(MECHANISMS.get(name)) for name in names_used(config)))


def prepare(config: ModelConfig, folder: Path | None) -> list[str]:
    """Load and bind the learner's code the config asks for; lines saying what is used.
    Refuses (ExerciseError) an exercise that is missing or has not passed; nothing to do
    where `folder` is None (folder_for: the config picks no `yours`)."""
    if folder is None:
        return []
    attention, position, mechanism = chosen(config)
    notes = []
    if attention:
        if POSITION_ENCODINGS[config.position].biases_scores:
            raise ExerciseError(f"model.position={config.position} adds a bias to the scores, "
                                "which your attention has no argument for; use rope, "
                                "sinusoidal, learned, none or yours with model.attention=yours")
        ex = BY_NAME["attention"]
        _bound["attention"] = passed_function(ex, folder)
        notes.append(f"attention: yours ({ex.function} in {folder / ex.filename})")
    if position:
        rope, sinusoidal = BY_NAME["rope"], BY_NAME["sinusoidal"]
        try:
            ex, base = rope, YourRoPE
            fn = passed_function(rope, folder)
        except ExerciseError as not_rope:
            try:
                ex, base = sinusoidal, YourSinusoidal
                fn = passed_function(sinusoidal, folder)
            except ExerciseError:
                raise ExerciseError(f"model.position=yours needs exercise 5 (rope) or 4 "
                                    f"(sinusoidal) to pass; {not_rope}") from None
        model_registry.plug_in("position", NAME,
                               type(base.__name__, (base,), {"learner": staticmethod(fn)}))
        model_registry.check(config)             # the facts changed: check them again
        notes.append(f"position: yours ({ex.function} in {folder / ex.filename})")
    if mechanism:
        ex = BY_NAME["linear_rnn"]
        layer = type(YourLinearAttention.__name__, (YourLinearAttention,),
                     {"learner": staticmethod(passed_function(ex, folder))})
        model_registry.plug_in("mechanism", NAME, replace(MECHANISMS[NAME], layer=layer))
        notes.append(f"mechanism: yours ({ex.function} in {folder / ex.filename})")
    return notes


KINDS = ("attention", "position", "mechanism")     # the fields `chosen` answers for, in order


def typed(config: ModelConfig, model_options: dict) -> bool:
    """Whether every `yours` the config picks was named by `model_options`, the model
    options of this command line (`--model.attention=yours`)."""
    named = {key: [n.strip() for n in str(value).split(",")] for key, value in model_options.items()}
    return all(NAME in named.get(kind, ()) for kind, on in zip(KINDS, chosen(config)) if on)


def folder_for(config: ModelConfig, given: str | None, read_from: str | Path | None) -> Path | None:
    """The folder the learner's code for `config` comes from; None where the config
    picks no `yours`. `given` is --exercises. A `yours` typed on this command line
    (`read_from` None) may leave it out for my_attention, the folder `exercises start`
    makes. A config read from a file (`read_from` names it: a run, a checkpoint, a
    preset) may not: a run someone shares must never choose code to run, so the folder
    comes from the learner's command line alone, and a run records only *that* it was
    trained with the learner's code (its config says `yours`), never where that was."""
    used = [kind for kind, on in zip(KINDS, chosen(config)) if on]
    if not used:
        return None
    if given:
        return Path(given)
    if read_from is None:
        return Path(DEFAULT_FOLDER)
    raise ExerciseError(f"{read_from} asks for your own code (model.{used[0]}=yours), and no "
                        "file says where that code is: give your exercises folder on the command "
                        f"line with --exercises DIR ({DEFAULT_FOLDER}, where python -m "
                        "attnlab.exercises start puts it)")
