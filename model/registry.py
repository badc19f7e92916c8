"""Every variant the config can name, by registry. Adding a variant is one entry in
its module's dict; tests parametrize over these, so it is tested the day it lands."""
from model.attention import ATTENTION_BACKENDS
from model.layers import MLPS, NORMS
from model.positions import POSITION_ENCODINGS, ROPE_SCALINGS

REGISTRIES = {
    "attention": ATTENTION_BACKENDS,
    "position": POSITION_ENCODINGS,
    "norm": NORMS,
    "mlp": MLPS,
    "rope_scaling": {name: name for name in ROPE_SCALINGS},
}
