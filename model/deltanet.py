"""DeltaNet: linear attention whose state is corrected, not only added to (the delta rule;
Schlag et al., arXiv:2102.11174; Yang et al., arXiv:2406.06484 for the chunked form).

Linear attention's state S = Σ v kᵀ (model/linear_attention.py) only ever adds: once d
keys are stored, a new key overlaps old ones and reading it returns a blend. The delta
rule first reads what the state holds at the new key, S k_t, and replaces a fraction β_t
of it by the new value:

    S_t = S_{t-1} + β_t (v_t − S_{t-1} k_t) k_tᵀ
        = S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,
    o_t = S_t q_t,

with k_t of unit length (then I − β k kᵀ shrinks nothing but the k direction, and only
by β ∈ (0, 1): the state cannot blow up) and β_t = sigmoid(x_t·w_β), per head. This is
one step of gradient descent on ‖S k_t − v_t‖²/2 with rate β_t: the state learns the
key → value map online. Decoding carries S, d×d per head, a fixed size.

Training cannot add up the products in closed form any more (each step multiplies by
the matrix I − β k kᵀ), so the paper splits the text into chunks of C tokens and,
inside a chunk, solves for what each token writes with one triangular system: the
UT transform (`chunk`). Its outputs equal the recurrence's (tests/test_deltanet.py).
The gated form (GatedDeltaNet, arXiv:2412.06464) lets the state fade by α_t first; the
same two forms compute it, with α = 1 for plain DeltaNet.

What the papers' models add around the rule is built only when asked for: a short
causal convolution over each channel of q, k and v before the rule (model.delta_conv,
as flash-linear-attention's ShortConvolution and the Qwen3-Next and Kimi Linear cards
have it), and, in `NormedGatedDeltaNet`, the Gated DeltaNet paper's full layer (its
section 3.4, Qwen3-Next's linear layers): Mamba2's decay and each head's output
RMS-normed and gated by SiLU."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import at_least_fp32
from model.config import ModelConfig, ModelError
from model.attention import Mask

# Row convention below: the state is stored as Sᵀ, (B, H, D_k, D_v), so that a row of
# queries reads it as q·Sᵀ and rows of keys write into it as kᵀ·u.


def empty_state(like: torch.Tensor) -> torch.Tensor:
    B, H, _, D = like.shape
    return like.new_zeros(B, H, D, D)                               # (B, H, D_k, D_v)


def unit(x: torch.Tensor) -> torch.Tensor:
    """Scale each vector to length 1: the paper's L2 normalisation of queries and keys."""
    return F.normalize(x, dim=-1)


def unit_fla(x: torch.Tensor) -> torch.Tensor:
    """x / √(|x|² + 10⁻⁶): the L2 normalisation as flash-linear-attention's kernels (and
    the cards' reference code) compute it, the ε inside the root."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, for y > 0: y + ln(1 − e^(−y))."""
    return y + torch.log(-torch.expm1(-y))


def recurrent(q, k, v, beta, log_alpha, state):
    """The delta rule one token at a time. q, k, v: (B, H, T, D); beta: (B, H, T);
    log_alpha: (B, H, T), the gated form's ln α_t (zeros for plain DeltaNet: α = 1);
    state: (B, H, D, D). Returns the outputs (B, H, T, D) and the state after them."""
    outs = []
    for t in range(q.shape[-2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]  # (B, H, D), (B, H, 1)
        state = log_alpha[:, :, t, None, None].exp() * state         # the gate: all fades
        held = (k_t.unsqueeze(-2) @ state).squeeze(-2)               # S_{t-1} k_t: (B, H, D)
        # Erase β of what the state holds at k_t and write β of the new value there.
        state = state + k_t.unsqueeze(-1) * (b_t * (v_t - held)).unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))  # o_t = S_t q_t
    return torch.stack(outs, dim=2), state


def fading(log_alpha):
    """Within a chunk, how much of what token i wrote is left at token t ≥ i:
    Γ_t / Γ_i = exp(γ_t − γ_i) with γ the running sum of ln α (B, H, C, C; 0 for t < i,
    masked before exp so that a long chunk's upper corner cannot overflow), and Γ_t
    itself (B, H, C)."""
    gamma = log_alpha.cumsum(-1)                                     # (B, H, C)
    gap = gamma.unsqueeze(-1) - gamma.unsqueeze(-2)                  # (B, H, C, C): γ_t − γ_i
    later = torch.ones(gap.shape[-2:], dtype=torch.bool, device=gap.device).tril()
    return gap.masked_fill(~later, float("-inf")).exp(), gamma.exp()


