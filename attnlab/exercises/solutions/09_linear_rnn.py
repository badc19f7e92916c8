"""The answer to exercise 9, through the project's own code: model/linear_attention.py's
feature_map and its RNN form, `recurrent`, run over the one token."""
from model.linear_attention import LinearState, feature_map, recurrent


def linear_attention_step(q, k, v, S, z):
    one = (feature_map(q)[:, :, None], feature_map(k)[:, :, None], v[:, :, None])  # (B, H, 1, d)
    y, state = recurrent(*one, LinearState(S, z))
    return y[:, :, 0], state.S, state.z
