"""Building a model without its initial values: for sizes (on the meta device, where no
memory is taken) and for weights a checkpoint is about to replace (allocated but never
written, so their pages are never touched). model/gpt.py's GPT.skeleton and GPT.unfilled
build under `Unfilled`."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


# What torch.nn's initialisers do: random draws, and (skipped only on the meta device,
# where tensors hold no values) constant fills. A mode sees nn.init's functions
# themselves, and a tensor's own methods.
_DRAWS = {nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
          nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
          nn.init.orthogonal_, torch.Tensor.normal_, torch.Tensor.uniform_}
_FILLS = _DRAWS | {nn.init.zeros_, nn.init.ones_, nn.init.constant_, torch.Tensor.fill_,
                   torch.Tensor.zero_}


class Unfilled(TorchFunctionMode):
    """Build modules without their initial values: weights that are about to be replaced
    by a checkpoint's are left as allocated (never written, so the pages are never
    touched), and on the meta device nothing runs at all. On meta, torch routes normal_
    through its Python reference, whose first call imports torch._dynamo: seconds and
    ~70 MB for a model that has no values anyway."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")      # nn.init passes it by name
        if isinstance(target, torch.Tensor) and (func in _DRAWS or (func in _FILLS and target.is_meta)):
            return target
        return func(*args, **kwargs)
