"""Optimizers: AdamW for everything, or Muon for the hidden weight matrices with AdamW
for the rest, held together so the training loop steps them as one."""
from __future__ import annotations

import math

import torch

from common.errors import ConfigError
from engine.machine import compute_dtype


class Optimizers:
    """Named torch optimizers stepped, zeroed, saved and loaded together. Each param
    group keeps its own `base_lr`; the schedule scales all of them alike."""

    def __init__(self, **named: torch.optim.Optimizer):
        self.named = named
        for opt in named.values():
            for group in opt.param_groups:
                group.setdefault("base_lr", group["lr"])

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.named.values() for g in opt.param_groups]

    def set_lr(self, scale: float) -> None:
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * scale

    def set_muon_momentum(self, momentum: float) -> None:
        for group in self.named["muon"].param_groups if "muon" in self.named else ():
            group["momentum"] = momentum

    def step(self, scaler) -> None:
        for opt in self.named.values():
            scaler.step(opt)

    def unscale_(self, scaler) -> None:
        for opt in self.named.values():
            scaler.unscale_(opt)

    def zero_grad(self) -> None:
        for opt in self.named.values():
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.named.items()}

    def indexed_params(self) -> dict[str, list[torch.Tensor]]:
        """Each optimizer's parameters in the order its state_dict numbers them (0, 1, ...
        across its groups): the parameter a saved state's index belongs to."""
        return {name: [p for group in opt.param_groups for p in group["params"]]
                for name, opt in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.named):
            raise ValueError(f"saved optimizers {sorted(state)} differ from {sorted(self.named)}")
        for name, opt in self.named.items():
            opt.load_state_dict(state[name])


# The tensors each optimizer keeps for a parameter it has stepped: "param" is one of the
# parameter's shape and dtype (a moment, a momentum buffer), "count" a float32 scalar
# (AdamW's step count, a tensor so that a fused or captured step can update it in place).
PARAM_STATE = {"adamw": {"exp_avg": "param", "exp_avg_sq": "param", "step": "count"},
               "muon": {"momentum_buffer": "param"}}


class GroupedMuon(torch.optim.Muon):
    """torch's Muon (momentum, Nesterov, Newton-Schulz orthogonalisation in bf16 where
    that is native, weight decay, its learning-rate adjustment), with the Newton-Schulz
    iterations of all the matrices of one shape run together as batched matmuls. A small
    model's step is dozens of tiny matmuls whose dispatch costs more than their
    arithmetic, so batching them halves the optimizer's share of a CPU step
    (docs/benchmarks.md, beside Muon's Newton-Schulz iterations; a tall matrix is
    orthogonalised as its transpose, as torch does).
    Same state and hyperparameters as torch's class, so checkpoints move between them."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            momentum = group["momentum"]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            # Orthogonalise wide matrices (a tall one transposed), batched by shape.
            by_shape: dict[tuple, list[int]] = {}
            for i, u in enumerate(updates):
                rows, cols = u.shape
                by_shape.setdefault((min(rows, cols), max(rows, cols), u.device), []).append(i)
            ortho: list[torch.Tensor] = [None] * len(params)
            for idx in by_shape.values():
                wide = [updates[i].mT if updates[i].size(0) > updates[i].size(1) else updates[i]
                        for i in idx]
                x = newton_schulz(torch.stack(wide), group["ns_coefficients"], group["ns_steps"],
                                  group["eps"], newton_schulz_dtype(wide[0].device))
                for i, o in zip(idx, x.unbind(0)):
                    ortho[i] = o.mT if updates[i].size(0) > updates[i].size(1) else o
            lr, wd = group["lr"], group["weight_decay"]
            for p, o in zip(params, ortho):
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-lr * muon_lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16, as torch's Muon computes the iterations, where the device has it natively;
    fp32 on a CPU without it (engine/machine.py) or a GPU older than Ampere, where bf16
    matmuls are emulated: on an AVX2 CPU a batched bf16 matmul of the cpu preset's shape
    took 34x its fp32 time, most of the training step (docs/benchmarks.md)."""
    if device.type == "cpu":
        return compute_dtype(torch.bfloat16)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float32
    return torch.bfloat16


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(n, r, c) matrices with r <= c -> their approximate orthogonalisations U·S'·Vᵀ
    (S' near 1), in dtype: X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ, after scaling each
    matrix to norm 1 (Jordan et al.'s quintic iteration, the coefficients torch uses).
    The iteration only needs S' near 1, not exact, which is why bf16 is enough."""
    a, b, c = coefficients
    x = g.to(dtype)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def muon_lr_scale(adjust_lr_fn: str | None, shape) -> float:
    """torch's Muon rate adjustment: match_rms_adamw scales by 0.2·√max(A, B), so the
    update's RMS is AdamW's and AdamW's rates carry over (Liu et al., arXiv:2502.16982)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def is_hidden_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """The 2-D weights inside the blocks (multi-token prediction's too, with its
    projection M_k): what Muon orthogonalises. Embeddings and the output layer (tied to
    them) are lookups/readouts, not hidden maps, and stay on AdamW."""
    return p.dim() == 2 and name.startswith(("blocks.", "mtp."))


def configure_optimizer(model, t, device: torch.device) -> Optimizers:
    """AdamW with weight decay on matrices and embeddings only, never on biases and
    norm gains (decaying those towards 0 only fights the normalisation); with
    train.optimizer=muon, Muon (arXiv:2502.16982) takes the hidden matrices."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # The fused kernel updates every tensor in one pass (CUDA, and CPU since torch 2.4).
    adamw = lambda groups: torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2),
                                             fused=device.type in ("cuda", "cpu"))
    if t.optimizer == "adamw":
        decay = [p for _, p in named if p.dim() >= 2]
        no_decay = [p for _, p in named if p.dim() < 2]
        return Optimizers(adamw=adamw([{"params": decay, "weight_decay": t.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}]))
    if t.optimizer == "muon":
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        embeddings = [p for n, p in named if p.dim() >= 2 and not is_hidden_matrix(n, p)]
        vectors = [p for _, p in named if p.dim() < 2]
        muon = GroupedMuon(hidden, lr=t.muon_lr, momentum=t.muon_momentum,
                           weight_decay=t.weight_decay, adjust_lr_fn="match_rms_adamw")
        return Optimizers(adamw=adamw([{"params": embeddings, "weight_decay": t.weight_decay},
                                       {"params": vectors, "weight_decay": 0.0}]), muon=muon)
    raise ConfigError(f"unknown train.optimizer {t.optimizer!r}; valid choices: adamw, muon")


def _cosine(progress: float, t) -> float:
    """Cosine from 1 to 0 over everything after the warm-up (nanoGPT, GPT-3)."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _wsd(progress: float, t) -> float:
    """Warmup-stable-decay: the peak rate until the last `decay_frac` of the steps,
    then a straight line down (MiniCPM, arXiv:2404.06395; the modded-nanogpt
    speedruns). Most steps learn at the full rate; the short decay at the end cashes
    in what the high rate left in the noise."""
    held = 1.0 - t.decay_frac
    return 1.0 if progress <= held else max(0.0, (1.0 - progress) / t.decay_frac)


# How the rate falls from lr to min_lr after the warm-up: progress 0..1 -> factor 1..0.
LR_SCHEDULES = {"cosine": _cosine, "wsd": _wsd}
