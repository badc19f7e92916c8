"""The answer to exercise 11, through the project's own code: model/moe.py's
MixtureOfExperts.forward with gpt-oss's router (softmax over the top k), run with the
given logits and experts in place of a layer's own."""
from types import SimpleNamespace

from model.moe import MOE_ROUTERS, MixtureOfExperts


def moe_layer(x, logits, experts, shared, k):
    # forward numbers the shared experts first, then the routed ones, as the layer holds them.
    every = [*shared, *experts]
    layer = SimpleNamespace(
        n_shared=len(shared), n_routed=len(experts), training=False, dropout=lambda t: t,
        shared_gate=None,                    # gpt-oss's shared experts (if any) are not gated
        route=lambda u: MOE_ROUTERS["softmax_topk"].route(logits, None, k),
        expert=lambda e, u: every[e](u))
    return MixtureOfExperts.forward(layer, x)
