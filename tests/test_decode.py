"""Decoding with a preallocated (static) KV cache, the step a CUDA graph records
(model/cache.py): each step's logits against an uncached full forward pass over the
same tokens, for every backend, position encoding, grouped key/value heads and sliding
windows run well past their length; the tokens generate() draws with it against the
growing cache's for the same seed."""
import itertools

import pytest
import torch

from model import GPT, REGISTRIES, ModelConfig
from model.cache import EMPTY
from model.decode import decodes_with_rolling_cache, static_cache

BACKENDS = sorted(set(REGISTRIES["attention"]) - {"flex"})   # flex: in test_model, once
CASES = [(0, 0, 0), (2, 0, 0), (0, 5, 0), (2, 5, 2)]         # (n_kv_head, window, n_global)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, n_layer=2, n_head=4, n_embd=32, block_size=16)
    if kw.get("attention") == "banded" and not kw.get("sliding_window"):
        kw["sliding_window"] = 6
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("attention,position",
                         list(itertools.product(BACKENDS, sorted(REGISTRIES["position"]))))
@pytest.mark.parametrize("n_kv_head,window,n_global", CASES)
def test_static_cache_steps_equal_the_full_forward_pass(attention, position, n_kv_head,
                                                        window, n_global):
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, position=position, n_kv_head=n_kv_head,
                     sliding_window=window, n_global=n_global)).eval()
    # A rolling cache runs 2.5x past the context (and 8x past a window of 5); the
    # others fill the context, which is also past any window.
    T = 40 if decodes_with_rolling_cache(model) else 16
    x = torch.randint(0, 40, (2, T))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(16)
        model(x[:, :4], cache=cache)
        static = static_cache(model, 16)
        static.load(cache)
        buffers = (static.k[0].data_ptr(), static.nbytes())
        steps = [model(x[:, t:t + 1], cache=static).logits for t in range(4, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 4:], atol=2e-5, rtol=0)
    assert int(static.length) == T
    # Nothing was reallocated: a recorded graph would still point at the right memory.
    assert (static.k[0].data_ptr(), static.nbytes()) == buffers
    W = model.config.sliding_window
    assert static.capacity == (n_global + W if W else 16)


def test_a_windowed_static_cache_holds_exactly_the_keys_the_next_query_can_see():
    """Rolling buffer bookkeeping: after each step the slots hold the n_global first
    positions and the newest W, each once; the rest are empty."""
    model = GPT(tiny(position="rope", sliding_window=5, n_global=2)).eval()
    cache = model.new_cache(16)
    x = torch.randint(0, 40, (1, 30))
    with torch.no_grad():
        model(x[:, :3], cache=cache)
        static = static_cache(model, 16)
        static.load(cache)
        for t in range(3, 30):
            model(x[:, t:t + 1], cache=static)
            held = sorted(p for p in static.slot_pos.tolist() if p != EMPTY)
            expected = sorted(set(range(min(2, t + 1))) | set(range(max(0, t - 4), t + 1)))
            assert held == expected, t


def _draw(model, prompt, decode):
    """45 sampled tokens (seed 3) and each step's logits."""
    g = torch.Generator(device=prompt.device).manual_seed(3)
    seen = []
    tokens = model.generate(prompt, 45, temperature=1.0, generator=g, decode=decode,
                            on_step=lambda logits, t: seen.append(logits))
    return torch.cat(list(tokens), 1), torch.stack(seen)


@pytest.mark.parametrize("prompt_len", [5, 16, 20])         # short, the whole context, longer
@pytest.mark.parametrize("position,window", [("rope", 0), ("learned", 0), ("alibi", 5),
                                             ("sinusoidal", 5), ("rope", 5)])
