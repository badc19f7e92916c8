"""Optimizers: AdamW for everything, or Muon for the hidden weight matrices with AdamW
for the rest, held together so the training loop steps them as one."""
from __future__ import annotations

import math

import torch

from common.errors import ConfigError


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

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.named):
            raise ValueError(f"saved optimizers {sorted(state)} differ from {sorted(self.named)}")
        for name, opt in self.named.items():
            opt.load_state_dict(state[name])


def is_hidden_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """The 2-D weights inside the blocks: what Muon orthogonalises. Embeddings and the
    output layer (tied to them) are lookups/readouts, not hidden maps, and stay on AdamW."""
    return p.dim() == 2 and name.startswith("blocks.")


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
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError("train.optimizer=muon needs torch.optim.Muon (torch 2.9 or newer)")
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        embeddings = [p for n, p in named if p.dim() >= 2 and not is_hidden_matrix(n, p)]
        vectors = [p for _, p in named if p.dim() < 2]
        muon = torch.optim.Muon(hidden, lr=t.muon_lr, momentum=t.muon_momentum,
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
