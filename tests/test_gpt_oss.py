"""gpt-oss proven equal to transformers' own GptOss classes (model/moe.py's softmax_topk
router and gpt_oss experts, model/sink_attention.py, engine/interop_gpt_oss.py): each
piece against its module with copied weights in float64, then a tiny random
GptOssForCausalLM imported through the bridge, and our gpt-oss exported back, with the
same logits; nothing downloaded.

Two of transformers' modules compute in float32 whatever the model's dtype: GptOssRMSNorm
casts its input to float32, and GptOssRotaryEmbedding turns float32 frequencies by
float32 positions. So the whole model is compared twice: as transformers ships it, in
float32 (to float32's error), and in float64 with those two forwards replaced by the same
formulas without the casts (`in_float64`), to 1e-9. Every other module runs as shipped."""
import json
import sys
import warnings

import pytest
import torch

from common.errors import CheckpointError
from engine import interop_gpt_oss
from engine.interop import export, load_hf_folder
from model import GPT, ModelConfig
from model.attention import Mask
from model.moe import MOE_EXPERTS, MOE_ROUTERS, ExpertKind, MixtureOfExperts, Router

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_interop import CHARS, gpt2_style_tokenizer  # noqa: E402

WINDOW, THETA = 4, 150000.0
# gpt-oss's own YaRN (its config's default, at a test's size): a context of 8 stretched 4 times.
YARN = {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def hf_config(vocab_size: int, **over) -> "transformers.GptOssConfig":
    c = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=32,
             rope_parameters={"rope_type": "default", "rope_theta": THETA})
    c.update(over)
    config = transformers.GptOssConfig(**c)
    config._attn_implementation = "eager"
    return config


def shaken(module: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Every weight moved away from its init (norms off 1, biases and sinks off 0), so a
    mapping that drops or swaps one shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


def _rms_norm_float64(self, x):
    # GptOssRMSNorm.forward without its cast to float32.
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_float64(self, x, position_ids):
    # GptOssRotaryEmbedding.forward (default RoPE) with float64 frequencies and positions.
    dim = self.config.head_dim
    base = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    return (freqs.cos() * self.attention_scaling).to(x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)


@pytest.fixture
def in_float64(monkeypatch):
    monkeypatch.setattr(hf_gpt_oss.GptOssRMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(hf_gpt_oss.GptOssRotaryEmbedding, "forward", _rotary_float64)


def our_moe(config) -> MixtureOfExperts:
    cfg = ModelConfig(n_embd=config.hidden_size, n_head=4, mlp="moe", moe_router="softmax_topk",
                      moe_expert="gpt_oss", moe_experts=config.num_local_experts,
                      moe_top_k=config.num_experts_per_tok, moe_shared=0,
                      moe_hidden=config.intermediate_size, moe_bias_rate=0.0, bias=True)
    return MixtureOfExperts(cfg).double().eval()


def copied_moe(hf_mlp) -> MixtureOfExperts:
    """Our experts with the weights of transformers' GptOssMLP, by the bridge's mapping."""
    moe = our_moe(hf_config(10))
    sd = {f"model.layers.0.mlp.{k}": v for k, v in hf_mlp.state_dict().items()}
    cfg = ModelConfig(n_layer=1, moe_experts=moe.n_routed, tie_embeddings=False)
    ours = interop_gpt_oss._from_hf(lambda name: sd.get(name, torch.zeros(1)), cfg)
    moe.load_state_dict({k.removeprefix("blocks.0.mlp."): v for k, v in ours.items()
                         if k.startswith("blocks.0.mlp.")})
    return moe


def hf_mlp(seed: int = 0):
    torch.manual_seed(seed)
    mlp = hf_gpt_oss.GptOssMLP(hf_config(10)).double().eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.3)
    return mlp


def tokens(n: int = 40, seed: int = 1) -> torch.Tensor:
    # Wide enough that the clamps bite: some gates pass +7, some ups pass ±7.
    return torch.randn(n, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 3


# -- the pieces, each against transformers' module, float64 -----------------------------

def test_the_router_picks_and_weights_as_gpt_oss_top_k_router():
    mlp = hf_mlp()
    ours = copied_moe(mlp)
    u = tokens()
    _, their_weights, their_chosen = mlp.router(u)
    weights, chosen = ours.route(u)
    assert torch.equal(chosen, their_chosen)
    torch.testing.assert_close(weights, their_weights, atol=1e-12, rtol=0)


def test_the_experts_compute_what_gpt_oss_experts_compute():
    mlp = hf_mlp()
    ours = copied_moe(mlp)
    u = tokens()
    gate_up = torch.einsum("nc,ech->enh", u, mlp.experts.gate_up_proj) + mlp.experts.gate_up_proj_bias[:, None]
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()   # clamps bite
    their_out, _ = mlp(u[None])
    torch.testing.assert_close(ours(u[None]), their_out, atol=1e-12, rtol=0)
    for e in range(4):                                        # expert by expert, no routing
        w = mlp.experts
        theirs = w._apply_gate(u @ w.gate_up_proj[e] + w.gate_up_proj_bias[e]) @ w.down_proj[e] + w.down_proj_bias[e]
        torch.testing.assert_close(ours.expert(e, u), theirs, atol=1e-12, rtol=0)


def test_rope_turns_the_halves_as_gpt_oss_applies_it():
    cfg = ModelConfig(vocab_size=10, n_layer=1, n_embd=64, n_head=4, block_size=32, rope_theta=THETA)
    model = GPT(cfg).double()
    q = torch.randn(2, 4, 20, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 20, 16, dtype=torch.float64)
    inv_freq = THETA ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angle = torch.arange(3, 23, dtype=torch.float64)[None, :, None] * inv_freq
    their_q, their_k = hf_gpt_oss.apply_rotary_pos_emb(q, k, angle.cos(), angle.sin())
    torch.testing.assert_close(model.positions.rotate(q, 3), their_q, atol=1e-12, rtol=0)
    torch.testing.assert_close(model.positions.rotate(k, 3), their_k, atol=1e-12, rtol=0)


# -- the whole model: a transformers folder in, ours out ---------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    tok = gpt2_style_tokenizer(folder)
    torch.manual_seed(0)
    shaken(transformers.GptOssForCausalLM(hf_config(tok.vocab_size)).eval()).save_pretrained(folder)
    return folder, tok.vocab_size


def hf_model(folder, dtype=torch.float64):
    # Eager attention and experts: the forms written in modeling_gpt_oss.py (the grouped
    # matmul takes no float64).
    model = transformers.GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                           experts_implementation="eager")
    return model.to(dtype).eval()


def batch(vocab: int, T: int = 20) -> torch.Tensor:
    # 20 tokens: five times the window, so each windowed layer drops keys in every row past 4.
    return torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(2))


