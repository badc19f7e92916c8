"""Every variant the config can name, by registry, and the one place that checks a
config's variant names and what each chosen variant needs. Adding a variant is one
entry in its module's dict, with its facts; tests parametrize over these, so it is
tested the day it lands."""
from __future__ import annotations

import difflib
import weakref
from dataclasses import astuple, fields

from model.attention import ATTENTION_BACKENDS, MultiHeadAttention
from model.config import ModelConfig, ModelError, divisors, listed
from model.layers import BLOCKS, MLPS, NORMS
from model.moe import MOE_EXPERTS, MOE_ROUTERS
from model.mechanisms import MECHANISMS, NOT_MECHANISMS, Mechanism, entry_problems, names_used
from model.positions import POSITION_ENCODINGS
import model.partial_rope  # noqa: F401  (registers rope_partial among the positions)
from model.rope_scaling import ROPE_SCALINGS
from model.readout import READOUTS

REGISTRIES = {
    "mechanism": MECHANISMS,
    "attention": ATTENTION_BACKENDS,
    "position": POSITION_ENCODINGS,
    "norm": NORMS,
    "block": BLOCKS,
    "mlp": MLPS,
    "rope_scaling": ROPE_SCALINGS,
    "readout": READOUTS,
    "moe_router": MOE_ROUTERS,
    "moe_expert": MOE_EXPERTS,
}


# The name the exercises give the learner's own code in every registry (attnlab/exercises/
# plug.py), and its forms for a registry with more than one exercise in it (yours_sinks):
# an entry of such a name written by other code would be run as the learner's.
RESERVED = "yours"
_plugged: dict[tuple[str, str], object] = {}     # (registry, name) -> the entry plug_in wrote


def is_reserved(name: str) -> bool:
    """Whether `name` is one the exercises keep for the learner's code."""
    return name == RESERVED or name.startswith(RESERVED + "_")


def plug_in(registry: str, name: str, entry) -> None:
    """Write the exercises' entry under the reserved name; check_names refuses any other."""
    REGISTRIES[registry][name] = entry
    _plugged[(registry, name)] = entry


def foreign_reserved(registry: str, name: str = RESERVED) -> bool:
    """Whether the reserved `name` holds an entry plug_in did not write."""
    entry = REGISTRIES[registry].get(name)
    return entry is not None and entry is not _plugged.get((registry, name))


def _in_order(letters: str, word: str) -> bool:
    rest = iter(word)
    return all(c in rest for c in letters)


def _swapped(name: str, word: str) -> bool:
    return len(name) == len(word) and any(
        name[:i] + name[i + 1] + name[i] + name[i + 2:] == word for i in range(len(name) - 1))


def unknown_name(key: str, name, valid) -> ModelError:
    # The rule of common/errors.py's closest(), kept here: model/ lifts out with torch alone
    # (tests/test_config.py holds the two to the same answers).
    name = str(name)
    same = [v for v in valid if v.lower() == name.lower()]
    swap = [v for v in valid if _swapped(name.lower(), v.lower())]
    short = [v for v in valid if len(name) >= 3 and v[:1] == name[:1] and _in_order(name, v)]
    close = same or swap or difflib.get_close_matches(name, short, n=1, cutoff=0) or \
        difflib.get_close_matches(name, list(valid), n=1, cutoff=0.7)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ModelError(f"unknown {key} {name!r}{hint}; valid choices: {', '.join(sorted(valid))}")


def check_names(config: ModelConfig) -> None:
    """Every variant name a field gives (one per layer for a pattern) is in its registry."""
    for f in fields(config):
        registry, value = f.metadata.get("registry"), getattr(config, f.name)
        names = [n.strip() for n in str(value).split(",")] if f.metadata.get("pattern") else [value]
        for name in names:
            if f.metadata.get("pattern") and not name:
                raise ModelError(f"model.{f.name}={value!r} has an empty entry: name one choice "
                                 "between each pair of commas, with none at either end")
            if registry == "mechanism" and name in NOT_MECHANISMS:
                raise ModelError(f"model.mechanism={name} is not a mechanism of its own: "
                                 f"{NOT_MECHANISMS[name]}")
            if registry and name not in REGISTRIES[registry]:
                raise unknown_name(f"model.{f.name}", name, REGISTRIES[registry])
            if registry and is_reserved(name) and foreign_reserved(registry, name):
                raise ModelError(f"model.{f.name}={name}: the name {name!r} is kept for the "
                                 "exercises' code (attnlab/exercises/plug.py); register your "
                                 "entry under another name")


