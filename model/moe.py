"""A mixture-of-experts feed-forward block as DeepSeek-V3 builds it (arXiv:2412.19437,
section 2.1.2): a few shared experts every token passes through, many routed experts of
which each token uses its top k, and the auxiliary-loss-free balancing bias that spreads
the tokens over the routed experts without a loss term pulling against the model's own.

For a token u (one row of the layer's input), with s_i = sigmoid(u·e_i) its affinity to
routed expert i and b_i that expert's balancing bias:

    out = Σ_shared FFN_i(u) + Σ_routed g_i · FFN_i(u)                       (eq. 12)
    g_i = s_i / Σ_{j chosen} s_j   for the k experts with the largest s_i + b_i,
          0 for the others                                                  (eqs. 13, 16)

DeepSeek-V3 adds two things to this (its section 2.1.2 and its code): the g_i are multiplied
by a constant, model.moe_routed_scale (routed_scaling_factor, 2.5), so the routed experts
count more beside the shared ones, and the routed experts are split into model.moe_groups
groups (one per node in training) of which a token may use model.moe_group_top, those
whose two best experts score highest (s_i + b_i), so each token's experts sit on few nodes.

Every expert is a SwiGLU MLP (arXiv:2002.05202). The bias only picks the experts; the
weights g_i are the plain affinities, so moving the bias to balance the load never
changes how much a chosen expert counts. After each optimizer step the bias moves by
model.moe_bias_rate (the paper's γ) towards an even load, b_i += γ·sign(mean load -
load_i): an overloaded expert gets picked a little less often, an idle one more.

gpt-oss (arXiv:2508.10925) routes and computes its experts another way, chosen by two
fields whose entries carry their facts (MOE_ROUTERS, MOE_EXPERTS below): its router is a
linear layer with a bias whose k largest logits pick the experts and a softmax over those
k weights them (model.moe_router=softmax_topk), and its experts have biases and a clamped
SwiGLU, (clamp(up) + 1) · g·σ(1.702·g) with g = min(gate, 7) (model.moe_expert=gpt_oss)."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


class Router(NamedTuple):
    """How a token's router logits (N, E) pick k experts and weight them: `route(logits,
    balance_bias, k) -> (weights (N, k), chosen (N, k))`."""
    route: Callable
    bias: bool          # the router's linear layer has a bias (gpt-oss's has)
    balances: bool      # model.moe_bias_rate moves a balancing bias that picks experts


def _sigmoid_route(logits, balance_bias, k):
    # Sigmoid affinities, each expert scored on its own (eq. 15): unlike a softmax over
    # the experts, one expert's score does not fall because another's rose.
    scores = torch.sigmoid(logits)
    chosen = (scores + balance_bias).topk(k, dim=-1).indices      # the bias picks (eq. 16)
    picked = scores.gather(-1, chosen)                            # ... and s_i, not s_i + b_i, weights
    return picked / picked.sum(-1, keepdim=True), chosen          # normalised over the k chosen (eq. 13)


def _softmax_topk_route(logits, balance_bias, k):
    # gpt-oss: the k largest logits pick, and a softmax over those k alone weights them, so
    # the experts not chosen take no share of the weight.
    top = logits.topk(k, dim=-1)
    return torch.softmax(top.values, dim=-1), top.indices


def group_limit(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """DeepSeek-V3's node-limited routing: for each token's choice scores (N, E), split
    into `groups` equal groups of experts, 0 where the expert's group is among the `keep`
    whose two best scores sum highest, -inf elsewhere (N, E), to add before the top-k."""
    N, E = choice.shape
    group_scores = choice.view(N, groups, E // groups).topk(2, dim=-1).values.sum(-1)   # (N, G)
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(keep, dim=-1).indices, True)
    hidden = torch.full_like(group_scores, float("-inf")).masked_fill(kept, 0.0)
    return hidden.repeat_interleave(E // groups, dim=1)          # each group's value, per expert


MOE_ROUTERS = {
    "sigmoid": Router(_sigmoid_route, bias=False, balances=True),
    "softmax_topk": Router(_softmax_topk_route, bias=True, balances=False),
    # Qwen3-Next: a softmax over every expert, the top k kept and renormalised over those k
    # (norm_topk_prob), which is the same weights as a softmax over the k largest logits;
    # its router has no bias.
    "softmax": Router(_softmax_topk_route, bias=False, balances=False),
}


class ExpertKind(NamedTuple):
    """What an expert does between its fused gate-and-up layer and its down layer:
    `act(gate, up) -> hidden`; `alpha` and `limit` are the clamped SwiGLU's constants."""
    act: Callable
    alpha: float = 1.0
    limit: float = 0.0


def _swiglu(gate, up):
    return F.silu(gate) * up


GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0      # transformers' swiglu_alpha, swiglu_limit


def _gpt_oss_glu(gate, up, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    # gpt-oss's SwiGLU: the gate is capped from above and the up side both ways, so no
    # expert's output can grow without bound; σ(α·g) with α = 1.702 is the sigmoid that
    # approximates GELU (arXiv:1606.08415), and the +1 lets the up side scale the gate
    # around 1 rather than around 0.
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


MOE_EXPERTS = {
    "swiglu": ExpertKind(_swiglu),
    "gpt_oss": ExpertKind(_gpt_oss_glu, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT),
}


class ExpertLinear(nn.Module):
    """One linear map per expert, in_features -> out_features, held as one (E, out, in)
    tensor (transformers' layout for DeepSeek-V3). torch's Linear init does not see it,
    so the weights are drawn here as the model draws a Linear's, N(0, 0.02)."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        self.bias = nn.Parameter(torch.zeros(experts, out_features)) if bias else None

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.weight[expert], None if self.bias is None else self.bias[expert])


class MixtureOfExperts(nn.Module):
    """model.moe_shared shared and model.moe_experts routed SwiGLU experts; each token goes
    to the shared ones and to model.moe_top_k routed ones. Experts 0 .. moe_shared-1 of
    `fc` and `proj` are the shared ones, the rest the routed ones in router order."""
    has_weights = True
    routes_tokens = True    # the model.moe_* fields are this MLP's; model/registry.py checks
    matrices = 3            # per expert: gate, up and down
    # model/decode.py asks: a recorded CUDA graph replays fixed shapes and no host syncs.
    graph_refusal = ("a mixture of experts hands each expert the tokens routed to it, a number "
                     "that changes from step to step")

    @staticmethod
    def width(config: ModelConfig) -> int:
        """Each expert's hidden width: model.moe_hidden, or SwiGLU's 8/3 x n_embd shared out
        among the experts one token uses (DeepSeekMoE's fine-grained experts, arXiv:2401.06066:
        more, narrower experts at the compute of one dense MLP), rounded up to 8."""
        active = config.moe_top_k + config.moe_shared
        return config.moe_hidden or -(-8 * config.n_embd // (3 * active * 8)) * 8

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_shared, self.n_routed, self.top_k = config.moe_shared, config.moe_experts, config.moe_top_k
        self.bias_rate = config.moe_bias_rate
        self.routed_scale = config.moe_routed_scale
        self.groups, self.group_top = config.moe_groups, config.moe_group_top
        self.router_kind, self.expert_kind = MOE_ROUTERS[config.moe_router], MOE_EXPERTS[config.moe_expert]
        hidden = self.hidden = self.width(config)
        experts = self.n_shared + self.n_routed
        self.fc = ExpertLinear(experts, config.n_embd, 2 * hidden, config.bias)   # gate and up, fused
        self.proj = ExpertLinear(experts, hidden, config.n_embd, config.bias)
        # e_i, each routed expert's centroid: u·e_i is token u's affinity logit for expert i.
        self.router = nn.Linear(config.n_embd, self.n_routed, bias=self.router_kind.bias)
        # The routed experts' weights a token does not use: model FLOPs count only the k it does.
        per_expert = sum(p[0].numel() for p in (*self.fc.parameters(), *self.proj.parameters()))
        self.idle_weights = (self.n_routed - self.top_k) * per_expert
        self.dropout = nn.Dropout(config.dropout)
        self.shared_gate = None
        if config.moe_shared_gate:
            # Qwen3-Next: σ(u·w), one number a token, scales what the shared experts hand on.
            self.shared_gate = nn.Linear(config.n_embd, 1, bias=False)
        # b_i: picks the experts, never weights them. Saved with the weights (a buffer), so a
        # resumed run goes on choosing as the unbroken one would; float32 whatever the model
        # runs in, because steps of γ = 0.001 vanish in bf16 next to a bias of order 1.
        self.register_buffer("balance_bias", torch.zeros(self.n_routed, dtype=torch.float32))
        # Each routed expert's share of the tokens in the last optimizer step (a row sums to
        # top_k: every token picks k), for the load shown at evaluation.
        self.register_buffer("load", torch.zeros(self.n_routed, dtype=torch.float32))
        # Tokens each expert was picked for since the last step, summed over the step's
        # micro-batches. A plain attribute, not a buffer: DDP copies rank 0's buffers over
        # the others at every forward, and each rank must count its own tokens.
        self.picks: torch.Tensor | None = None

    def expert(self, e: int, u: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU (model.moe_expert's form of it) on tokens u (N, C) -> (N, C)."""
        gate, up = self.fc(u, e).chunk(2, dim=-1)                 # (N, H) each
        return self.proj(self.expert_kind.act(gate, up), e)

    def router_logits(self, u: torch.Tensor) -> torch.Tensor:
        """Tokens u (N, C) -> each routed expert's logit u·e_i (+ the router's bias), (N, E)."""
        # In float32 at least, autocast or not, as transformers' DeepSeek-V3 gate computes
        # (the paper keeps its gating out of FP8, section 3.3.1): in bf16, affinities a little
        # apart round to ties, and the picks would follow the rounding.
        dtype = torch.promote_types(u.dtype, torch.float32)
        bias = None if self.router.bias is None else self.router.bias.to(dtype)
        with torch.autocast(u.device.type, enabled=False):
            return F.linear(u.to(dtype), self.router.weight.to(dtype), bias)   # (N, E_routed)

    def route(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens u (N, C) -> (weights g (N, k), chosen experts (N, k)): DeepSeek-V3's gate,
        or model.moe_router's."""
        logits = self.router_logits(u)
        balance_bias = self.balance_bias
        if self.groups > 1:      # only the chosen groups' experts stay in the running
            choice = torch.sigmoid(logits) + balance_bias
            balance_bias = balance_bias + group_limit(choice, self.groups, self.group_top)
        weights, chosen = self.router_kind.route(logits, balance_bias, self.top_k)
        return weights * self.routed_scale, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.reshape(-1, x.shape[-1])                            # (N, C): every token on its own
        weights, chosen = self.route(u)
        if self.training:                                         # counted for the step's bias update
            picks = torch.bincount(chosen.flatten(), minlength=self.n_routed)
            self.picks = picks if self.picks is None else self.picks + picks
        out = torch.zeros_like(u)
        for e in range(self.n_shared):                            # shared experts: every token, weight 1
            out = out + self.expert(e, u)
        if self.shared_gate is not None:                          # ... or the gate's σ(u·w)
            out = out * torch.sigmoid(self.shared_gate(u))
        for e in range(self.n_routed):
            token, slot = (chosen == e).nonzero(as_tuple=True)    # the tokens that picked expert e
            y = self.expert(self.n_shared + e, u[token]) * weights[token, slot, None]
            # A token picks an expert at most once, so no index repeats within one add:
            # the sum is the same on every run, even where index_add works by atomics.
            out = out.index_add(0, token, y.to(out.dtype))
        return self.dropout(out.reshape(x.shape))

    @torch.no_grad()
    def after_step(self, reduce=lambda counts: counts) -> None:
        """Once per optimizer step (engine/loop.py calls it): the load of the step's tokens,
        summed over processes by `reduce`, and the bias update b_i += γ·sign(mean - load_i).
        Counted in whole tokens, so the sign is exact and the same on every run."""
        if self.picks is None:
            return
        picks, self.picks = reduce(self.picks), None
        tokens = picks.sum() // self.top_k
        self.load.copy_(picks.float() / tokens.clamp(min=1))
        # mean - load_i has the sign of total - E·picks_i: integers, no rounding to tie on.
        self.balance_bias += self.bias_rate * torch.sign(picks.sum() - self.n_routed * picks)


def expert_loads(model: nn.Module) -> dict[str, list[float]]:
    """Each mixture-of-experts layer's load in the last optimizer step, by module name:
    the share of the tokens each routed expert got (a row sums to moe_top_k; an even load
    is moe_top_k / moe_experts apiece)."""
    return {name: m.load.tolist() for name, m in model.named_modules()
            if isinstance(m, MixtureOfExperts)}


def load_line(model: nn.Module) -> str | None:
    """The loads in a few characters a layer: the busiest expert's share over the mean
    share (1.00 is an even load; k·E/k = E would be every token on one expert), or None
    for a model without experts."""
    loads = expert_loads(model)
    if not loads:
        return None
    ratios = {name: max(row) / (sum(row) / len(row)) if sum(row) else 0.0
              for name, row in loads.items()}
    # Each named by its layer (blocks.3.mlp: 3), a multi-token prediction depth's as mtp0.
    label = lambda name: (f"mtp{name.split('.')[2]}" if name.startswith("mtp.")
                          else name.split(".")[1])
    return "moe load, busiest/mean by layer: " + ", ".join(
        f"{label(name)} {r:.2f}" for name, r in ratios.items())