def test_the_bridge_reads_gpt_oss_as_its_card(hf_folder):
    folder, _ = hf_folder
    _, cfg, _ = load_hf_folder(folder)
    assert (cfg.mechanism, cfg.sliding_window, cfg.full_attention_every) == ("sinks", WINDOW, 2)
    assert (cfg.moe_router, cfg.moe_expert, cfg.moe_experts, cfg.moe_top_k, cfg.moe_hidden,
            cfg.n_kv_head, cfg.bias, cfg.tie_embeddings) == ("softmax_topk", "gpt_oss", 4, 2, 48, 2,
                                                             True, False)
    layer_types = json.loads((folder / "config.json").read_text())["layer_types"]
    assert interop_gpt_oss.layer_types(cfg) == layer_types


@pytest.mark.parametrize("layer", [0, 1])           # a windowed layer, then a full one
def test_each_attention_layer_computes_what_gpt_oss_attention_computes(hf_folder, layer):
    """Our layer against transformers' GptOssAttention, in float64 as shipped, with its own
    window rule (masking_utils: key > query - W, and key <= query) and the angles given
    to both in float64: q, k, v and o with their biases, the sinks, GQA and RoPE."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    folder, _ = hf_folder
    ours, cfg, _ = load_hf_folder(folder, dtype=torch.float64)
    theirs = hf_model(folder).model.layers[layer].self_attn
    T = 20
    x = torch.randn(2, T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    allowed = (sliding_window_causal_mask_function(WINDOW) if theirs.sliding_window
               else causal_mask_function)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(
        ~allowed(0, 0, q, k), torch.finfo(torch.float64).min)
    inv_freq = THETA ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angle = torch.arange(T, dtype=torch.float64)[None, :, None] * inv_freq
    with torch.no_grad():
        expected, _ = theirs(x, (angle.cos(), angle.sin()), additive[None, None])
        mask = Mask.over(0, T, T, window=0 if ours.sees_everything(layer) else cfg.sliding_window)
        got = ours.blocks[layer].attn(x, ours.positions, mask)[0]
    assert bool(theirs.sliding_window) != ours.sees_everything(layer)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_an_imported_gpt_oss_gives_transformers_logits_in_float64(hf_folder, in_float64):
    folder, vocab = hf_folder
    ours, _, _ = load_hf_folder(folder, dtype=torch.float64)
    x = batch(vocab)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf_model(folder)(x).logits, atol=1e-9, rtol=0)


def test_an_imported_gpt_oss_gives_transformers_logits_as_shipped_in_float32(hf_folder):
    folder, vocab = hf_folder
    ours, _, _ = load_hf_folder(folder)
    x = batch(vocab)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf_model(folder, torch.float32)(x).logits,
                                   atol=1e-4, rtol=0)   # logits of order 10


def test_an_imported_gpt_oss_decodes_from_its_cache_the_logits_of_its_full_pass(hf_folder):
    folder, vocab = hf_folder
    ours, _, _ = load_hf_folder(folder, dtype=torch.float64)
    x = batch(vocab)
    with torch.no_grad():
        full = ours(x).logits
        cache = ours.new_cache(x.shape[1])
        steps = [ours(x[:, :3], cache=cache).logits]
        steps += [ours(x[:, t:t + 1], cache=cache).logits for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-9, rtol=0)


def test_our_gpt_oss_exports_to_a_folder_transformers_loads_with_equal_logits(tmp_path, in_float64):
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=32, n_layer=4, n_head=4, n_kv_head=2,
                      n_embd=64, mechanism="sinks", sliding_window=WINDOW, full_attention_every=2,
                      norm="rmsnorm", mlp="moe", moe_experts=4, moe_top_k=2, moe_shared=0,
                      moe_router="softmax_topk", moe_expert="gpt_oss", moe_bias_rate=0.0,
                      bias=True, tie_embeddings=False, rope_theta=THETA)
    torch.manual_seed(0)
    ours = shaken(GPT(cfg)).double().eval()
    arch = export(ours, cfg, CHARS, tmp_path / "out")
    assert arch.hf_class == "GptOssForCausalLM"
    theirs, info = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = theirs.double().eval()
    x = batch(CHARS.vocab_size)
    with torch.no_grad():   # the export is written in float32: compare with our model rounded so
        ours_rounded = GPT(cfg).double().eval()
        ours_rounded.load_state_dict({k: v.float().double() for k, v in ours.state_dict().items()})
        torch.testing.assert_close(theirs(x).logits, ours_rounded(x).logits, atol=1e-9, rtol=0)


# -- gpt-oss's YaRN ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def yarn_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_yarn")
    tok = gpt2_style_tokenizer(folder)
    torch.manual_seed(1)
    shaken(transformers.GptOssForCausalLM(hf_config(tok.vocab_size, rope_parameters=YARN)).eval()
           ).save_pretrained(folder)
    return folder, tok.vocab_size


def test_yarn_stretches_the_frequencies_as_transformers_does():
    """Frequencies and temperature against transformers' own YaRN, which computes in
    float32: to float32's rounding (it misses float64's by some 1e-8 of a frequency)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from model.rope_scaling import ROPE_SCALINGS
    for factor, original in ((4.0, 8), (32.0, 4096), (2.0, 100)):
        params = {**YARN, "factor": factor, "original_max_position_embeddings": original}
        theirs, temperature = ROPE_INIT_FUNCTIONS["yarn"](hf_config(10, rope_parameters=params), "cpu")
        cfg = ModelConfig(n_embd=64, n_head=4, rope_theta=THETA, rope_scaling="yarn_by_pairs",
                          rope_factor=factor, rope_original_context=original)
        plain = THETA ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        ours, mscale = ROPE_SCALINGS["yarn_by_pairs"].scale(plain, cfg)
        torch.testing.assert_close(ours, theirs.double(), rtol=3e-7, atol=0)
        assert mscale == pytest.approx(temperature, abs=1e-15)
        # the paper's ramp (model.rope_scaling=yarn) is another curve
        assert not torch.allclose(ROPE_SCALINGS["yarn"].scale(plain, cfg)[0], ours, rtol=1e-3)


