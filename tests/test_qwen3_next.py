"""Qwen3-Next proven equal to transformers' own Qwen3Next classes (model/deltanet.py's
NormedGatedDeltaNet and short convolution, model/positions.py's PartialRoPE, model/moe.py's
softmax router and shared-expert gate, model/gated_attention.py, engine/interop_qwen3_next.py):
the pieces against its modules with copied weights, then a tiny random Qwen3NextForCausalLM
imported through the bridge, and our Qwen3-Next exported back, with the same logits; nothing
downloaded. transformers runs its pure-PyTorch forms here (no causal_conv1d, no fla kernels).

transformers computes several parts in float32 whatever the model's dtype: its norms cast
their input to float32, the rotary angles are float32, the delta rule's chunked and
recurrent forms cast q, k, v, β and the decay to float32, the decay's own inputs are
`.float()`-ed, and the router's softmax is taken in float32. The float64 comparisons run
`in_float64`, a copy of modeling_qwen3_next.py compiled with those casts made to float64
and nothing else changed; the float32 ones run transformers untouched."""
import importlib.util
import json
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from common.errors import CheckpointError
from data.tokenizer import CharTokenizer
from engine.interop import ExportError, architecture_for, export, hf_tokenizer, load_hf_folder
from model import GPT, ModelConfig
from model.config import ModelError
from model.moe import MixtureOfExperts
from model.positions import POSITION_ENCODINGS

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as theirs  # noqa: E402
from card_checks import agrees_untouched_in_float32, decodes_as_its_full_pass  # noqa: E402

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\n")
V = CHARS.vocab_size
LENGTH = 30
# Each cast to float32 in modeling_qwen3_next.py, and what `in_float64` makes of it.
CASTS = ((".to(torch.float32", ".to(torch.float64"), ("dtype=torch.float32", "dtype=torch.float64"),
         ("dtype=torch.float)", "dtype=torch.float64)"), ("dtype=torch.float,", "dtype=torch.float64,"),
         (".float()", ".double()"))


@pytest.fixture(scope="module")
def in_float64():
    """modeling_qwen3_next.py with its float32 casts made float64: its formulas as written,
    at the precision the comparison needs."""
    source = open(theirs.__file__, encoding="utf-8").read()
    for cast, wider in CASTS:
        assert cast in source, cast          # a cast renamed upstream would pass silently
        source = source.replace(cast, wider)
    name = theirs.__name__ + "_in_float64"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__, module.__file__ = theirs.__package__, theirs.__file__
    sys.modules[name] = module
    exec(compile(source, theirs.__file__, "exec"), module.__dict__)
    yield module
    sys.modules.pop(name, None)


def qwen_config(**kw) -> "transformers.Qwen3NextConfig":
    """Four layers, three linear to one full as Qwen3-Next places them; GQA; RoPE on a quarter
    of each head; four experts, two a token, and a shared expert twice an expert's width."""
    base = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                moe_intermediate_size=24, shared_expert_intermediate_size=48, num_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.Qwen3NextConfig(**{**base, **kw})


def shaken(module: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Every weight moved off its init ((1+w) norms start at w = 0, the gated norm at 1, the
    router at 0), so a mapping that drops or swaps one shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


def random_qwen(folder, **kw):
    torch.manual_seed(0)
    hf = shaken(transformers.Qwen3NextForCausalLM(qwen_config(**kw)).eval())
    hf.save_pretrained(folder)
    hf_tokenizer(CHARS).save_pretrained(folder)
    return hf


def reference(module, folder, dtype=torch.float64):
    # Eager experts: the loop written in the modeling file (the grouped matmul takes no float64).
    return module.Qwen3NextForCausalLM.from_pretrained(
        folder, dtype=dtype, experts_implementation="eager").eval()


def batch(T: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))


