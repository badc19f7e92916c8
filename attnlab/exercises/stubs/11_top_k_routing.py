"""Exercise 11 of 12: top-k routing of a mixture of experts (gpt-oss, arXiv:2508.10925).

The model card: the MLP is many small experts. A router scores every expert for each
token (the logits); the k largest pick the experts the token goes to (k = 2 in the
cards), and a softmax over those k logits alone weights them, so the chosen weights sum
to 1 and the experts not chosen take no share. Shared experts (DeepSeek-V3,
arXiv:2412.19437) take every token, at weight 1:

    out(x) = Σ_shared FFN_s(x) + Σ_{i in top k} softmax(top-k logits)_i · FFN_i(x)

Read first: docs/after_the_article.md, "Beyond attention: a mixture of experts in the MLP".
Check:      python -m attnlab.exercises check top_k_routing
Once it passes, read the project's own: model/moe.py, MixtureOfExperts.forward and
_softmax_topk_route; then train the gpt-oss card with yours (with exercise 10's sink
too, if it passes):
    python train.py --config gpt-oss --model.mlp=yours
"""
import torch


def moe_layer(x, logits, experts, shared, k):
    """x: (N, C), one token a row; logits: (N, E), the router's score of each routed
    expert for each token; experts: a list of E functions and shared: a list of functions
    (maybe empty), each taking tokens (n, C) to (n, C); k: the experts each token goes to.

    Returns (N, C): per token, its k chosen experts' outputs weighted by the softmax of
    their k logits, plus every shared expert's output."""
    # top = logits.topk(k, dim=-1)   # (N, k): .values the chosen logits, .indices the experts
    # weights = ...                  # (N, k): a softmax over the k chosen logits
    # for each expert e: the tokens that chose it, times their weight for it, added to out
    # out = out + expert(x) for each shared expert
    raise NotImplementedError("exercise 11: write top-k routing")