def test_static_decoding_draws_the_same_tokens_as_the_growing_cache(position, window, prompt_len):
    """Through generate(), sampled (not greedy), past block_size: through the context
    shift of absolute positions and the rolling buffer of relative ones."""
    torch.manual_seed(0)
    model = GPT(tiny(position=position, sliding_window=window)).eval()
    prompt = torch.randint(0, 40, (2, prompt_len))
    runs = {decode: _draw(model, prompt, decode) for decode in ("cache", "static")}
    assert torch.equal(runs["cache"][0], runs["static"][0])
    torch.testing.assert_close(runs["cache"][1], runs["static"][1], atol=2e-5, rtol=0)
    assert len(set(runs["cache"][0].flatten().tolist())) > 10          # really sampled


def test_static_cache_refuses_chunks_and_a_graph_off_cuda():
    model = GPT(tiny()).eval()
    cache = model.new_cache(16)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    static = static_cache(model, 16)
    static.load(cache)
    with pytest.raises(ValueError, match="one token per step"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=static)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            next(model.generate(torch.zeros(1, 3, dtype=torch.long), 2, decode="graph"))
    with pytest.raises(ValueError, match="decode must be one of"):
        next(model.generate(torch.zeros(1, 3, dtype=torch.long), 2, decode="fast"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("position,window", [("rope", 0), ("learned", 0), ("alibi", 5)])
def test_cuda_graph_decoding_draws_the_same_tokens_as_the_growing_cache(position, window):
    torch.manual_seed(0)
    model = GPT(tiny(position=position, sliding_window=window)).cuda().eval()
    prompt = torch.randint(0, 40, (1, 5), device="cuda")
    runs = {decode: _draw(model, prompt, decode) for decode in ("cache", "graph")}
    assert torch.equal(runs["cache"][0], runs["graph"][0])
    torch.testing.assert_close(runs["cache"][1], runs["graph"][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("block,window", [("prenorm", 0), ("postnorm", 0), ("prenorm", 5)])
def test_token_mix_decodes_in_chunks_and_static_steps_as_the_full_pass_reads(block, window):
    """Each chunk's TokenMix reads the rows before it from the cache: a cache that
    dropped them, or kept the wrong ones, changes the logits after the first chunk."""
    torch.manual_seed(0)
    model = GPT(tiny(position="rope", block=block, sliding_window=window, token_mix=3)).eval()
    with torch.no_grad():
        for layer in model.blocks:
            layer.mix.taps.normal_(0, 0.5)           # trained weights, not the zeros of a new model
        T = 40 if decodes_with_rolling_cache(model) else 16
        x = torch.randint(0, 40, (2, T))
        full = model(x).logits
        cache = model.new_cache(16)
        chunks = [model(x[:, a:b], cache=cache).logits for a, b in ((0, 4), (4, 5), (5, 8))]
        torch.testing.assert_close(torch.cat(chunks, 1), full[:, :8], atol=2e-5, rtol=0)
        static = static_cache(model, 16)
        static.load(cache)
        steps = [model(x[:, t:t + 1], cache=static).logits for t in range(8, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 8:], atol=2e-5, rtol=0)


def test_token_mix_draws_the_same_tokens_from_every_cache_and_the_full_pass():
    torch.manual_seed(0)
    model = GPT(tiny(position="rope", token_mix=4)).eval()
    with torch.no_grad():
        for layer in model.blocks:
            layer.mix.taps.normal_(0, 0.5)
    prompt = torch.randint(0, 40, (2, 5))
    # Within the context (5 + 11 tokens), where a full pass and a cache read the same rows.
    runs = {decode: _draw(model, prompt, decode)[0][:, :11] for decode in ("full", "cache", "static")}
    assert torch.equal(runs["cache"], runs["full"]) and torch.equal(runs["static"], runs["full"])
    tokens, _ = _draw(model, prompt, "static")                  # past it, through the re-read
    assert torch.equal(tokens, _draw(model, prompt, "cache")[0])


def test_the_static_cache_is_kept_for_the_next_call_and_remade_when_the_weights_move():
    """Recording a graph costs as much as dozens of tokens, so a model's static cache
    (and recorded step) serves its next generate call; a model whose weights moved
    (another dtype) gets a new one, and either way draws the growing cache's tokens."""
    from model.decode import _KEPT_STEPS
    torch.manual_seed(0)
    model = GPT(tiny(position="rope")).eval()
    prompt = torch.randint(0, 40, (1, 5))
    first = _draw(model, prompt, "static")[0]
    kept = _KEPT_STEPS[model][1]
    assert torch.equal(_draw(model, prompt, "static")[0], first)
    assert _KEPT_STEPS[model][1] is kept
    assert torch.equal(first, _draw(model, prompt, "cache")[0])
    model.double()
    assert torch.equal(_draw(model, prompt, "static")[0], _draw(model, prompt, "cache")[0])
    assert _KEPT_STEPS[model][1] is not kept and _KEPT_STEPS[model][1].k[0].dtype == torch.float64


def test_two_generate_calls_at_once_do_not_share_a_static_cache():
    torch.manual_seed(0)
    model = GPT(tiny(position="rope")).eval()
    prompts = torch.randint(0, 40, (2, 1, 4))
    list(model.generate(prompts[0], 3, decode="static"))            # one kept, to be taken
    expected = [torch.cat(list(model.generate(p, 30, temperature=0, decode="cache")), 1)
                for p in prompts]
    a, b = (model.generate(p, 30, temperature=0, decode="static") for p in prompts)
    drawn = [[], []]
    for ta, tb in zip(a, b):                                        # interleaved, step by step
        drawn[0].append(ta)
        drawn[1].append(tb)
    for got, want in zip(drawn, expected):
        assert torch.equal(torch.cat(got, 1), want)


def test_a_decoding_step_computes_ropes_angles_once_not_once_a_layer():
    """On a GPU a step's time is its kernel launches: the angles of the step's position
    are the same for every layer's queries and keys, so they are made once a pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.cos = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.cos += func.overloadpacket.__name__ == "cos"
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = GPT(tiny(position="rope", n_layer=3)).eval()
    x = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        cache = model.new_cache(16)
        model(x[:, :5], cache=cache)
        static = static_cache(model, 16)
        static.load(cache)
        with Count() as count:
            step = model(x[:, 5:], cache=static).logits
        full = model(x).logits[:, 5:]
    assert count.cos == 1
    torch.testing.assert_close(step, full, atol=2e-5, rtol=0)


def test_a_kept_static_cache_serves_only_a_call_like_the_one_that_made_it():
    """Another batch, autocast, inference mode, training mode or a hook set (which a
    recorded graph would skip) each need a cache of their own: the kept one is not
    taken, and every call draws the growing cache's tokens."""
    from model.decode import _KEPT_STEPS
    torch.manual_seed(0)
    model = GPT(tiny(position="rope")).eval()
    prompt = torch.randint(0, 40, (2, 5))

    def same(p, **kw):
        got = torch.cat(list(model.generate(p, 20, temperature=0, decode="static", **kw)), 1)
        want = torch.cat(list(model.generate(p, 20, temperature=0, decode="cache", **kw)), 1)
        assert torch.equal(got, want)
        return _KEPT_STEPS.get(model, (None, None))[1]

    one = same(prompt[:1])
    assert same(prompt[:1]) is one
    assert same(prompt) is not one                                  # batch 2
    two = same(prompt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert same(prompt) is not two and _KEPT_STEPS[model][1].k[0].dtype == torch.bfloat16
    assert same(prompt) is not None and _KEPT_STEPS[model][1].k[0].dtype == torch.float32
    with torch.inference_mode():
        kept = same(prompt)
    assert same(prompt) is not kept
    kept = same(prompt)
    model.train()                                                   # (no dropout: same tokens)
    assert same(prompt) is not kept
    model.eval()
    handle = model.blocks[0].register_forward_hook(lambda *a: None)
    _KEPT_STEPS.pop(model, None)
    same(prompt)
    assert model not in _KEPT_STEPS                                 # a hooked model keeps none
    handle.remove()