def card(**kw) -> ModelConfig:
    """Our Qwen3-Next at a test's size, every piece of the card on."""
    return ModelConfig(**{**dict(
        vocab_size=V, block_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=64,
        mechanism="gated_deltanet_norm,gated_deltanet_norm,gated_deltanet_norm,gated",
        delta_conv=4, position="rope_partial", norm="rmsnorm1p", norm_eps=1e-6, qk_norm=True,
        qk_norm_weight=True, mlp="moe", moe_router="softmax", moe_shared_gate=True,
        moe_bias_rate=0.0, moe_experts=4, moe_top_k=2, moe_shared=1, moe_hidden=24,
        tie_embeddings=False), **kw})


# -- the pieces, each against transformers' module, float64 ------------------------------

def mapped(cfg: ModelConfig, present: dict, part: str) -> dict:
    """Our weights under `part` (as "blocks.0.attn.") by the bridge's mapping from the
    transformers names in `present`; the names a lone module lacks read as our own."""
    from engine import interop_qwen3_next as bridge
    own = bridge._to_hf(GPT(cfg).state_dict(), cfg)
    ours = bridge._from_hf(lambda name: present.get(name, own[name]), cfg)
    return {k.removeprefix(part): v for k, v in ours.items() if k.startswith(part)}


def test_the_linear_layer_is_qwen3_nexts_gated_deltanet(in_float64):
    """Our NormedGatedDeltaNet with model.delta_conv against Qwen3NextGatedDeltaNet: the
    short convolution, SiLU, L2 norms with the kernels' ε, q/√d_k, Mamba2's decay, β, the
    chunked rule and the SiLU-gated RMSNorm, weights copied by the bridge's mapping."""
    torch.manual_seed(0)
    hf = shaken(in_float64.Qwen3NextGatedDeltaNet(qwen_config(), 0)).double().eval()
    cfg = card(n_layer=1, mechanism="gated_deltanet_norm", qk_norm=False, qk_norm_weight=False, n_kv_head=0,
               linear_chunk=8)
    sd = {f"model.layers.0.linear_attn.{k}": v for k, v in hf.state_dict().items()}
    ours = GPT(cfg).double()
    layer = ours.blocks[0].attn
    layer.load_state_dict(mapped(cfg, sd, "blocks.0.attn."))
    x = torch.randn(2, 21, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    from model.attention import Mask
    mask = Mask(q_start=0, q_len=21, k_pos=torch.arange(21))
    with torch.no_grad():
        out, _ = layer(x, ours.positions, mask)
        torch.testing.assert_close(out, hf(x), atol=1e-12, rtol=0)


def test_the_short_convolution_decodes_as_its_full_pass():
    """The last K-1 rows of q, k and v kept beside the state: token by token equals the pass,
    and the cache holds what the entry counts."""
    from model.mechanisms import MECHANISMS
    cfg = card(n_layer=1, mechanism="gated_deltanet_norm", qk_norm=False, qk_norm_weight=False, n_kv_head=0,
               mlp="gelu", moe_router="sigmoid", moe_shared_gate=False, moe_bias_rate=1e-3,
               moe_experts=8, moe_top_k=2, moe_shared=1, moe_hidden=0)
    torch.manual_seed(0)
    model = shaken(GPT(cfg), 0.3).double().eval()
    x = batch(20)
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(20)
        steps = [model(x[:, :3], cache=cache).logits]
        steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(3, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    assert cache.nbytes() == 8 * 3 * MECHANISMS["gated_deltanet_norm"].cache.fixed(cfg)   # a batch of 3
    assert MECHANISMS["gated_deltanet_norm"].cache.fixed(cfg) == 4 * 16 * 16 + 3 * 3 * 64


def test_partial_rope_turns_a_quarter_of_each_head_as_qwen3_next():
    cfg = card()
    rope = POSITION_ENCODINGS[cfg.position](cfg).double()
    q = torch.randn(2, 4, 20, 16, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    angle = torch.arange(3, 23, dtype=torch.float64)[None, :, None] * inv_freq
    angle = torch.cat((angle, angle), -1)
    their_q, _ = theirs.apply_rotary_pos_emb(q, q, angle.cos(), angle.sin())
    torch.testing.assert_close(rope.rotate(q, 3), their_q, atol=1e-12, rtol=0)
    assert torch.equal(rope.rotate(q, 3)[..., 4:], q[..., 4:])      # three quarters untouched
    # a kept key turned on by 5 is the key turned at its new place (streaming's renumbering)
    torch.testing.assert_close(rope.shift(rope.rotate(q, 3), 5), rope.rotate(q, 8), atol=1e-12, rtol=0)


def test_the_experts_are_qwen3_nexts_sparse_moe_block(in_float64):
    """The softmax router's top k renormalised, the routed SwiGLU experts, and the shared
    experts (ours two of 24, theirs one of 48) behind a sigmoid gate."""
    torch.manual_seed(0)
    hf = in_float64.Qwen3NextSparseMoeBlock(qwen_config()).double().eval()
    with torch.no_grad():            # drawn afresh: the experts are made with torch.empty
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    cfg = card(n_layer=1, mechanism="gated", delta_conv=0, moe_shared=2)
    moe = MixtureOfExperts(cfg).double().eval()
    files = {f"model.layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}
    for e in range(4):               # the files' layout: each expert apart from the next
        gate, up = hf.experts.gate_up_proj[e].chunk(2)
        files[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
        files[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = up
        files[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = hf.experts.down_proj[e]
    moe.load_state_dict(mapped(cfg, files, "blocks.0.mlp."))
    u = torch.randn(1, 40, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(u), hf(u), atol=1e-12, rtol=0)


# -- the whole model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    random_qwen(folder)
    return folder


def test_the_bridge_reads_qwen3_next_as_its_card(hf_folder):
    _, cfg, tokenizer = load_hf_folder(hf_folder)
    assert cfg == card(n_layer=4, moe_shared=2)
    assert tokenizer.encode("to be, or") == CHARS.encode("to be, or")


def test_a_qwen3_next_folder_imports_with_equal_logits_in_float64(hf_folder, in_float64):
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(in_float64, hf_folder)(x).logits,
                                   atol=1e-9, rtol=0)


def test_every_layer_hands_on_what_qwen3_nexts_decoder_layer_does_in_float64(hf_folder, in_float64):
    """Layer by layer (three linear, then the full one), so a fault names its layer."""
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    streams = []
    hooks = [b.register_forward_hook(lambda m, a, out: streams.append(out[0])) for b in ours.blocks]
    with torch.no_grad():
        final = ours(x).hidden
        expected = reference(in_float64, hf_folder)(x, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    assert len(expected) == len(streams) + 1
    for i, (mine, theirs_) in enumerate(zip(streams[:-1] + [final], expected[1:])):
        torch.testing.assert_close(mine, theirs_, atol=1e-9, rtol=0, msg=f"layer {i}")


def test_our_qwen3_next_exports_to_a_folder_transformers_loads_with_equal_logits(
        tmp_path, in_float64):
    cfg = card(moe_shared=2)
    torch.manual_seed(1)
    ours = shaken(GPT(cfg), 0.2).double().eval()     # our own weights, every one off its init
    arch = export(ours, cfg, CHARS, tmp_path / "out")
    assert arch.hf_class == "Qwen3NextForCausalLM"
    hf, info = in_float64.Qwen3NextForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64, experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.25
    x = batch()
    with torch.no_grad():            # the export is float32: our model rounded to it
        rounded = ours.float().double()
        torch.testing.assert_close(hf.eval()(x).logits, rounded(x).logits, atol=1e-9, rtol=0)
    assert load_hf_folder(tmp_path / "out")[1] == cfg


def test_untouched_transformers_agrees_in_float32(hf_folder, tmp_path):
    agrees_untouched_in_float32(hf_folder, tmp_path / "out", batch(), "Qwen3NextForCausalLM")


def test_the_imported_model_decodes_from_its_cache_as_its_full_pass(hf_folder):
    decodes_as_its_full_pass(hf_folder, batch())


@pytest.mark.parametrize("kw", [
    dict(layer_types=["linear_attention", "full_attention"] * 2),      # another pattern
    dict(layer_types=["full_attention"] + ["linear_attention"] * 3),   # the full layer first
    dict(shared_expert_intermediate_size=24, tie_word_embeddings=True,
         rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.5}),
])
def test_other_qwen3_next_shapes_import_and_export_equal(tmp_path, in_float64, kw):
    random_qwen(tmp_path / "hf", **kw)
    ours, cfg, _ = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(in_float64, tmp_path / "hf")(x).logits,
                                   atol=1e-9, rtol=0)
    export(ours, cfg, CHARS, tmp_path / "out")
    assert load_hf_folder(tmp_path / "out")[1] == cfg


@pytest.mark.parametrize("kw,field", [
    (dict(linear_num_value_heads=8), "linear_num_value_heads=8"),
    (dict(linear_key_head_dim=8), "linear_key_head_dim=8"),
    (dict(head_dim=32), "head_dim=32"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    (dict(shared_expert_intermediate_size=36), "shared_expert_intermediate_size=36"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1875}),
     "partial_rotary_factor"),
])
def test_what_the_model_cannot_hold_is_refused_in_one_line_naming_the_field(tmp_path, kw, field):
    random_qwen(tmp_path / "hf", **kw)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path / "hf")
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change,reason", [
    (dict(delta_conv=0), "model.delta_conv=0"),
    (dict(position="rope", rope_dims=0), "model.position=rope (needs rope_partial)"),
    (dict(norm="rmsnorm", qk_norm_weight=False), "model.norm=rmsnorm (needs rmsnorm1p)"),
    (dict(moe_shared_gate=False), "model.moe_shared_gate=false"),
    (dict(moe_router="softmax_topk"), "model.moe_router=softmax_topk (needs softmax)"),
    (dict(mechanism="gated_deltanet,gated", delta_conv=4), "gated_deltanet_norm is Qwen3-Next's"),
    (dict(qk_norm_weight=False), "model.qk_norm=true (Qwen3-Next learns"),
])
def test_a_card_missing_one_piece_is_refused_naming_it(change, reason):
    with pytest.raises(ExportError) as err:
        architecture_for(replace(card(), **change), CHARS)
    assert reason in str(err.value) and "\n" not in str(err.value)


# -- the new fields off the default path ---------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    (dict(delta_conv=4), "model.delta_conv=4 sizes a delta-rule layer's short convolution"),
    (dict(rope_dims=8), "model.rope_dims=8 sets how much of each head RoPE turns"),
    (dict(moe_shared_gate=True), "model.moe_shared_gate=True sets up a mixture of experts"),
    (dict(position="rope_partial", rope_dims=5, n_head=8), "an even number from 2 to 8"),
    (dict(position="rope_partial", rope_scaling="linear", rope_factor=2.0), "use model.position=rope"),
    (dict(mlp="moe", moe_shared=0, moe_shared_gate=True), "model.moe_shared=0 builds none"),
    (dict(delta_conv=200, mechanism="kda"), "give at most 128"),
    # QK-norm is a hybrid's softmax layers'; with none such it would change nothing
    (dict(mechanism="gated_deltanet_norm", qk_norm=True), "does not scale its queries"),
])
def test_what_the_new_fields_need_is_said_in_one_line(fields, message):
    with pytest.raises(ModelError, match=message):
        GPT(ModelConfig(**{**dict(vocab_size=V, n_layer=1, n_head=4, n_embd=64, block_size=128),
                           **fields}))


def test_the_preset_is_qwen3_next_and_exports_as_it():
    from engine.cli import build
    m = build("qwen3-next", []).model
    m.vocab_size = V
    assert architecture_for(m, CHARS).hf_class == "Qwen3NextForCausalLM"
