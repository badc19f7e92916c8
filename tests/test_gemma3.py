"""Gemma 3's text model, piece by piece and whole, against transformers' own Gemma 3
classes (transformers' modeling_gemma3.py is the independent reference): the (1+w)
RMSNorm, the GeGLU MLP, the scaled embedding, and a tiny random Gemma3ForCausalLM
imported through engine/interop_gemma3.py with the same logits on a batch longer than
its window, exported back with the same logits, and decoded from its cache as its full
pass computes. Nothing is downloaded: every folder is written here by save_pretrained.

transformers computes Gemma 3's norms and RoPE angles in float32 whatever the model's
dtype (`x.float()` in Gemma3RMSNorm, `.float()` in Gemma3RotaryEmbedding), so a float64
Gemma3ForCausalLM is float32 there. The float64 comparisons run its own formulas at the
input's precision (`reference_in_float64`); the float32 ones run it untouched."""
import json
import warnings

import pytest
import torch

from data.tokenizer import CharTokenizer
from engine.interop import ExportError, architecture_for, export, hf_tokenizer, load_hf_folder
from model import GPT, ModelConfig
from model.config import ModelError
from model.layers import MLPS, NORMS

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
from transformers.models.gemma3 import modeling_gemma3 as theirs  # noqa: E402

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\n")
V = CHARS.vocab_size
WINDOW = 8
LENGTH = 30                       # past the window, so windowed and full layers differ


def gemma_config(**kw) -> "transformers.Gemma3TextConfig":
    """Six layers, five windowed to one full as Gemma 3 places them; GQA; a head size and
    a query_pre_attn_scalar that differ, so 1/√d_k would be the wrong scale; a RoPE base
    per layer kind."""
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, sliding_window=WINDOW, query_pre_attn_scalar=24,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.Gemma3TextConfig(**{**base, **kw})