def chunk(q, k, v, beta, log_alpha, state):
    """C tokens at once, equal to C steps of `recurrent` (Yang et al., section 3; with the
    gate, arXiv:2412.06464, section 3.3).

    Within the chunk, α_t S_{t-1} = Γ_t S_0 + Σ_{i<t} (Γ_t/Γ_i) k_i u_iᵀ, where
    u_i = β_i(v_i − α_i S_{i-1} k_i) is what token i writes (plain DeltaNet: every α, Γ
    is 1). Substituting gives a lower-triangular system for all u at once,
    (I + A) U = diag(β)(V − diag(Γ) K S_0), A = strictly_lower(diag(β) (K Kᵀ ⊙ Γ_t/Γ_i)):
    (I + A)⁻¹ diag(β) is the UT transform T, and W = T diag(Γ) K, U = T V its WY form.
    q, k, v: (B, H, C, D); beta, log_alpha: (B, H, C); state: (B, H, D, D)."""
    C = q.shape[-2]
    left, Gamma = fading(log_alpha)                                  # (B, H, C, C), (B, H, C)
    A = (beta.unsqueeze(-1) * (k @ k.transpose(-2, -1)) * left).tril(-1)   # i > j only
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False)
    W, U = T @ (Gamma.unsqueeze(-1) * k), T @ v                      # (B, H, C, D) each
    new = U - W @ state                    # u_t: each token's write, after the state's part
    # o_t = S_t q_t: the faded state before the chunk, plus what is left of every write
    # up to and including t (`left` is 0 for a later write: the chunk's causal mask).
    out = Gamma.unsqueeze(-1) * (q @ state) + ((q @ k.transpose(-2, -1)) * left) @ new
    last = left[:, :, -1].unsqueeze(-1)                              # (B, H, C, 1): Γ_C/Γ_i
    return out, Gamma[:, :, -1, None, None] * state + k.transpose(-2, -1) @ (last * new)


def chunked(q, k, v, beta, log_alpha, state, size: int, step=None):
    """The parallel form for training and prefill: chunks of `size` tokens, each
    starting from the state the chunks before it left, through `step` (this file's
    `chunk`, or KDA's with a decay per channel). Returns (B, H, T, D), state."""
    step = step or chunk
    outs = []
    for start in range(0, q.shape[-2], size):
        part = slice(start, start + size)
        out, state = step(q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part],
                          log_alpha[:, :, part], state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