def test_a_gpt_oss_with_yarn_imports_exports_and_gives_transformers_logits(yarn_folder, tmp_path,
                                                                           monkeypatch):
    folder, vocab = yarn_folder
    ours, cfg, tokenizer = load_hf_folder(folder)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_context) == ("yarn_by_pairs", 4.0, 8)
    x = batch(vocab, T=32)                        # 4 times the original context
    with torch.no_grad():                         # as shipped, in float32
        torch.testing.assert_close(ours(x).logits, hf_model(folder, torch.float32)(x).logits,
                                   atol=1e-4, rtol=0)
    # In float64, their norm without its cast, and both models turned by transformers' own
    # frequencies cast up (tested above to float32's rounding): the rest to 1e-9.
    monkeypatch.setattr(hf_gpt_oss.GptOssRMSNorm, "forward", _rms_norm_float64)
    theirs = hf_model(folder)
    freqs = theirs.model.rotary_emb.inv_freq.double()
    monkeypatch.setattr(hf_gpt_oss.GptOssRotaryEmbedding, "forward", lambda self, h, pos: (
        ((pos[..., None].double() * freqs).cos() * self.attention_scaling).to(h.dtype),
        ((pos[..., None].double() * freqs).sin() * self.attention_scaling).to(h.dtype)))
    ours = ours.double()
    ours.positions.inv_freq = freqs
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, theirs(x).logits, atol=1e-9, rtol=0)
    export(ours, cfg, tokenizer, tmp_path / "again")
    params = json.loads((tmp_path / "again" / "config.json").read_text())["rope_parameters"]
    assert params == YARN