@pytest.fixture
def reference_in_float64(monkeypatch):
    """transformers' Gemma3RMSNorm and Gemma3RotaryEmbedding, their formulas unchanged,
    computed at the input's precision instead of float32."""
    def norm(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return (self._norm(h) * (1.0 + self.weight.to(h.dtype))).type_as(x)

    def rope(self, x, position_ids, layer_type):
        base = self.config.rope_parameters[layer_type]["rope_theta"]
        dim = self.config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    monkeypatch.setattr(theirs.Gemma3RMSNorm, "forward", norm)
    monkeypatch.setattr(theirs.Gemma3RotaryEmbedding, "forward", rope)


def random_gemma(folder, **kw):
    """A Gemma3ForCausalLM with every weight drawn away from its init (the (1+w) norms start
    at w = 0, where a missing 1 or a swapped norm would not show), saved to `folder`."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(gemma_config(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    hf_tokenizer(CHARS).save_pretrained(folder)
    return hf


def batch(T: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))


# -- the pieces ------------------------------------------------------------------------

def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=V, n_layer=1, n_head=4, n_embd=64, block_size=32,
                                 norm_eps=1e-6), **kw})


def test_the_offset_rmsnorm_is_gemmas_and_the_formula_in_float64():
    torch.manual_seed(0)
    ours = NORMS["rmsnorm1p"](tiny())
    assert torch.equal(ours.weight, torch.zeros(64))          # (1 + 0): the identity gain
    ref = theirs.Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(2, 5, 64) * 3
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)   # float32: Gemma's own ops
    x64 = x.double()
    w = ours.weight.double()
    expected = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + w)
    torch.testing.assert_close(ours.double()(x64), expected, atol=1e-12, rtol=0)
    bf16 = x.bfloat16()                   # computed in float32 and rounded once, as Gemma does
    torch.testing.assert_close(ours(bf16), ref(bf16), atol=0, rtol=0)


def test_geglu_is_gemmas_mlp_in_float64():
    torch.manual_seed(0)
    cfg = tiny(mlp="geglu", mlp_hidden=96)
    ours = MLPS["geglu"](cfg).double()
    ref = theirs.Gemma3MLP(gemma_config()).double()
    with torch.no_grad():
        gate, up = ours.fc.weight.split(96)
        ref.gate_proj.weight.copy_(gate)
        ref.up_proj.weight.copy_(up)
        ref.down_proj.weight.copy_(ours.proj.weight)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-12, rtol=0)


def test_the_embedding_scale_is_gemmas():
    torch.manual_seed(0)
    model = GPT(tiny(embed_scale=True)).double()
    ref = theirs.Gemma3TextScaledWordEmbedding(V, 64, 0, embed_scale=64 ** 0.5).double()
    with torch.no_grad():
        ref.weight.copy_(model.wte.weight)
    ids = batch(6)
    captured = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    model(ids)
    torch.testing.assert_close(captured[0], ref(ids), atol=1e-12, rtol=0)


@pytest.mark.parametrize("fields,message", [
    (dict(qk_norm_weight=True), "set model.qk_norm=true"),
    (dict(score_scale=0.2), "set model.qk_norm=true"),
    (dict(score_scale=-1.0), "must not be negative"),
    (dict(qk_norm=True, qk_norm_weight=True, mechanism="differential"), "its own way"),
    (dict(rope_local_theta=1e4, sliding_window=4), "set model.full_attention_every"),
    (dict(rope_local_theta=1e4, sliding_window=4, full_attention_every=2, n_layer=2,
          position="alibi"), "set model.position=rope"),
])
def test_what_the_new_fields_need_is_said_in_one_line(fields, message):
    with pytest.raises(ModelError, match=message):
        GPT(tiny(**fields))


def test_streaming_refuses_two_rope_bases_in_one_line():
    """A streaming cache renumbers its keys by turning them with the model's one RoPE; the
    windowed layers' keys were turned by another base."""
    from model.decode import check_sinks
    cfg = tiny(n_layer=2, sliding_window=4, full_attention_every=2, rope_local_theta=1e4)
    check_sinks(tiny(n_layer=2, sliding_window=4, full_attention_every=2), "cache", 4)
    with pytest.raises(ModelError, match="sample without sinks"):
        check_sinks(cfg, "cache", 4)


# -- the whole model -------------------------------------------------------------------

def test_a_gemma3_folder_imports_with_equal_logits_in_float64(tmp_path, reference_in_float64):
    hf = random_gemma(tmp_path / "hf").double()
    ours, cfg, tokenizer = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    assert (cfg.block, cfg.norm, cfg.mlp, cfg.full_attention_every, cfg.sliding_window,
            cfg.rope_theta, cfg.rope_local_theta, cfg.kv_heads) == (
        "sandwich", "rmsnorm1p", "geglu", 6, WINDOW, 1e6, 1e4, 2)
    assert cfg.score_scale == 24 ** -0.5 and cfg.embed_scale and cfg.qk_norm_weight
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-9, rtol=0)
    assert tokenizer.encode("to be, or") == CHARS.encode("to be, or")


def test_every_layer_hands_on_what_gemma3s_decoder_layer_does_in_float64(
        tmp_path, reference_in_float64):
    """Layer by layer (five windowed, then the full one): the stream after each of our
    blocks against transformers' hidden states after each Gemma3DecoderLayer."""
    hf = random_gemma(tmp_path / "hf").double()
    ours, _, _ = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    x = batch()
    streams = []
    hooks = [b.register_forward_hook(lambda m, a, out: streams.append(out[0])) for b in ours.blocks]
    with torch.no_grad():
        final = ours(x).hidden
        expected = hf(x, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    # The embeddings, each layer's output, and the last one through the final norm.
    assert len(expected) == len(streams) + 1
    for i, (mine, theirs_) in enumerate(zip(streams[:-1] + [final], expected[1:])):
        torch.testing.assert_close(mine, theirs_, atol=1e-9, rtol=0, msg=f"layer {i}")


def test_an_exported_gemma3_loads_in_transformers_with_equal_logits_in_float64(
        tmp_path, reference_in_float64):
    random_gemma(tmp_path / "hf")
    ours, cfg, tokenizer = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    with torch.no_grad():            # our own weights, not the ones just read
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert export(ours, cfg, tokenizer, tmp_path / "out").hf_class == "Gemma3ForCausalLM"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, dtype=torch.float64)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = batch()
    with torch.no_grad():
        # The export writes float32: our model rounded to it is what the folder holds.
        rounded = ours.float().double()
        torch.testing.assert_close(hf.eval()(x).logits, rounded(x).logits, atol=1e-9, rtol=0)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    again, cfg_again, _ = load_hf_folder(tmp_path / "out")
    assert cfg_again == cfg


