"""Your code in the real training loop: `yours` in the attention, position, mechanism and
MLP registries, and `yours_sinks` and `yours_gated` in the mechanisms.

`install()` adds the entries, as any backend, encoding, mechanism or MLP is added, so
`--model.attention=yours`, `--model.position=yours`, `--model.mechanism=yours`,
`--model.mechanism=yours_sinks` (or `yours_gated`) and `--model.mlp=yours` pass the config's checks and
appear in --help. `prepare(config, folder)` then loads the learner's functions from their
folder, refusing any exercise that has not passed its check, and binds them. The folder
comes from the command line (`folder_for`), never from a run's files:

* attention: exercise 1's scaled_dot_product_attention, given the mask the project's
  rule builds (causal, window, padding) as a bool matrix;
* position: exercise 5's apply_rope (turning q and k in every layer), or, while that
  one has not passed, exercise 4's sinusoidal_positions (added to the embeddings);
* mechanism `yours`: linear attention (model/linear_attention.py, its entry's facts and
  cache) whose sums exercise 9's linear_attention_step makes, token by token;
* mechanism `yours_sinks`: sink attention (model/sink_attention.py, its learned sinks,
  entry and cache) whose weights exercise 10's sink_attention computes;
* mechanism `yours_gated`: gated attention (model/gated_attention.py) whose output gate
  and W_O exercise 12's gated_output applies;
* mlp: the mixture of experts (model/moe.py, its experts and router's logits) whose
  routing and sum exercise 11's moe_layer makes.

model/ never imports this floor: the entries are registered from above, by the script."""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from model import registry as model_registry
from model.attention import ATTENTION_BACKENDS, Backend
from model.config import ModelConfig
from model.gated_attention import GatedAttention
from model.layers import MLPS
from model.linear_attention import LinearAttention, LinearState
from model.mechanisms import MECHANISMS, names_used
from model.moe import MOE_ROUTERS, MixtureOfExperts
from model.positions import POSITION_ENCODINGS, PositionEncoding
from model.sink_attention import SinkAttention
from attnlab.exercises.checks import BY_NAME
from attnlab.exercises.learner import DEFAULT_FOLDER, ExerciseError, passed_function
from attnlab.exercises.reference import over_tokens

NAME = model_registry.RESERVED
SINKS = f"{NAME}_sinks"        # exercise 10's mechanism (exercise 9's is `yours`)
GATED = f"{NAME}_gated"        # exercise 12's
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

    @staticmethod
    def refusal(config: ModelConfig) -> str | None:
        """Why the config asks what your function cannot do, or None."""
        return None

    def sums(self, q, k, v, state):
        step = type(self).learner
        if step is None:
            raise ExerciseError("model.mechanism=yours has not been prepared: the script that "
                                "builds the model calls attnlab.exercises.plug.prepare first")
        y, S, z = over_tokens(step, q, k, v, state.S, state.z)     # (B, H, T, D), the state
        return y, LinearState(S, z)


class YourSinkAttention(SinkAttention):
    """Sink attention whose weights your sink_attention computes, with this layer's
    learned sinks: the same maths as the project's, so the same losses within rounding."""
    learner = None             # set on the subclass prepare() makes

    @staticmethod
    def refusal(config: ModelConfig) -> str | None:
        if config.dropout:
            return f"your sink attention has no dropout; set model.dropout=0 with it ({SINKS})"
        if POSITION_ENCODINGS[config.position].biases_scores:
            return (f"model.position={config.position} adds a bias to the scores, which your "
                    f"sink attention has no argument for; use rope with model.mechanism={SINKS}")
        return None

    def attend(self, q, k, v, mask, need_weights: bool = False):
        attend = type(self).learner
        if attend is None:
            raise ExerciseError(f"model.mechanism={SINKS} has not been prepared: the script "
                                "that builds the model calls attnlab.exercises.plug.prepare first")
        visible = None if mask.sees_everything else mask.dense     # (Tq, Tk) or (B, 1, Tq, Tk)
        out, weights = attend(q, k, v, self.sinks.to(q.dtype), visible)
        return out, (weights if need_weights else None)


