"""Kimi Linear proven equal to transformers' own KimiLinear classes (model/kda.py with
model.delta_conv, model/latent_attention.py with model.mla_nope, model/moe.py's sigmoid
router with model.moe_routed_scale, engine/interop_kimi_linear.py): a KDA layer against
KimiLinearDeltaAttention with copied weights, then a tiny random KimiLinearForCausalLM
imported through the bridge, and our Kimi Linear exported back, with the same logits;
nothing downloaded. transformers runs its pure-PyTorch forms here (no fla kernels).

transformers computes its norms, the decay, the KDA rule and the router in float32 whatever
the model's dtype. The float64 comparisons run `in_float64`, a copy of
modeling_kimi_linear.py compiled with every float32 made float64 and nothing else changed;
the float32 ones run transformers untouched."""
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
from model.attention import Mask
from model.config import ModelError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
from transformers.models.kimi_linear import modeling_kimi_linear as theirs  # noqa: E402
from card_checks import agrees_untouched_in_float32, decodes_as_its_full_pass  # noqa: E402

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\n")
V = CHARS.vocab_size
LENGTH = 30
CASTS = (("torch.float32", "torch.float64"), (".float()", ".double()"))


@pytest.fixture(scope="module")
def in_float64():
    """modeling_kimi_linear.py with its float32 made float64: its formulas as written, at
    the precision the comparison needs."""
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


def kimi_config(**kw) -> "transformers.KimiLinearConfig":
    """Four layers, three KDA to one latent as Kimi Linear places them; experts in every
    layer, two shared; a routed scale other than 1, so a missing one shows."""
    base = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, moe_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                n_shared_experts=2, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
                linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                mlp_layer_types=["sparse"] * 4, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.KimiLinearConfig(**{**base, **kw})