def test_untouched_transformers_agrees_in_float32(tmp_path):
    """No patch at all: transformers' Gemma 3 as it runs, and ours, in float32."""
    hf = random_gemma(tmp_path / "hf")
    ours, cfg, tokenizer = load_hf_folder(tmp_path / "hf")
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=2e-5, rtol=0)
    export(ours, cfg, tokenizer, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x).logits, atol=2e-5, rtol=0)


def test_the_imported_model_decodes_from_its_cache_as_its_full_pass(tmp_path):
    random_gemma(tmp_path / "hf")
    ours, _, _ = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        full = ours(x).logits
        cache = ours.new_cache(LENGTH)
        steps = [ours(x[:, :5], cache=cache).logits]
        steps += [ours(x[:, t:t + 1], cache=cache).logits for t in range(5, LENGTH)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kw", [dict(num_hidden_layers=2),                 # every layer windowed
                                dict(final_logit_softcapping=30.0, tie_word_embeddings=False),
                                dict(query_pre_attn_scalar=16)])            # 1/√d_k itself
def test_other_gemma3_shapes_import_equal(tmp_path, reference_in_float64, kw):
    hf = random_gemma(tmp_path / "hf", **kw).double()
    ours, cfg, _ = load_hf_folder(tmp_path / "hf", dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-9, rtol=0)
    export(ours, cfg, CHARS, tmp_path / "out")
    assert load_hf_folder(tmp_path / "out")[1] == cfg


@pytest.mark.parametrize("kw,field", [
    (dict(head_dim=32), "head_dim=32"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 3), "layer_types="),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                              "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope scaling 'linear'"),
])
def test_what_the_model_cannot_hold_is_refused_in_one_line_naming_the_field(tmp_path, kw, field):
    from common.errors import CheckpointError
    random_gemma(tmp_path / "hf", **kw)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path / "hf")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_a_config_json_with_too_few_layer_types_is_refused_by_their_count(tmp_path):
    """An edited file (transformers refuses to write one): the count, not the pattern."""
    import json
    from common.errors import CheckpointError
    random_gemma(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["layer_types"] = config["layer_types"][:3]
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layer_types lists 3 layers, num_hidden_layers is "
                                              "6: give one type a layer"):
        load_hf_folder(tmp_path / "hf")


def test_the_preset_is_gemma3_and_exports_as_it():
    from engine.cli import build
    m = build("gemma3", []).model
    assert (m.block, m.norm, m.mlp, m.qk_norm, m.qk_norm_weight, m.embed_scale) == (
        "sandwich", "rmsnorm1p", "geglu", True, True, True)
    assert m.full_attention_every == 6 and m.n_layer % 6 == 0 and 0 < m.sliding_window < m.block_size
    assert m.rope_local_theta and m.rope_local_theta != m.rope_theta
    m.vocab_size = V
    assert architecture_for(m, CHARS).hf_class == "Gemma3ForCausalLM"
    with pytest.raises(ExportError, match="nearest is"):          # one piece gone: no card
        from dataclasses import replace
        architecture_for(replace(m, embed_scale=False), CHARS)