class YourGatedAttention(GatedAttention):
    """Gated attention whose output gate and W_O your gated_output applies, with this
    layer's W_G and W_O (model.bias=false: your function takes no biases)."""
    learner = None             # set on the subclass prepare() makes

    @staticmethod
    def refusal(config: ModelConfig) -> str | None:
        return (f"your gated_output takes W_G and W_O without biases; set model.bias=false "
                f"with model.mechanism={GATED}") if config.bias else None

    def output(self, x, y):
        gate = type(self).learner
        if gate is None:
            raise ExerciseError(f"model.mechanism={GATED} has not been prepared: the script "
                                "that builds the model calls attnlab.exercises.plug.prepare first")
        # nn.Linear keeps its weight as (out, in): y = x @ weight.T, so W = weight.T.
        return gate(x, y, self.w_gate.weight.T, self.w_o.weight.T)


class YourMixtureOfExperts(MixtureOfExperts):
    """The mixture of experts whose routing and weighted sum your moe_layer makes, given
    this layer's router logits and its experts as functions."""
    learner = None             # set on the subclass prepare() makes

    @staticmethod
    def refusal(config: ModelConfig) -> str | None:
        if MOE_ROUTERS[config.moe_router] is MOE_ROUTERS["softmax_topk"]:
            return None
        return (f"your moe_layer weights the chosen experts by a softmax over their logits, "
                f"gpt-oss's router; model.moe_router={config.moe_router} weights them otherwise: "
                "set model.moe_router=softmax_topk and model.moe_bias_rate=0 (the gpt-oss "
                "preset has both)")

    def forward(self, x):
        layer = type(self).learner
        if layer is None:
            raise ExerciseError("model.mlp=yours has not been prepared: the script that builds "
                                "the model calls attnlab.exercises.plug.prepare first")
        u = x.reshape(-1, x.shape[-1])                            # (N, C): every token on its own
        logits = self.router_logits(u)                            # (N, E_routed)
        if self.training:          # the load shown per layer, counted by the project's router
            _, picked = self.router_kind.route(logits.detach(), self.balance_bias, self.top_k)
            picks = torch.bincount(picked.flatten(), minlength=self.n_routed)
            self.picks = picks if self.picks is None else self.picks + picks
        shared = [partial(self.expert, e) for e in range(self.n_shared)]
        routed = [partial(self.expert, self.n_shared + e) for e in range(self.n_routed)]
        out = layer(u, logits, routed, shared, self.top_k)
        return self.dropout(out.to(x.dtype).reshape(x.shape))


# Each mechanism the learner writes: its name -> (the exercise, the layer it runs in).
MECHANISM_EXERCISES = {NAME: ("linear_rnn", YourLinearAttention),
                       SINKS: ("sinks", YourSinkAttention),
                       GATED: ("gate", YourGatedAttention)}


def _entries() -> list[tuple[str, str, object]]:
    """(registry, name, entry) for each place the learner's code plugs in. A mechanism is
    the project's entry, its cache and facts, with your layer in it."""
    return [("attention", NAME, YOUR_BACKEND), ("position", NAME, YourPositions),
            ("mechanism", NAME, replace(MECHANISMS["linear"], layer=YourLinearAttention)),
            ("mechanism", SINKS, replace(MECHANISMS["sinks"], layer=YourSinkAttention)),
            ("mechanism", GATED, replace(MECHANISMS["gated"], layer=YourGatedAttention)),
            ("mlp", NAME, YourMixtureOfExperts)]


def install() -> None:
    """Register the learner's entries in their registries (idempotent)."""
    for registry, name, entry in _entries():
        if model_registry.foreign_reserved(registry, name):
            raise ExerciseError(f"model.{registry}={name}: an entry named {name!r} is registered "
                                "by other code, and the exercises plug the learner's code in "
                                "under that name; register it under another name")
        if name not in model_registry.REGISTRIES[registry]:
            model_registry.plug_in(registry, name, entry)


def _yours(mechanism) -> bool:
    return mechanism is not None and issubclass(mechanism.layer, tuple(
        base for _, base in MECHANISM_EXERCISES.values()))