# -- what the bridge cannot represent is refused in one line naming it --------------------

@pytest.mark.parametrize("change,named", [
    (dict(swiglu_limit=5.0), "swiglu_limit"),
    (dict(swiglu_alpha=1.0), "swiglu_alpha"),
    (dict(attention_bias=False), "attention_bias"),
    (dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"]),
     "layer_types"),
    (dict(head_dim=8), "head_dim"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0,
                           "original_max_position_embeddings": 8}), "truncate"),
    (dict(rope_parameters={**YARN, "beta_fast": 16.0}), "beta_fast"),
    (dict(rope_parameters={**YARN, "attention_factor": 1.5}), "attention_factor"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}),
     "rope scaling"),
])
def test_a_gpt_oss_the_bridge_cannot_compute_is_refused_in_one_line(change, named, tmp_path):
    tok = gpt2_style_tokenizer(tmp_path)
    transformers.GptOssForCausalLM(hf_config(tok.vocab_size, **change)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value)


# -- planted slips: each must break the float64 equality ----------------------------------

def _softmax_over_all(logits, balance_bias, k):
    chosen = logits.topk(k, dim=-1).indices
    return torch.softmax(logits, dim=-1).gather(-1, chosen), chosen


def _no_plus_one(gate, up):
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return up * (gate * torch.sigmoid(1.702 * gate))


SLIPS = {
    "softmax over every expert, not the top k":
        lambda mp: mp.setitem(MOE_ROUTERS, "softmax_topk", Router(_softmax_over_all, True, False)),
    "no +1 on up": lambda mp: mp.setitem(MOE_EXPERTS, "gpt_oss", ExpertKind(_no_plus_one, 1.702, 7.0)),
    "gate and up read as halves, not interleaved":
        lambda mp: mp.setattr(interop_gpt_oss, "_deinterleave", lambda t: t),
    "window one longer": lambda mp: mp.setattr(
        interop_gpt_oss, "_window_pattern",
        lambda c, real=interop_gpt_oss._window_pattern: (real(c)[0] + 1, real(c)[1])),
}


@pytest.mark.parametrize("slip", SLIPS)
def test_a_planted_slip_breaks_the_equality(slip, hf_folder, in_float64, monkeypatch):
    folder, vocab = hf_folder
    SLIPS[slip](monkeypatch)
    ours, _, _ = load_hf_folder(folder, dtype=torch.float64)
    x = batch(vocab)
    with torch.no_grad():
        gap = (ours(x).logits - hf_model(folder)(x).logits).abs().max().item()
    assert gap > 1e-6, slip


def test_the_gpt_oss_preset_is_a_model_transformers_gpt_oss_computes():
    from engine import cli
    from engine.interop import architecture_for
    cfg = cli.build("gpt-oss", []).model
    cfg.vocab_size = CHARS.vocab_size
    assert architecture_for(cfg, CHARS) is interop_gpt_oss.GPT_OSS
