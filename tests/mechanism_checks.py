"""Checks every attention mechanism after the article answers to (tests/test_linear_attention.py,
test_deltanet.py, test_latent_attention.py), each returning a size of disagreement so a test
can show it small for the module as written and large for a copy with a bug planted in it
(`planted`: the check passes on the module and fails on the copy)."""
import sys
import types

import numpy as np
import torch

from conftest import ROOT
from model.cache import KVCache
from model.config import ModelConfig
from model.attention import Mask
from model.positions import POSITION_ENCODINGS

B, T, HEADS, WIDTH = 2, 11, 2, 16            # T is a multiple of no chunk size tried
TOLERANCE = 1e-9                             # float64 throughout: agreement to ~1e-15


def planted(module: str, old: str, new: str, monkeypatch) -> types.ModuleType:
    """model/<module>.py with `old` (which must appear exactly once) replaced by `new`,
    loaded as a module of its own; the real one is left as it is."""
    source = (ROOT / "model" / f"{module}.py").read_text(encoding="utf-8")
    assert source.count(old) == 1, f"the planted text is not in model/{module}.py once: {old!r}"
    copy = types.ModuleType(f"model.{module}_planted")
    monkeypatch.setitem(sys.modules, copy.__name__, copy)   # dataclasses look their module up
    exec(compile(source.replace(old, new), f"model/{module}.py (planted)", "exec"), copy.__dict__)
    return copy


def config(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 8, "n_head": HEADS, "n_embd": WIDTH, "block_size": 32,
                          **kw})


def layer(cls, seed: int = 0, **kw):
    """A float64 layer of `cls` with seeded weights (biases too, so none is left at 0)."""
    torch.manual_seed(seed)
    module = cls(config(**kw), 0).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.4)
    return module


def inputs(seed: int = 1, length: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, length, WIDTH, generator=g, dtype=torch.float64)


def whole(module, x: torch.Tensor) -> torch.Tensor:
    """The layer over the whole sequence at once: training's pass."""
    positions = POSITION_ENCODINGS["rope"](config())
    return module(x, positions, Mask.over(0, x.shape[1], x.shape[1]))[0]


def decoded(module, x: torch.Tensor, pieces=(1,) * T) -> tuple[torch.Tensor, KVCache]:
    """The layer over x in pieces of the given lengths, each after what the pieces before
    it left in the model's own cache (a prefill, then one token at a time), as
    GPT.forward drives it. The cache holds exactly x's length, so its bytes are what
    the layer kept."""
    positions = POSITION_ENCODINGS["rope"](config())
    cache, out, start = KVCache(1, x.shape[1]), [], 0
    for n in pieces:
        k_pos, k_first = cache.begin(n, x.device)
        mask = Mask(q_start=cache.length, q_len=n, k_pos=k_pos, k_first=k_first)
        out.append(module(x[:, start:start + n], positions, mask, cache)[0])
        cache.end(n)
        start += n
    return torch.cat(out, dim=1), cache


def decode_error(module, x: torch.Tensor, pieces=(4, 1, 1, 3, 1, 1)) -> float:
    """Largest difference between decoding with the layer's state and the whole pass."""
    return (decoded(module, x, pieces)[0] - whole(module, x)).abs().max().item()


def causality_leak(module, x: torch.Tensor, at: int = 7) -> float:
    """How much the outputs before position `at` move when the tokens from `at` on change:
    0 for a causal layer."""
    later = x.clone()
    later[:, at:] = torch.randn_like(later[:, at:])
    return (whole(module, later)[:, :at] - whole(module, x)[:, :at]).abs().max().item()


def matrix(linear: torch.nn.Linear) -> np.ndarray:
    """A linear layer's weight as the matrix W of y = x @ W (what the references take)."""
    return linear.weight.detach().numpy().T


def bias(linear: torch.nn.Linear) -> np.ndarray:
    return 0.0 if linear.bias is None else linear.bias.detach().numpy()