def chosen(config: ModelConfig) -> tuple[bool, bool, bool, bool]:
    """(attention, position, mechanism, mlp): whether the config picks the learner's entry
    for each (the mechanism in any layer)."""
    position, mlp = POSITION_ENCODINGS.get(config.position), MLPS.get(config.mlp)
    return (ATTENTION_BACKENDS.get(config.attention) is YOUR_BACKEND,
            isinstance(position, type) and issubclass(position, YourPositions),
            any(_yours(MECHANISMS.get(name)) for name in names_used(config)),
            isinstance(mlp, type) and issubclass(mlp, YourMixtureOfExperts))


def prepare(config: ModelConfig, folder: Path | None) -> list[str]:
    """Load and bind the learner's code the config asks for; lines saying what is used.
    Refuses (ExerciseError) an exercise that is missing or has not passed; nothing to do
    where `folder` is None (folder_for: the config picks no `yours`)."""
    if folder is None:
        return []
    attention, position, mechanism, mlp = chosen(config)
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
        notes += _bind_mechanisms(config, folder)
    if mlp:
        notes.append(_bind(config, folder, "mlp", NAME, "top_k_routing", YourMixtureOfExperts))
    return notes


def _bind_mechanisms(config: ModelConfig, folder: Path) -> list[str]:
    """Each of the learner's mechanisms the config's layers use, bound to its exercise."""
    return [_bind(config, folder, "mechanism", name, ex_name, base)
            for name, (ex_name, base) in MECHANISM_EXERCISES.items() if name in names_used(config)]


def _bind(config: ModelConfig, folder: Path, registry: str, name: str, ex_name: str, base) -> str:
    """Register under `name` a subclass of `base` that runs the learner's function for
    exercise `ex_name` (refused where the config asks what that function cannot do); the
    line saying so."""
    why = base.refusal(config)
    if why:
        raise ExerciseError(why)
    ex = BY_NAME[ex_name]
    layer = type(base.__name__, (base,), {"learner": staticmethod(passed_function(ex, folder))})
    model_registry.plug_in(registry, name, layer if registry == "mlp" else
                           replace(MECHANISMS[name], layer=layer))
    return f"{registry}: {name} ({ex.function} in {folder / ex.filename})"


KINDS = ("attention", "position", "mechanism", "mlp")  # the fields `chosen` answers for, in order


def typed(config: ModelConfig, model_options: dict) -> bool:
    """Whether every `yours` the config picks was named by `model_options`, the model
    options of this command line (`--model.attention=yours`)."""
    named = {key: [n.strip() for n in str(value).split(",")]
             for key, value in model_options.items()}
    return all(name in named.get(kind, ()) for kind, name in yours_named(config))


def yours_named(config: ModelConfig) -> list[tuple[str, str]]:
    """(field, name) for each of the learner's entries the config picks."""
    found = []
    for kind, on in zip(KINDS, chosen(config)):
        used = names_used(config) if kind == "mechanism" else [getattr(config, kind)]
        found += [(kind, n) for n in used if on and model_registry.is_reserved(n)]
    return found


def folder_for(config: ModelConfig, given: str | None, read_from: str | Path | None) -> Path | None:
    """The folder the learner's code for `config` comes from; None where the config
    picks no `yours`. `given` is --exercises. A `yours` typed on this command line
    (`read_from` None) may leave it out for my_attention, the folder `exercises start`
    makes. A config read from a file (`read_from` names it: a run, a checkpoint, a
    preset) may not: a run someone shares must never choose code to run, so the folder
    comes from the learner's command line alone, and a run records only *that* it was
    trained with the learner's code (its config says `yours`), never where that was."""
    used = yours_named(config)
    if not used:
        return None
    if given:
        return Path(given)
    if read_from is None:
        return Path(DEFAULT_FOLDER)
    field, name = used[0]
    raise ExerciseError(f"{read_from} asks for your own code (model.{field}={name}), and no "
                        "file says where that code is: give your exercises folder on the command "
                        f"line with --exercises DIR ({DEFAULT_FOLDER}, where python -m "
                        "attnlab.exercises start puts it)")