def drawn(module: torch.nn.Module) -> torch.nn.Module:
    """Every weight drawn afresh (its experts and decay are made with torch.empty), the norms
    around 1, the correction bias off 0."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "A_log" in name else 0.1)
                    + (1.0 if "norm" in name else 0.0))
        for name, b in module.named_buffers():
            if "e_score" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    return module


def random_kimi(folder, **kw):
    torch.manual_seed(0)
    hf = drawn(transformers.KimiLinearForCausalLM(kimi_config(**kw)).eval())
    hf.save_pretrained(folder)
    hf_tokenizer(CHARS).save_pretrained(folder)
    return hf


def reference(module, folder, dtype=torch.float64):
    return module.KimiLinearForCausalLM.from_pretrained(
        folder, dtype=dtype, experts_implementation="eager").eval()


def batch(T: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))


def card(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(
        vocab_size=V, block_size=64, n_layer=4, n_head=4, n_embd=64, mechanism="kda,kda,kda,mla",
        delta_conv=4, mla_nope=True, mla_kv_rank=32, mla_rope_dim=8, position="none",
        norm="rmsnorm", norm_eps=1e-6, mlp="moe", moe_experts=4, moe_top_k=2, moe_shared=2,
        moe_hidden=24, moe_routed_scale=2.5, moe_bias_rate=0.0, tie_embeddings=False), **kw})


# -- one KDA layer, float64 --------------------------------------------------------------

def test_our_kda_layer_with_its_short_convolution_is_kimi_delta_attention(in_float64, tmp_path):
    """Our KimiDeltaAttention with model.delta_conv against KimiLinearDeltaAttention, the
    weights copied by the bridge: the convolution and SiLU on q, k and v, the L2 norms with
    the kernels' ε, q/√d_k, β without a bias, the decay per channel, the chunked rule and
    the gated norm."""
    random_kimi(tmp_path)
    hf = reference(in_float64, tmp_path).model.layers[0].self_attn
    ours, _, _ = load_hf_folder(tmp_path, dtype=torch.float64)
    layer = ours.blocks[0].attn
    x = torch.randn(2, 21, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = layer(x, ours.positions, Mask(q_start=0, q_len=21, k_pos=torch.arange(21)))
        torch.testing.assert_close(out, hf(x), atol=1e-12, rtol=0)


# -- the whole model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi_linear")
    random_kimi(folder)
    return folder


def test_the_bridge_reads_kimi_linear_as_its_card(hf_folder):
    _, cfg, tokenizer = load_hf_folder(hf_folder)
    assert cfg == card()
    assert tokenizer.encode("to be, or") == CHARS.encode("to be, or")


def test_a_kimi_linear_folder_imports_with_equal_logits_in_float64(hf_folder, in_float64):
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(in_float64, hf_folder)(x).logits,
                                   atol=1e-9, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_our_kimi_linear_exports_to_a_folder_transformers_loads_with_equal_logits(
        tmp_path, in_float64, tied):
    # KimiLinearForCausalLM builds its own lm_head whatever tie_word_embeddings says: a tied
    # model (the preset's) is written with the matrix in both places, untied.
    cfg = card(tie_embeddings=tied)
    torch.manual_seed(1)
    ours = drawn(GPT(cfg)).double().eval()      # our own weights, every one off its init
    assert export(ours, cfg, CHARS, tmp_path / "out").hf_class == "KimiLinearForCausalLM"
    hf, info = in_float64.KimiLinearForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64, experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    x = batch()
    with torch.no_grad():            # the export is float32: our model rounded to it
        rounded = ours.float().double()
        torch.testing.assert_close(hf.eval()(x).logits, rounded(x).logits, atol=1e-9, rtol=0)
    assert load_hf_folder(tmp_path / "out")[1] == replace(cfg, tie_embeddings=False)
    # What `python -m attnlab.export` says of a tied model here: transformers counts the
    # shared matrix twice, once more than our count does.
    from attnlab.export import written_tied
    assert written_tied(tmp_path / "out") is False
    extra = ours.wte.weight.numel() if tied else 0
    assert sum(p.numel() for p in hf.parameters()) == ours.num_params() + extra


def test_untouched_transformers_agrees_in_float32(hf_folder, tmp_path):
    agrees_untouched_in_float32(hf_folder, tmp_path / "out", batch(), "KimiLinearForCausalLM")


def test_the_imported_model_decodes_from_its_cache_as_its_full_pass(hf_folder):
    decodes_as_its_full_pass(hf_folder, batch())


@pytest.mark.parametrize("kw,field", [
    (dict(mlp_layer_types=["dense"] + ["sparse"] * 3), "mlp_layer_types="),
    (dict(q_lora_rank=16), "q_lora_rank=16"),
    (dict(v_head_dim=8), "v_head_dim=8"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
    (dict(n_group=2, topk_group=1), "topk_group=1"),
])
def test_what_the_model_cannot_hold_is_refused_in_one_line_naming_the_field(tmp_path, kw, field):
    random_kimi(tmp_path / "hf", **kw)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path / "hf")
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change,reason", [
    (dict(delta_conv=0), "model.delta_conv=0"),
    (dict(mla_nope=False), "model.mla_nope=false"),
    (dict(norm_eps=1e-5), "model.norm_eps=1e-05"),
    (dict(moe_router="softmax"), "model.moe_router=softmax (needs sigmoid)"),
    (dict(moe_groups=2, moe_group_top=1), "model.moe_groups=2 (Kimi Linear's router picks among"),
    (dict(moe_dense_layers=1, mlp_hidden=64), "model.moe_dense_layers=1 (every Kimi Linear layer"),
    (dict(mla_q_rank=16), "model.mla_q_rank=16 (Kimi Linear's latent layers project"),
])
def test_a_card_missing_one_piece_is_refused_naming_it(change, reason):
    with pytest.raises(ExportError) as err:
        architecture_for(replace(card(), **change), CHARS)
    assert reason in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields,message", [
    (dict(mla_nope=True), "model.mla_nope=True takes the positions out of latent attention"),
    (dict(moe_routed_scale=2.0), "model.moe_routed_scale=2.0 sets up a mixture of experts"),
    (dict(mlp="moe", moe_routed_scale=0.0), "must be positive"),
])
def test_what_the_new_fields_need_is_said_in_one_line(fields, message):
    with pytest.raises(ModelError, match=message):
        GPT(ModelConfig(**{**dict(vocab_size=V, n_layer=1, n_head=4, n_embd=64, block_size=64),
                           **fields}))


def test_the_preset_is_kimi_linear_and_exports_as_it():
    from engine.cli import build
    m = build("kimi-linear", []).model
    m.vocab_size = V
    assert architecture_for(m, CHARS).hf_class == "KimiLinearForCausalLM"