# id(config) -> (the config's values when it passed `check`, whether the plain GPT builds
# it), while the config lives: a plain model built from it does not check it again, and a
# field changed since changes the values, so the next build checks. Kept here, not on the
# config, so vars(config) stays its fields.
CHECKED: dict[int, tuple[tuple, bool]] = {}

# Fields that, set, ask for a part the plain GPT does not have (GPTWithVariants builds it).
VARIANT_FIELDS = ("n_token_types", "value_embeds", "skip_connections", "zero_head", "logit_softcap",
                  "full_attention_every", "mtp_depth", "embed_scale", "qk_norm_weight",
                  "score_scale", "rope_local_theta", "token_mix", "moe_dense_layers")


def wants_variants(config: ModelConfig) -> bool:
    """Does the config ask for a part the plain GPT does not have? A field of VARIANT_FIELDS,
    a readout, block or MLP entry that is not the plain one, or a mechanism per layer (a
    hybrid such as `linear,mha`, whose blocks BlockWithVariants builds)."""
    plain = (READOUTS[config.readout].plain, BLOCKS[config.block].plain, MLPS[config.mlp].has_weights,
             config.mechanism in MECHANISMS)
    return not all(plain) or any(getattr(config, name) for name in VARIANT_FIELDS)


def check(config: ModelConfig, building: bool = False) -> None:
    """Sizes first, then every variant name, then what the chosen variants need. A config
    as read may leave the vocabulary to the tokenizer (0); one a model is built from
    (`building`) may not, and only a config with its vocabulary is marked as checked."""
    CHECKED.pop(id(config), None)
    if building and config.vocab_size <= 0:
        raise ModelError("model.vocab_size must be set (it comes from the tokenizer)")
    check_head_sizes(config)
    config.validate()
    check_names(config)
    check_mechanisms(config)
    if config.n_global and not config.sliding_window:   # after the mechanisms: some refuse both
        raise ModelError("model.n_global keeps the first tokens visible past a sliding "
                         "window; set model.sliding_window too (without a window every "
                         "token is visible anyway)")
    check_full_layers(config)
    check_mtp(config)
    check_gemma_parts(config)
    backend = ATTENTION_BACKENDS[config.attention]
    position = POSITION_ENCODINGS[config.position]
    if backend.needs_window and not config.sliding_window:
        # The example fits this context: a window is at most model.block_size wide.
        raise ModelError(f"model.attention={config.attention} computes only a sliding window's "
                         f"band; set model.sliding_window (e.g. {max(1, config.block_size // 4)}, "
                         f"a quarter of model.block_size={config.block_size}) or use sdpa")
    if config.dropout and not backend.has_dropout:
        choices = ", ".join(n for n, b in ATTENTION_BACKENDS.items() if b.has_dropout)
        raise ModelError(f"model.attention={config.attention} has no attention dropout; set "
                         f"model.dropout=0 or use one of {choices}")
    if not config.causal and position.biases_scores:
        relative = ", ".join(n for n, p in POSITION_ENCODINGS.items() if not p.biases_scores)
        raise ModelError(f"model.position={config.position} biases scores by causal distance, "
                         f"and model.causal=false sees in both directions; use one of {relative}")
    if config.position_offset and not position.has_length_limit:
        raise ModelError("model.position_offset shifts rows of a learned position table; set "
                         "model.position=learned with it, or leave it 0")
    if ROPE_SCALINGS[config.rope_scaling].stretches and not position.rotary:
        rotary = " or ".join(n for n, p in POSITION_ENCODINGS.items() if p.rotary)
        raise ModelError(f"model.rope_scaling={config.rope_scaling} needs model.position="
                         f"{rotary} (it stretches rotary positions)")
    if config.mlp_hidden and not MLPS[config.mlp].has_weights:
        raise ModelError(f"model.mlp_hidden={config.mlp_hidden} sets the width of an MLP, and "
                         f"model.mlp={config.mlp} has none; leave it 0 with it")
    for part in (check_experts, check_selection, check_latent, check_card_parts, check_readout):
        part(config)
    if config.vocab_size <= 0:
        return
    if id(config) not in CHECKED:
        weakref.finalize(config, CHECKED.pop, id(config), None)
    CHECKED[id(config)] = (astuple(config), not wants_variants(config))