class DeltaNet(nn.Module):
    """Multi-head DeltaNet: q, k, v as in MultiHeadAttention, plus one β per head and
    token; queries and keys through SiLU and then to unit length (the paper's choice),
    and the delta rule in place of the softmax. Nothing fades: ln α = 0 (`gate`).

    With model.delta_conv = K, the layer is the one flash-linear-attention and the cards
    build: q, k and v each mixed with their K-1 predecessors channel by channel (a causal
    depthwise convolution) and passed through SiLU, q and k to unit length with the
    kernels' ε, q scaled by 1/√d_k, and β without a bias."""

    # The form that trains and prefills; Kimi Delta Attention (model/kda.py) names its own.
    rule = staticmethod(chunked)
    takes_short_conv = True        # model.delta_conv applies (model/registry.py asks)

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if config.linear_chunk <= 0:
            raise ModelError(f"model.linear_chunk must be a positive integer, got "
                             f"{config.linear_chunk}")
        self.layer_idx, self.chunk_size = layer_idx, config.linear_chunk
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.w_qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.w_beta = nn.Linear(config.n_embd, config.n_head, bias=not config.delta_conv)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.conv = None
        if config.delta_conv:
            # One filter of K taps per channel of q, k and v (groups = channels): each
            # mixes only its own channel over the token and the K-1 before it.
            channels = 3 * config.n_embd
            self.conv = nn.Conv1d(channels, channels, config.delta_conv, groups=channels,
                                  bias=False)

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        if need_weights:
            raise ModelError(f"{type(self).__name__} has no attention weights to draw: each "
                             "token rewrites a d x d state, and no weight per earlier token exists")
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        qkv = self.w_qkv(x)                                           # (B, T, 3C)
        if self.conv is not None:
            qkv = F.silu(self.short_conv(qkv, cache))
        q, k, v = qkv.view(B, T, 3 * H, D).transpose(1, 2).split(H, dim=1)  # (B, H, T, D)
        if value_embed is not None:              # a per-token vector added to the value
            v = v + value_embed.view(B, T, H, D).transpose(1, 2)
        if self.conv is None:
            q = unit(F.silu(q))
            k = unit(F.silu(k))
        else:                                    # SiLU came with the convolution
            q = unit_fla(q) * D ** -0.5
            k = unit_fla(k)
        beta = torch.sigmoid(self.w_beta(x)).transpose(1, 2)         # (B, H, T), each in (0, 1)
        log_alpha = self.gate(x).transpose(1, 2)                      # (B, H, T), each ≤ 0
        q, k, v, beta, log_alpha = (at_least_fp32(t) for t in (q, k, v, beta, log_alpha))
        S = None if cache is None else cache.state(self.layer_idx)     # Sᵀ, (B, H, D, D)
        S = empty_state(q) if S is None else S
        # The rule in at least fp32, outside autocast: the state sums a whole text's writes,
        # which bf16's 8-bit mantissa would round away (and a CPU has no bf16 triangular solve).
        with torch.autocast(x.device.type, enabled=False):
            y, S = self.rule(q, k, v, beta, log_alpha, S, self.chunk_size)
        if cache is not None:
            cache.keep(self.layer_idx, S)
        y = self.read(y, x).to(x.dtype).transpose(1, 2).reshape(B, T, C)   # heads side by side
        return self.resid_dropout(self.w_o(y)), None

    def short_conv(self, qkv, cache=None):
        """(B, T, 3C): each channel of q, k and v as the sum of its K taps times the token
        and the K-1 before it (zeros before the first token). Decoding keeps the last K-1
        rows in the cache beside the state, so a step convolves as the full pass did."""
        back = self.conv.kernel_size[0] - 1
        where = (self.layer_idx, "conv")
        past = None if cache is None else cache.state(where)
        if past is None:
            past = qkv.new_zeros(qkv.shape[0], back, qkv.shape[2])
        full = torch.cat((past.to(qkv.dtype), qkv), dim=1)            # (B, K-1+T, 3C)
        if cache is not None:
            cache.keep(where, full[:, full.shape[1] - back:])
        return self.conv(full.transpose(1, 2)).transpose(1, 2)        # (B, T, 3C)

    def gate(self, x):
        """ln α per token and head, (B, T, H): 0, the state kept whole from token to token."""
        return x.new_zeros(*x.shape[:2], self.n_head)

    def read(self, y, x):
        """What each head hands W_O, (B, H, T, D): the rule's output as it is (Kimi Delta
        Attention norms and gates it)."""
        return y


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv:2412.06464): before each delta
    step the whole state fades by α_t ∈ (0, 1), chosen per token and head,

        S_t = S_{t-1} (α_t (I − β_t k_t k_tᵀ)) + β_t v_t k_tᵀ.

    The delta rule alone can only rewrite the state one key at a time; the gate lets a
    head clear it at once (a new document, a topic change), as Mamba2's decay does, and
    the delta rule keeps what is left precise. The same chunked and recurrent forms."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.w_alpha = nn.Linear(config.n_embd, config.n_head, bias=False)
        # Heads start with memories of different lengths, α from 0.88 (about 8 tokens)
        # to 0.998 (about 400), as Mamba's spread of step sizes does; a plain parameter,
        # so the model's initialisation of linear layers leaves it as it is.
        self.alpha_bias = nn.Parameter(torch.linspace(2.0, 6.0, config.n_head))

    def gate(self, x):
        return F.logsigmoid(self.w_alpha(x) + self.alpha_bias)       # ln α, (B, T, H)


class NormedGatedDeltaNet(DeltaNet):
    """Gated DeltaNet as its paper builds the whole layer (arXiv:2412.06464, section 3.4)
    and Qwen3-Next runs it: the decay is Mamba2's, ln α_t = −exp(A_h) · softplus(x_t·w_a +
    b_dt), one per head, and each head's output is RMS-normed over its channels (a gain
    per channel, shared by the heads) and gated by SiLU(x_t·W_z) before W_O, so a head's
    output no longer grows with what its state holds, and a token can close it."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        H = config.n_head
        self.norm_eps = config.norm_eps
        self.w_alpha = nn.Linear(config.n_embd, H, bias=False)
        self.w_z = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # Plain parameters, which the model's init of linear layers leaves as they are:
        # exp(A) from 1 to 16 and softplus(b_dt) from 0.001 to 0.1 over the heads, memories
        # from about a token to about a thousand at x = 0 (model/kda.py's spread, per head).
        self.decay_log_rate = nn.Parameter(torch.linspace(1.0, 16.0, H).log())      # A, (H,)
        self.decay_bias = nn.Parameter(inverse_softplus(torch.logspace(-3, -1, H)))  # b_dt
        self.out_norm = nn.Parameter(torch.ones(config.head_dim))    # RMSNorm's gain

    def gate(self, x):
        """ln α per token and head, (B, T, H): −exp(A_h) · softplus(x·w_a + b_dt), ≤ 0."""
        a = at_least_fp32(self.w_alpha(x)) + self.decay_bias
        return -self.decay_log_rate.exp() * F.softplus(a)

    def read(self, y, x):
        """Each head's output RMS-normed over its channels, times the gain, times SiLU(x·W_z)."""
        B, T, _ = x.shape
        z = self.w_z(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)   # (B, H, T, D)
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return normed * self.out_norm * F.silu(at_least_fp32(z))