def check_head_sizes(config: ModelConfig) -> None:
    """model.n_head cuts model.n_embd into equal heads, and a rotary position turns each
    head's dimensions in pairs, so its size must be even too: checked before
    ModelConfig.validate (which knows no positions), so the refusal lists the head counts
    that meet both. A size that is not a positive whole number is left to validate."""
    n, h = config.n_embd, config.n_head
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (n, h)):
        return
    rotary = getattr(POSITION_ENCODINGS.get(config.position), "rotary", False)
    if n % h == 0 and not (rotary and (n // h) % 2):
        return
    works = [d for d in divisors(n) if not (rotary and (n // d) % 2)]
    give = (f"give model.n_head one of {listed(works, h)}, or change model.n_embd" if works
            else "make model.n_embd even")
    if n % h:
        raise ModelError(f"model.n_embd={n} is not divisible by model.n_head={h}: each head "
                         f"gets an equal slice d_k = n_embd / n_head" + (
                             f", and model.position={config.position} turns its dimensions in "
                             "pairs, so d_k must be even" if rotary else "") + f"; {give}")
    raise ModelError(f"RoPE rotates pairs of dimensions, so the head size (n_embd/n_head = "
                     f"{n // h}) must be even; {give}")


def check_readout(config: ModelConfig) -> None:
    """Another output layer than the plain one (model.readout): what it cannot take."""
    readout = READOUTS[config.readout]
    if not readout.plain:
        if config.tie_embeddings and not readout.shares_embedding:
            raise ModelError(f"model.readout={config.readout} has "
                             + ("matrices of its own" if readout.scores_tokens else "no output layer")
                             + ", so it cannot "
                             "be tied to the token embedding; set model.tie_embeddings=false with it")
        if config.zero_head or config.logit_softcap:
            raise ModelError("model.zero_head and model.logit_softcap shape a full output "
                             f"layer's logits; model.readout={config.readout} scores tokens its "
                             "own way: leave them at their defaults with it")
        if (readout.shortlisted and config.vocab_size
                and not 0 < config.readout_shortlist < config.vocab_size):
            raise ModelError(f"model.readout_shortlist={config.readout_shortlist} must be between 1 "
                             f"and the vocabulary size less one ({config.vocab_size - 1}); a run "
                             "sets it from the training data when it is 0")


def check_full_layers(config: ModelConfig) -> None:
    """model.full_attention_every: which layers of a windowed model see everything."""
    every = config.full_attention_every
    if not every:
        return
    if not config.sliding_window:
        raise ModelError(f"model.full_attention_every={every} makes one layer in {every} see "
                         "the whole context instead of a sliding window; set "
                         "model.sliding_window too (without one every layer sees it all)")
    if every == 1 or every > config.n_layer:
        raise ModelError(f"model.full_attention_every={every} leaves "
                         f"{'no windowed' if every == 1 else 'no full'} layer among "
                         f"model.n_layer={config.n_layer}; give 2 to {config.n_layer} "
                         "(2 alternates, as gpt-oss; 6 is Gemma 3's five to one)")


def check_mtp(config: ModelConfig) -> None:
    """model.mtp_depth: modules that predict tokens further ahead through the output layer."""
    if config.mtp_weight < 0:
        raise ModelError(f"model.mtp_weight must not be negative, got {config.mtp_weight} "
                         "(λ, the weight of the multi-token prediction loss; 0.3 is "
                         "DeepSeek-V3's)")
    if not config.mtp_depth:
        if config.mtp_weight != ModelConfig.__dataclass_fields__["mtp_weight"].default:
            raise ModelError(f"model.mtp_weight={config.mtp_weight} weighs the multi-token "
                             "prediction loss, and model.mtp_depth=0 builds no module to take "
                             "it; set model.mtp_depth=1 with it, or leave the weight alone")
        return
    if config.mtp_depth > config.block_size - 2:
        raise ModelError(f"model.mtp_depth={config.mtp_depth} predicts further ahead than the "
                         f"context model.block_size={config.block_size} leaves a target for; "
                         f"give at most {max(config.block_size - 2, 0)} (1 is DeepSeek-V3's)")
    readout = READOUTS[config.readout]
    if not config.causal:
        raise ModelError(f"model.mtp_depth={config.mtp_depth} predicts the tokens after the next "
                         "from what comes before them, and model.causal=false lets every token "
                         "see them already; leave model.mtp_depth=0 for an encoder")
    if not readout.scores_tokens or readout.shortlisted:
        raise ModelError(f"model.mtp_depth={config.mtp_depth} scores its predictions with the "
                         "model's full output layer, and model.readout="
                         f"{config.readout} {'has none' if not readout.scores_tokens else 'scores a shortlist its own way'}; "
                         "use model.readout=full with it, or leave model.mtp_depth=0")


def check_gemma_parts(config: ModelConfig) -> None:
    """Gemma 3's learned QK-norm, score scale and local RoPE base: what each needs."""
    for name in ("qk_norm_weight", "score_scale"):
        if getattr(config, name) and not config.qk_norm:
            raise ModelError(f"model.{name} shapes QK-norm's queries and keys (Gemma 3 has both); "
                             "set model.qk_norm=true with it")
    if config.qk_norm_weight or config.score_scale:
        for name in names_used(config):
            layer = MECHANISMS[name].layer
            if not MECHANISMS[name].takes_qk_norm:     # QK-norm is not its, so neither are these
                continue
            if not (isinstance(layer, type) and issubclass(layer, MultiHeadAttention)
                    and layer.normalise is MultiHeadAttention.normalise):
                raise ModelError(f"model.mechanism={name} normalises its queries and keys its "
                                 "own way, with no place for model.qk_norm_weight or "
                                 "model.score_scale: leave them at their defaults with it")
    if config.rope_local_theta:
        if not POSITION_ENCODINGS[config.position].rotary:
            raise ModelError(f"model.rope_local_theta is a RoPE base, and model.position="
                             f"{config.position} turns nothing: set model.position=rope with it")
        if not config.full_attention_every:
            raise ModelError("model.rope_local_theta gives the windowed layers a RoPE base of "
                             "their own beside the full layers' model.rope_theta; set "
                             "model.full_attention_every (with model.sliding_window), or use "
                             "model.rope_theta alone")


def check_entries(used: list[str]) -> None:
    """Each used entry is a usable Mechanism, checked as it is read: one written over an
    entry after the dict was built skipped the check Mechanism makes when it is written."""
    for name in used:
        m = MECHANISMS[name]
        if not isinstance(m, Mechanism):
            raise ModelError(f"model.mechanism={name}: MECHANISMS[{name!r}] is "
                             f"{type(m).__name__}, not a Mechanism(layer, cache, ...) entry; "
                             "register it as model/mechanisms.py's entries are")
        if entry_problems(m):
            raise ModelError(f"model.mechanism={name}: its entry is unusable: "
                             + "; ".join(entry_problems(m)))


def check_mechanisms(config: ModelConfig) -> None:
    """What each layer's mechanism needs of the rest of the config."""
    position = POSITION_ENCODINGS[config.position]
    used = names_used(config)
    check_entries(used)
    default = ModelConfig.__dataclass_fields__["attention"].default
    if config.attention != default and not any(MECHANISMS[n].uses_kernel for n in used):
        raise ModelError(f"model.attention={config.attention} picks the kernel that computes "
                         f"softmax attention, and model.mechanism={config.mechanism} computes "
                         f"its own maths with none; leave model.attention={default} with it")
    pattern = config.mechanism.split(",")
    if len(pattern) > config.n_layer:
        raise ModelError(f"model.mechanism names {len(pattern)} layers and the model has "
                         f"model.n_layer={config.n_layer}; the pattern is cycled over the layers, "
                         f"so give at most {config.n_layer} names or raise model.n_layer")
    if config.n_kv_head not in (0, config.n_head) and not any(
            MECHANISMS[n].takes_kv_heads for n in used):
        raise ModelError(f"model.mechanism={config.mechanism} has no key and value heads to "
                         f"share, so model.n_kv_head={config.n_kv_head} would change nothing; "
                         "leave it at 0 with it")
    if config.qk_norm and not any(MECHANISMS[n].takes_qk_norm for n in used):
        # A hybrid's softmax layers take it (Qwen3-Next's); layers that form or bound their
        # queries and keys their own way keep doing so beside them.
        raise ModelError(f"model.mechanism={config.mechanism} does not scale its queries and "
                         "keys by model.qk_norm (its entry says takes_qk_norm=False: it forms or "
                         "bounds them its own way): set model.qk_norm=false with it")
    for name in used:
        m = MECHANISMS[name]
        if config.head_dim % m.head_multiple:
            raise ModelError(f"model.mechanism={name} cuts each head into parts, so the head size "
                             f"(n_embd/n_head = {config.head_dim}) must be a multiple of "
                             f"{m.head_multiple}; change model.n_embd or model.n_head")
        if position.biases_scores and not m.takes_score_bias:
            others = ", ".join(n for n, p in POSITION_ENCODINGS.items() if not p.biases_scores)
            raise ModelError(f"model.mechanism={name} has no place for model.position="
                             f"{config.position}'s per-head score bias; use one of {others}")
        if config.value_embeds and not m.takes_value_embed:
            raise ModelError(f"model.mechanism={name} rebuilds its values from what it caches, "
                             "with no place for a per-token value vector: set "
                             "model.value_embeds=false with it")
        if config.value_embeds and m.takes_value_embed and not m.takes_kv_heads \
                and config.kv_heads != config.n_head:
            # The value table is sized for the shared key/value heads; this layer keeps a
            # value for every query head, so the two widths cannot both be met.
            raise ModelError(f"model.mechanism={name} keeps a value for each of the "
                             f"model.n_head={config.n_head} heads, and model.value_embeds' "
                             f"table is sized for model.n_kv_head={config.n_kv_head} shared "
                             "heads: set model.n_kv_head=0 or model.value_embeds=false")
        if not m.follows_mask and (config.sliding_window or config.n_global or not config.causal):
            raise ModelError(f"model.mechanism={name} reads every earlier token, causally, and "
                             "no mask: leave model.sliding_window and model.n_global at 0 and "
                             "model.causal=true with it")


MOE_FIELDS = ("moe_experts", "moe_shared", "moe_top_k", "moe_hidden", "moe_bias_rate",
              "moe_router", "moe_expert", "moe_routed_scale", "moe_groups", "moe_group_top",
              "moe_dense_layers", "moe_shared_gate")


def check_card_parts(config: ModelConfig) -> None:
    """model.delta_conv sizes a delta-rule layer's short convolution, model.mla_nope takes
    latent attention's RoPE away, model.rope_dims is the part of each head rope_partial
    turns, model.moe_shared_gate gates shared experts: with none such to act on, each
    would change nothing."""
    if not any(getattr(MECHANISMS[n].layer, "takes_short_conv", False) for n in names_used(config)):
        refuse_unused(config, ("delta_conv",), "sizes a delta-rule layer's short convolution",
                      f"model.mechanism={config.mechanism}", "model.mechanism=gated_deltanet")
    if not any(getattr(MECHANISMS[n].layer, "has_latent", False) for n in names_used(config)):
        refuse_unused(config, ("mla_nope",), "takes the positions out of latent attention",
                      f"model.mechanism={config.mechanism}", "model.mechanism=mla")
    partial = POSITION_ENCODINGS[config.position] is POSITION_ENCODINGS["rope_partial"]
    if not partial:
        refuse_unused(config, ("rope_dims",), "sets how much of each head RoPE turns",
                      f"model.position={config.position}", "model.position=rope_partial")
    else:
        turned = config.rope_dims or config.head_dim // 4
        if turned % 2 or turned > config.head_dim or not turned:
            raise ModelError(f"model.position=rope_partial turns {turned} of each head's "
                             f"{config.head_dim} dimensions, in pairs: give model.rope_dims an "
                             f"even number from 2 to {config.head_dim}")
        if ROPE_SCALINGS[config.rope_scaling].stretches:
            raise ModelError(f"model.rope_scaling={config.rope_scaling} stretches the whole "
                             "head's RoPE, and model.position=rope_partial turns part of it: "
                             "use model.position=rope with it")
    if config.moe_shared_gate and not config.moe_shared and getattr(
            MLPS[config.mlp], "routes_tokens", False):
        raise ModelError("model.moe_shared_gate gates the shared experts, and model.moe_shared=0 "
                         "builds none: set model.moe_shared=1 with it, or leave it false")


SPARSE_FIELDS = ("sparse_top_k", "indexer_heads", "indexer_dim")


def check_selection(config: ModelConfig) -> None:
    """The sparse_top_k and indexer_* fields size the lightning indexer of a layer that
    selects its keys: with none such they would change nothing."""
    if config.sparse_top_k > config.block_size:
        raise ModelError(f"model.sparse_top_k={config.sparse_top_k} keeps more keys than the "
                         f"context model.block_size={config.block_size} holds; give at most "
                         f"{config.block_size} (0 is a quarter of it)")
    if any(getattr(MECHANISMS[n].layer, "selects_keys", False) for n in names_used(config)):
        return
    refuse_unused(config, SPARSE_FIELDS, "sizes sparse attention's indexer",
                  f"model.mechanism={config.mechanism}", "model.mechanism=sparse")


def check_latent(config: ModelConfig) -> None:
    """model.mla_q_rank sizes latent attention's query latent: refused without such a layer."""
    if not any(getattr(MECHANISMS[n].layer, "compresses_queries", False) for n in names_used(config)):
        refuse_unused(config, ("mla_q_rank",), "sizes latent attention's query latent",
                      f"model.mechanism={config.mechanism}", "model.mechanism=mla")


def check_experts(config: ModelConfig) -> None:
    """The model.moe_* fields size a mixture of experts: set with any other MLP they would
    change nothing, and model.mlp_hidden would change nothing with one."""
    routes = getattr(MLPS[config.mlp], "routes_tokens", False)
    if routes and config.moe_dense_layers >= config.n_layer:
        raise ModelError(f"model.moe_dense_layers={config.moe_dense_layers} leaves none of the "
                         f"model.n_layer={config.n_layer} layers to the experts: give fewer")
    if routes and config.moe_groups > 1 and not MOE_ROUTERS[config.moe_router].balances:
        raise ModelError(f"model.moe_groups={config.moe_groups} groups DeepSeek-V3's sigmoid "
                         f"affinities; model.moe_router={config.moe_router} has none: set "
                         "model.moe_router=sigmoid with it, or model.moe_groups=1")
    if routes and config.mlp_hidden and not config.moe_dense_layers:
        raise ModelError(f"model.mlp_hidden={config.mlp_hidden} sets a dense MLP's width; "
                         f"model.mlp={config.mlp}'s experts take model.moe_hidden: set that "
                         "instead and leave model.mlp_hidden 0 (or keep the first layers "
                         "dense, model.moe_dense_layers)")
    if routes and config.moe_bias_rate and not MOE_ROUTERS[config.moe_router].balances:
        raise ModelError(f"model.moe_bias_rate={config.moe_bias_rate} moves a balancing bias "
                         f"that model.moe_router={config.moe_router} does not use: set "
                         "model.moe_bias_rate=0 with it")
    if not routes:
        refuse_unused(config, MOE_FIELDS, "sets up a mixture of experts",
                      f"model.mlp={config.mlp}", "model.mlp=moe")


def refuse_unused(config: ModelConfig, names, does: str, chosen: str, way: str) -> None:
    """A field among `names` set away from its default where the `chosen` variant has no
    part it would size: refused, since it would change nothing."""
    for name in names:
        default = ModelConfig.__dataclass_fields__[name].default
        if getattr(config, name) != default:
            raise ModelError(f"model.{name}={getattr(config, name)} {does}, and {chosen} has "
                             f"none: set {way} with it, or leave it at {default}")
