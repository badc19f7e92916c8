"""Transformers folders written by someone else (engine/hf_files.py, engine/interop.py):
crafted folders of every kind of damage, each of which must end as one of the
project's errors naming the file, before the model is built and without a traceback;
and the folders that are fine must still load.

The folders are written here by hand (config.json, model.safetensors, tokenizer.json),
so each case is milliseconds; test_interop.py checks real folders from transformers."""
import atexit
import json
import os
import resource
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import CheckpointError
from conftest import wordpiece_tokenizer

import engine.interop as interop
from common.errors import AttnlabError
from data.tokenizer import CharTokenizer
from engine.cli import errors_as_lines
from engine.interop import ARCHITECTURES, load_hf_folder

# The decoder layouts, which share one reader; the BERT family has its own reader and its
# hostile cases in tests/test_interop_bert.py.
DECODERS = [name for name, a in ARCHITECTURES.items() if a.load is None]
from model import GPT, ModelConfig

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\n")
VARIANTS = {
    "gpt2": dict(position="learned", norm="layernorm", mlp="gelu_tanh", bias=True),
    "llama": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=1),
    "mistral": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=1, sliding_window=8),
    "gpt_neox": dict(),
    "gpt_oss": dict(mechanism="sinks", sliding_window=4, full_attention_every=2, norm="rmsnorm",
                    mlp="moe", moe_experts=4, moe_top_k=2, moe_shared=0, moe_router="softmax_topk",
                    moe_expert="gpt_oss", moe_bias_rate=0.0, bias=True, tie_embeddings=False,
                    n_kv_head=1),
    "gemma3_text": dict(n_kv_head=1, sliding_window=4, full_attention_every=2, rope_theta=1e6,
                        rope_local_theta=1e4, block="sandwich", norm="rmsnorm1p", norm_eps=1e-6,
                        mlp="geglu", qk_norm=True, qk_norm_weight=True, embed_scale=True),
    "deepseek_v3": dict(mechanism="mla", norm="rmsnorm", norm_eps=1e-6, mlp="moe", moe_experts=4,
                        moe_top_k=2, moe_shared=1, moe_dense_layers=1, mlp_hidden=32,
                        tie_embeddings=False),
    # Every key chosen: float16 weights must not flip the indexer's choice in the check below.
    "deepseek_v32": dict(mechanism="mla_sparse", mla_q_rank=8, sparse_top_k=16, indexer_heads=2,
                         norm="rmsnorm", norm_eps=1e-6, mlp="moe", moe_experts=4, moe_top_k=2,
                         moe_shared=1, tie_embeddings=False),
    "qwen3_next": dict(mechanism="gated_deltanet_norm,gated", delta_conv=4, position="rope_partial",
                       norm="rmsnorm1p", qk_norm=True, qk_norm_weight=True, mlp="moe",
                       moe_experts=4, moe_top_k=2, moe_shared=1, moe_router="softmax",
                       moe_shared_gate=True, moe_bias_rate=0.0, tie_embeddings=False),
    "kimi_linear": dict(mechanism="kda,mla", delta_conv=4, mla_nope=True, position="none",
                        norm="rmsnorm", norm_eps=1e-6, mlp="moe", moe_experts=4, moe_top_k=2,
                        moe_shared=1, tie_embeddings=False),
}


def tokenizer_json(tok=CHARS) -> str:
    """The tokenizer as python -m attnlab.export writes it (transformers' own format)."""
    return interop.hf_tokenizer(tok).backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def tok_json():
    return tokenizer_json()


_TEMPLATES = {}


def write_folder(folder, arch="gpt2", tok_json=None):
    """A small valid folder of `arch` (copied from one written once per architecture);
    returns the model it holds."""
    if arch not in _TEMPLATES:
        template = Path(tempfile.mkdtemp(prefix=f"hostile-{arch}-"))
        atexit.register(shutil.rmtree, template, True)
        _TEMPLATES[arch] = (template, _write_folder(template, arch, tok_json))
    template, model = _TEMPLATES[arch]
    shutil.copytree(template, folder, dirs_exist_ok=True)
    return model


def _write_folder(folder, arch, tok_json=None, **fields):
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=16,
                      **{**VARIANTS[arch], **fields})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    a = ARCHITECTURES[arch]
    folder.mkdir(parents=True, exist_ok=True)
    weights = a.to_hf_weights({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    save_file({k: v.contiguous().clone() for k, v in weights.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": arch, **a.to_hf_config(cfg)}))
    (folder / "tokenizer.json").write_text(tok_json or tokenizer_json())
    return model


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, change):
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")


def shard(folder, names=None):
    """Split model.safetensors into two shards with an index; `names` overrides the
    index's file names for the two shards (what a crafted index would say)."""
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for i, (file, part) in enumerate(parts.items()):
        save_file({k: weights[k] for k in part}, folder / file)
        weight_map.update({k: (names[i] if names else file) for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def refused(folder, match=None):
    """The project's error, naming a file of the folder, and nothing else."""
    with pytest.raises(AttnlabError) as caught:
        load_hf_folder(folder)
    message = str(caught.value)
    assert str(folder) in message, message
    if match:
        assert match in message, message
    return message


# -- config.json: every value a reader uses, of the wrong type ------------------------

# The values each reader takes from config.json, written down here independently of
# the schemas in engine/interop.py: name -> kind ("rope", "scaling": the RoPE objects).
READ = {
    "gpt2": {"vocab_size": int, "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int,
             "n_inner": int, "activation_function": str, "layer_norm_epsilon": float,
             "tie_word_embeddings": bool, "scale_attn_weights": bool},
    "llama": {"vocab_size": int, "hidden_size": int, "num_hidden_layers": int,
              "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
              "intermediate_size": int, "hidden_act": str, "max_position_embeddings": int,
              "rms_norm_eps": float, "rope_parameters": "rope", "tie_word_embeddings": bool,
              "attention_bias": bool, "mlp_bias": bool, "rope_scaling": "scaling"},
    "mistral": {"vocab_size": int, "hidden_size": int, "num_hidden_layers": int,
                "num_attention_heads": int, "sliding_window": int, "rms_norm_eps": float,
                "rope_parameters": "rope", "max_position_embeddings": int},
    "gpt_neox": {"vocab_size": int, "hidden_size": int, "num_hidden_layers": int,
                 "num_attention_heads": int, "intermediate_size": int, "hidden_act": str,
                 "max_position_embeddings": int, "layer_norm_eps": float,
                 "use_parallel_residual": bool, "attention_bias": bool, "tie_word_embeddings": bool,
                 "rope_parameters": "rope", "rotary_pct": float, "rotary_emb_base": float},
}
WRONG = {int: ["16", 16.5, True, [16], {"n": 16}, float("nan")],
         float: ["1e-5", True, [1e-5], {"e": 1}, float("nan"), float("inf")],
         bool: ["true", 1, [True], {"b": True}],
         str: [7, ["gelu"], {"a": "gelu"}, True],
         "rope": ["default", [1], 7, True, {"rope_theta": "1e4"}, {"rope_type": 7},
                  {"rope_theta": float("nan")}, {"partial_rotary_factor": "1"}],
         "scaling": ["yarn", [1], 7, {"rope_type": 7}, {"type": ["linear"]}]}
TYPE_CASES = [(arch, key, bad) for arch, keys in READ.items() for key, kind in keys.items()
              for bad in WRONG[kind]]


@pytest.mark.parametrize("arch,key,bad", TYPE_CASES,
                         ids=[f"{a}-{k}={b!r}"[:60] for a, k, b in TYPE_CASES])
def test_a_config_value_of_the_wrong_type_is_refused_naming_config_json(arch, key, bad, tmp_path,
                                                                        tok_json):
    write_folder(tmp_path, arch, tok_json)
    edit_config(tmp_path, **{key: bad})
    assert "config.json" in refused(tmp_path)


# -- config.json: values out of range, sizes, the file itself --------------------------

def _link(target):
    def make(folder):
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(target)
    return make


def _fifo(folder):
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")


def _sparse(name, size):
    def make(folder):
        with open(folder / name, "wb") as f:
            f.truncate(size)                      # sparse: no disk, no memory
    return make


CONFIG_CASES = {
    "config: n_head=0": lambda f: edit_config(f, n_head=0),
    "config: n_head=-1": lambda f: edit_config(f, n_head=-1),
    "config: n_embd=10^12": lambda f: edit_config(f, n_embd=10**12),
    "config: vocab=10^12": lambda f: edit_config(f, vocab_size=10**12),
    "config: positions=10^12": lambda f: edit_config(f, n_positions=10**12),
    "config: n_layer=10^6": lambda f: edit_config(f, n_layer=10**6),
    "config: a 10^13-parameter model within every cap": lambda f: edit_config(
        f, n_layer=1024, n_embd=65536, n_head=512, n_inner=4 * 65536),
    "config: n_embd not divisible by n_head": lambda f: edit_config(f, n_head=3),
    "config: a huge integer": lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"n_layer": 2', '"n_layer": ' + "9" * 5000)),
    "config: model_type missing": lambda f: edit_config(f, model_type=None),
    "config: model_type a list": lambda f: edit_config(f, model_type=["gpt2"]),
    "config: model_type bert": lambda f: edit_config(f, model_type="bert"),
    "config: activation not computed": lambda f: edit_config(f, activation_function="relu"),
    "config: missing": lambda f: (f / "config.json").unlink(),
    "config: empty": lambda f: (f / "config.json").write_text(""),
    "config: a list": lambda f: (f / "config.json").write_text("[1, 2]"),
    "config: not JSON": lambda f: (f / "config.json").write_text("{model_type: gpt2"),
    "config: not UTF-8": lambda f: (f / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}'),
    "config: nested 10^5 deep in lists": lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000),
    "config: nested 10^5 deep in objects": lambda f: (f / "config.json").write_text(
        '{"a":' * 100_000 + "1" + "}" * 100_000),
    "config: linked to /dev/zero": _link("/dev/zero"),
    "config: linked to /dev/urandom": _link("/dev/urandom"),
    "config: a pipe": _fifo,
    "config: a folder": lambda f: ((f / "config.json").unlink(), (f / "config.json").mkdir()),
    "config: a sparse 5 GB file": _sparse("config.json", 5 << 30),
}

CONFIG_MATCH = {"config: a 10^13-parameter model within every cap": "too large for this machine",
                "config: linked to /dev/zero": "config.json leads outside",
                "config: a pipe": "config.json is a named pipe, not a plain file",
                "config: a sparse 5 GB file": "more than the 4,194,304 it may be",
                "config: n_head=0": "n_head=0 is outside 1..4,096"}


def builds(monkeypatch) -> list:
    """The default device of every model built from now on (GPT.skeleton's are "meta")."""
    built, real = [], GPT.__init__

    def init(self, cfg):
        built.append(torch.get_default_device())
        real(self, cfg)
    monkeypatch.setattr(GPT, "__init__", init)
    return built


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_broken_or_hostile_config_is_refused_before_the_model_is_built(case, tmp_path, tok_json,
                                                                          monkeypatch):
    write_folder(tmp_path, "gpt2", tok_json)
    CONFIG_CASES[case](tmp_path)
    built = builds(monkeypatch)
    message = refused(tmp_path, CONFIG_MATCH.get(case))
    assert all(d.type == "meta" for d in built), "a model was built before the refusal"
    if "10^13" in case:                       # the file named once, not "X: X describes"
        assert message.count(str(tmp_path / "config.json")) == 1, message


def test_a_large_vocabulary_in_a_small_folder_is_refused_from_the_headers(tmp_path, tok_json,
                                                                          monkeypatch):
    """vocab_size=3,000,000 is within every cap and fits in memory, but the folder holds
    a 30-row embedding: the safetensors headers say so before a byte is allocated."""
    write_folder(tmp_path, "gpt_neox", tok_json)
    edit_config(tmp_path, vocab_size=3_000_000)
    built = builds(monkeypatch)
    refused(tmp_path, "shape differs: gpt_neox.embed_in.weight [30, 16] where "
                                "config.json gives [3000000, 16]")
    assert all(d.type == "meta" for d in built)


# -- the shards and the index ----------------------------------------------------------

def _outside_copy(folder):
    """The folder's own weights, copied next to (outside) the folder."""
    outside = folder.parent / "elsewhere" / "model.safetensors"
    outside.parent.mkdir(exist_ok=True)
    shutil.copy(folder / "model.safetensors", outside)
    return outside


def _link_weights_outside(folder):
    outside = _outside_copy(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)


def _index_names(*names):
    def make(folder):
        shard(folder, list(names))
    return make


def _link_shard_outside(folder):
    shard(folder)
    outside = folder.parent / "elsewhere"
    outside.mkdir(exist_ok=True)
    moved = outside / "model-00001-of-00002.safetensors"
    shutil.move(folder / moved.name, moved)
    (folder / moved.name).symlink_to(moved)


def _index(text):
    def make(folder):
        shard(folder)
        (folder / "model.safetensors.index.json").write_text(text)
    return make


def _wrong_shard_in_index(folder):
    shard(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _unlisted_tensor(folder):
    shard(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][sorted(index["weight_map"])[0]]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


SHARD_CASES = {
    "weights linked from outside": _link_weights_outside,
    "a shard linked from outside": _link_shard_outside,
    "index: ../../ path": _index_names("../../gpt2/model.safetensors", "model-00002-of-00002.safetensors"),
    "index: absolute path": _index_names("/etc/passwd", "model-00002-of-00002.safetensors"),
    "index: a shard that is missing": _index_names("model-00009.safetensors", "model-00002-of-00002.safetensors"),
    "index: a shard that is a folder": _index_names(".", "model-00002-of-00002.safetensors"),
    "index: empty object": _index("{}"),
    "index: empty weight_map": _index('{"weight_map": {}}'),
    "index: weight_map a list": _index('{"weight_map": ["a.safetensors"]}'),
    "index: a file name that is a number": _index('{"weight_map": {"transformer.wte.weight": 5}}'),
    "index: malformed": _index('{"weight_map": {'),
    "index: nested 10^5 deep": _index("[" * 100_000),
    "index: linked to /dev/zero": lambda f: (shard(f), (f / "model.safetensors.index.json").unlink(),
                                             (f / "model.safetensors.index.json").symlink_to("/dev/zero")),
    "index: a tensor in the other shard": _wrong_shard_in_index,
    "index: a tensor it does not list": _unlisted_tensor,
    "weights: not safetensors": lambda f: (f / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}"),
    "weights: empty file": lambda f: (f / "model.safetensors").write_bytes(b""),
    "weights: none at all": lambda f: (f / "model.safetensors").unlink(),
}


@pytest.mark.parametrize("case", SHARD_CASES)
def test_shards_outside_the_folder_and_broken_indexes_are_refused(case, tmp_path, tok_json):
    folder = tmp_path / "hub" / "model"
    write_folder(folder, "gpt2", tok_json)
    SHARD_CASES[case](folder)
    refused(folder)


def test_a_refused_path_outside_says_nothing_about_whether_it_exists(tmp_path, tok_json):
    """The message for a file that exists outside and for one that does not differ only
    in the name the index gives."""
    messages = []
    for name in ("../../../etc/passwd", "../../../etc/no-such-file"):
        folder = tmp_path / name.rsplit("/", 1)[1] / "a" / "model"
        write_folder(folder, "gpt2", tok_json)
        shard(folder, [name, "model-00002-of-00002.safetensors"])
        messages.append(refused(folder).replace(str(folder), "F").replace(name, "NAME"))
    assert messages[0] == messages[1] and "not a file inside" in messages[0]
    link_messages = []
    for target in (tmp_path / "exists.safetensors", tmp_path / "missing.safetensors"):
        folder = tmp_path / target.stem / "model"
        write_folder(folder, "gpt2", tok_json)
        shutil.copy(folder / "model.safetensors", tmp_path / "exists.safetensors")
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(target)
        link_messages.append(refused(folder).replace(str(folder), "F"))
    assert link_messages[0] == link_messages[1]


# -- the tensors -------------------------------------------------------------------------

def _drop(name):
    return lambda f: edit_weights(f, lambda w: w.pop(name))


def _add(name, shape=(16,), dtype=torch.float32):
    return lambda f: edit_weights(f, lambda w: w.update({name: torch.zeros(shape, dtype=dtype)}))


def _cast(name, dtype):
    return lambda f: edit_weights(f, lambda w: w.update({name: w[name].to(dtype)}))


def _reshape(name, shape):
    return lambda f: edit_weights(f, lambda w: w.update({name: torch.zeros(shape)}))


QKV = "transformer.h.0.attn.c_attn.weight"
TENSOR_CASES = {
    "a tensor missing": (_drop("transformer.h.1.mlp.c_fc.bias"), "missing transformer.h.1.mlp.c_fc.bias"),
    "an extra tensor": (_add("transformer.h.0.attn.extra"), "unexpected transformer.h.0.attn.extra"),
    "n_layer=1 over two layers": (lambda f: edit_config(f, n_layer=1), "the files have 2 layers, config.json says 1"),
    "a shape that differs": (_reshape(QKV, (16, 47)), f"shape differs: {QKV} [16, 47]"),
    "int32 weights": (_cast(QKV, torch.int32), f"{QKV} (I32)"),
    "bool weights": (_cast(QKV, torch.bool), f"{QKV} (BOOL)"),
    "fp8 weights": (_cast(QKV, torch.float8_e4m3fn), f"{QKV} (F8_E4M3)"),
    "an output layer that is not the tied embedding": (
        _add("lm_head.weight", (30, 16)), "differs from the token embedding"),
    "NaN weights": (lambda f: edit_weights(f, lambda w: w[QKV].fill_(float("nan"))), "NaN"),
}


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_missing_extra_misshapen_and_non_float_tensors_are_refused_by_name(case, tmp_path, tok_json):
    write_folder(tmp_path, "gpt2", tok_json)
    make, match = TENSOR_CASES[case]
    make(tmp_path)
    refused(tmp_path, match)


@pytest.mark.parametrize("arch", DECODERS)
def test_a_qkv_matrix_of_the_wrong_size_is_refused_in_every_architecture(arch, tmp_path, tok_json):
    """(NeoX reshapes its fused matrix per head: a wrong size used to fail inside torch.)"""
    write_folder(tmp_path, arch, tok_json)
    names = sorted(load_file(tmp_path / "model.safetensors"))
    qkv = next(n for n in names if n.endswith(("c_attn.weight", "query_key_value.weight", "q_proj.weight",
                                                "q_b_proj.weight")))
    edit_weights(tmp_path, lambda w: w.update({qkv: torch.zeros(w[qkv].shape[0] + 1, w[qkv].shape[1])}))
    refused(tmp_path, f"shape differs: {qkv}")


# -- tokenizer.json ----------------------------------------------------------------------

def _tokenizer(text):
    return lambda f: (f / "tokenizer.json").write_text(text)


TOKENIZER_CASES = {
    "tokenizer: missing": lambda f: (f / "tokenizer.json").unlink(),
    "tokenizer: not JSON": _tokenizer("{"),
    "tokenizer: nested 10^5 deep": _tokenizer("[" * 100_000),
    "tokenizer: linked to /dev/zero": lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").symlink_to("/dev/zero")),
    "tokenizer: a sparse 1 GB file": _sparse("tokenizer.json", 1 << 30),
    "tokenizer: chars not a list": _tokenizer('{"type": "char", "chars": 5}'),
    "tokenizer: chars of several letters": _tokenizer('{"type": "char", "chars": ["ab", "c"]}'),
    "tokenizer: chars empty": _tokenizer('{"type": "char", "chars": []}'),
    "tokenizer: a model of the wrong shape": _tokenizer('{"model": {"type": "BPE", "vocab": 5}}'),
    "tokenizer: larger than vocab_size": _tokenizer(tokenizer_json(CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\nABCDEFGHIJ"))),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_a_bad_tokenizer_is_refused_naming_tokenizer_json(case, tmp_path, tok_json):
    write_folder(tmp_path, "gpt2", tok_json)
    TOKENIZER_CASES[case](tmp_path)
    assert "tokenizer.json" in refused(tmp_path)


# -- what must still load ---------------------------------------------------------------

# Buffers transformers skips when it loads these (older versions saved them), and the
# output layer's name in each architecture's files.
BUFFERS = {"gpt2": "transformer.h.0.attn.bias", "llama": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "mistral": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "gpt_neox": "gpt_neox.layers.0.attention.bias",
           "gpt_oss": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "gemma3_text": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "deepseek_v3": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "deepseek_v32": "model.layers.0.self_attn.rotary_emb.inv_freq",
           "qwen3_next": "model.layers.1.self_attn.rotary_emb.inv_freq",
           "kimi_linear": "model.layers.1.self_attn.rotary_emb.inv_freq"}
HEAD = {"gpt2": "lm_head.weight", "llama": "lm_head.weight", "mistral": "lm_head.weight",
        "gpt_neox": "embed_out.weight", "gpt_oss": "lm_head.weight", "gemma3_text": "lm_head.weight",
        "deepseek_v3": "lm_head.weight", "deepseek_v32": "lm_head.weight",
        "qwen3_next": "lm_head.weight", "kimi_linear": "lm_head.weight"}

@pytest.mark.parametrize("arch", DECODERS)
def test_a_sound_folder_loads_with_its_logits_in_every_form(arch, tmp_path, tok_json):
    """One file; shards; float16 weights; a tied output layer stored anyway; transformers'
    buffers it skips too; and a Hub cache snapshot whose files link into its blobs."""
    model = write_folder(tmp_path / "one", arch, tok_json)
    x = torch.randint(0, CHARS.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x).logits

    def logits(folder, atol=1e-6):
        ours, cfg, tok = load_hf_folder(folder)
        assert tok.kind == "char" and tok.encode("hello") == CHARS.encode("hello")
        with torch.no_grad():
            torch.testing.assert_close(ours(x).logits, want, atol=atol, rtol=0)

    logits(tmp_path / "one")
    shutil.copytree(tmp_path / "one", tmp_path / "sharded")
    shard(tmp_path / "sharded")
    logits(tmp_path / "sharded")
    shutil.copytree(tmp_path / "one", tmp_path / "half")
    edit_weights(tmp_path / "half", lambda w: w.update({k: v.half() for k, v in w.items()}))
    logits(tmp_path / "half", atol=2e-2)
    shutil.copytree(tmp_path / "one", tmp_path / "extras")
    extras = {BUFFERS[arch]: torch.ones(1, 1, 16, 16)}
    if model.config.tie_embeddings:
        extras[HEAD[arch]] = model.wte.weight.detach().clone()
    edit_weights(tmp_path / "extras", lambda w: w.update(extras))
    logits(tmp_path / "extras")
    repo = tmp_path / "cache" / "models--someone--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted((tmp_path / "one").iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    logits(snapshot)


# -- the whole set, for memory, and through the command line -----------------------------

def test_every_hostile_folder_costs_little_memory_and_ends_as_one_error_line(tmp_path, tok_json, capsys):
    import sample
    cases = {**CONFIG_CASES, **SHARD_CASES, **{k: v for k, (v, _) in TENSOR_CASES.items()},
             **TOKENIZER_CASES}
    assert len(cases) == len(CONFIG_CASES) + len(SHARD_CASES) + len(TENSOR_CASES) + len(TOKENIZER_CASES)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i, (case, make) in enumerate(cases.items()):
        folder = tmp_path / str(i) / "model"
        write_folder(folder, "gpt2", tok_json)
        make(folder)
        with pytest.raises(AttnlabError):
            load_hf_folder(folder)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 300, f"the refusals raised the peak memory by {grown_mib:.0f} MiB"
    for case in ("config: linked to /dev/zero", "index: ../../ path", "fp8 weights", "config: n_head=0"):
        folder = tmp_path / case.replace("/", "_") / "model"
        write_folder(folder, "gpt2", tok_json)
        cases[case](folder)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_, errors_as_lines():
            sample.main(["--run", str(folder), "--max_new_tokens", "2"])
        stderr = capsys.readouterr().err
        err = [line for line in stderr.splitlines() if line.startswith("error")]
        assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr


def test_a_folder_of_weights_without_config_json_is_named_as_such(tmp_path):
    from engine.checkpoint import choose
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="has weights but no config.json"):
        choose(tmp_path, "best")


# -- the BERT family: its own reader, the same cases ----------------------------------
# BERT, RoBERTa and DistilBERT folders written here by hand as transformers lays them
# out (a masked-LM class: the base model under its prefix, the head beside it), with a
# WordPiece tokenizer.json (conftest's wordpiece_tokenizer).

from engine.interop_bert import ENCODERS, FAMILIES  # noqa: E402

ENCODER_KINDS = list(ENCODERS)
_BERT_SIZES = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
               "intermediate_size": 64, "hidden_act": "gelu", "max_position_embeddings": 24,
               "type_vocab_size": 2, "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"}
ENCODER_CONFIGS = {
    "bert": {"model_type": "bert", **_BERT_SIZES},
    "roberta": {"model_type": "roberta", **_BERT_SIZES, "pad_token_id": 1},
    "distilbert": {"model_type": "distilbert", "vocab_size": 64, "dim": 16, "n_layers": 2,
                   "n_heads": 2, "hidden_dim": 64, "activation": "gelu",
                   "max_position_embeddings": 24, "sinusoidal_pos_embds": False},
}
# Each family's names for the sizes: vocabulary, width, layers, heads, positions, MLP width.
ENCODER_KEYS = {
    "bert": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "intermediate_size"),
    "distilbert": ("vocab_size", "dim", "n_layers", "n_heads", "max_position_embeddings", "hidden_dim"),
}
ENCODER_KEYS["roberta"] = ENCODER_KEYS["bert"]


def write_encoder(folder, kind):
    """A small valid masked-LM folder of `kind` (copied from one written once); its model."""
    key = f"encoder-{kind}"
    if key not in _TEMPLATES:
        from dataclasses import replace
        template = Path(tempfile.mkdtemp(prefix=f"hostile-{kind}-"))
        atexit.register(shutil.rmtree, template, True)
        arch, config = ENCODERS[kind], ENCODER_CONFIGS[kind]
        cfg = replace(arch.from_hf_config(config), readout="mlm")
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        weights = arch.to_hf_weights({k: v.detach() for k, v in model.state_dict().items()}, cfg)
        save_file({k: v.contiguous().clone() for k, v in weights.items()}, template / "model.safetensors")
        (template / "config.json").write_text(json.dumps(config))
        (template / "tokenizer.json").write_text(wordpiece_tokenizer().to_str())
        _TEMPLATES[key] = (template, model)
    template, model = _TEMPLATES[key]
    shutil.copytree(template, folder, dirs_exist_ok=True)
    return model


def _layer_weight(kind, part, layer=0):
    """The transformers name of a per-layer weight: part 0 = the query, else a linear of
    the family's map (its MLP's first layer)."""
    f = FAMILIES[kind]
    name = f.qkv[0] if part == "query" else f.linears["mlp.fc"]
    return f"{f.prefix}{f.layers.format(i=layer)}{name}.weight"


def _encoder_tensor_cases(kind):
    q, fc = _layer_weight(kind, "query"), _layer_weight(kind, "fc", 1)
    fc_bias = fc[:-len("weight")] + "bias"
    return {
        "a tensor missing": (_drop(fc_bias), fc_bias),
        "an extra tensor": (_add(f"{FAMILIES[kind].prefix}encoder.extra"), "encoder.extra"),
        "a shape that differs": (_reshape(q, (16, 17)), q),
        "int32 weights": (_cast(q, torch.int32), "I32"),
        "bool weights": (_cast(q, torch.bool), "BOOL"),
        "fp8 weights": (_cast(q, torch.float8_e4m3fn), "F8_E4M3"),
        "int64 embeddings": (_cast(f"{FAMILIES[kind].prefix}embeddings.word_embeddings.weight",
                                   torch.int64), "I64"),
        "NaN weights": (lambda f: edit_weights(f, lambda w: w[q].fill_(float("nan"))), "NaN"),
        "a head of the wrong vocabulary": (
            _reshape(FAMILIES[kind].head["lm_head.bias"], (65,)), FAMILIES[kind].head["lm_head.bias"]),
    }


def _encoder_config_cases(kind):
    vocab, width, layers, heads, positions, inner = ENCODER_KEYS[kind]
    return {
        "heads=0": {heads: 0}, "heads=-1": {heads: -1}, "width=10^12": {width: 10**12},
        "vocab=10^12": {vocab: 10**12}, "positions=10^12": {positions: 10**12},
        "layers=10^6": {layers: 10**6}, "width not divisible by heads": {heads: 3},
        "a 10^13-parameter model within every cap": {layers: 1024, width: 65536, heads: 512,
                                                     inner: 4 * 65536},
        "layers missing": {layers: None}, "vocab a string": {vocab: "64"},
        "layers a float": {layers: 2.5}, "layers true": {layers: True}, "width a list": {width: [16]},
        "positions NaN": {positions: float("nan")}, "MLP width a string": {inner: "64"},
        "eps a string": ({"layer_norm_eps": "1e-12"} if kind != "distilbert" else {"dim": "16"}),
        "eps NaN": ({"layer_norm_eps": float("nan")} if kind != "distilbert" else {"n_heads": 2.0}),
        "activation a list": ({"hidden_act": ["gelu"]} if kind != "distilbert" else {"activation": ["gelu"]}),
        "activation not computed": ({"hidden_act": "relu"} if kind != "distilbert" else {"activation": "relu"}),
        "tie a string": {"tie_word_embeddings": "true"},
        "no model_type": {"model_type": None},
        **({"token types a string": {"type_vocab_size": "2"}, "token types 10^12": {"type_vocab_size": 10**12},
            "position type relative": {"position_embedding_type": "relative_key"},
            "a decoder": {"is_decoder": True}} if kind != "distilbert" else
           {"sinusoidal positions": {"sinusoidal_pos_embds": True},
            "sinusoidal a string": {"sinusoidal_pos_embds": "no"}}),
        **({"pad_token_id a string": {"pad_token_id": "1"}, "pad_token_id 10^12": {"pad_token_id": 10**12},
            "pad_token_id -5": {"pad_token_id": -5}} if kind == "roberta" else {}),
    }


def _edit_config_none_deletes(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (folder / "config.json").write_text(json.dumps(config))


ENCODER_CASES = (
    [(kind, f"tensor: {case}") for kind in ENCODER_KINDS for case in _encoder_tensor_cases(kind)]
    + [(kind, f"config: {case}") for kind in ENCODER_KINDS for case in _encoder_config_cases(kind)]
    + [(kind, f"shard: {case}") for kind in ENCODER_KINDS for case in SHARD_CASES]
    + [(kind, case) for kind in ENCODER_KINDS for case in TOKENIZER_CASES
       if "chars" not in case and "vocab_size" not in case]
    + [(kind, f"config file: {case}") for kind in ENCODER_KINDS for case in
       ("config: a huge integer", "config: linked to /dev/zero", "config: not UTF-8", "config: a sparse 5 GB file")]
)


ENCODER_TOKENIZER_CASES = {
    "tokenizer: not UTF-8": lambda f: (f / "tokenizer.json").write_bytes(b'{"model": "\xff"}'),
    "tokenizer: a WordPiece whose vocab is a list": lambda f: (f / "tokenizer.json").write_text(
        json.dumps({**json.loads(wordpiece_tokenizer().to_str()),
                    "model": {"type": "WordPiece", "vocab": [1, 2]}})),
    "tokenizer: more tokens than the model has rows": lambda f: (f / "tokenizer.json").write_text(
        json.dumps(_grown_wordpiece(80))),
}


def _grown_wordpiece(n):
    data = json.loads(wordpiece_tokenizer().to_str())
    data["model"]["vocab"].update({f"x{i}": 64 + i for i in range(n - 64)})
    return data


for _kind in ENCODER_KINDS:
    ENCODER_CASES += [(_kind, case) for case in ENCODER_TOKENIZER_CASES]
TOKENIZER_CASES_ALL = {**TOKENIZER_CASES, **ENCODER_TOKENIZER_CASES}


def make_encoder_case(kind, case, folder):
    group, name = case.split(": ", 1)
    if case in TOKENIZER_CASES_ALL:
        TOKENIZER_CASES_ALL[case](folder)
    elif group == "tensor":
        _encoder_tensor_cases(kind)[name][0](folder)
    elif group == "config":
        _edit_config_none_deletes(folder, **_encoder_config_cases(kind)[name])
    elif group == "shard":
        SHARD_CASES[name](folder)
    elif name == "config: a huge integer":
        layers = ENCODER_KEYS[kind][2]
        (folder / "config.json").write_text((folder / "config.json").read_text().replace(
            f'"{layers}": 2', f'"{layers}": ' + "9" * 5000))
    else:
        CONFIG_CASES[name](folder)


ENCODER_MATCH = {"config: a 10^13-parameter model within every cap": "too large for this machine",
                 "config file: config: linked to /dev/zero": "config.json leads outside",
                 "tokenizer: more tokens than the model has rows": "tokenizer.json"}


@pytest.mark.parametrize("kind,case", ENCODER_CASES, ids=[f"{k}-{c}"[:70] for k, c in ENCODER_CASES])
def test_a_hostile_bert_family_folder_is_refused_naming_its_file(kind, case, tmp_path, monkeypatch):
    folder = tmp_path / "hub" / "model"
    write_encoder(folder, kind)
    make_encoder_case(kind, case, folder)
    import engine.interop_bert as interop_bert
    built = builds(monkeypatch)
    message = refused(folder, ENCODER_MATCH.get(case))
    assert all(d.type == "meta" for d in built), "a model was built before the refusal"
    if "10^13" in case:                       # the file named once, not "X: X describes"
        assert message.count(str(folder / "config.json")) == 1, message
    group, name = case.split(": ", 1)
    if group == "tensor":
        assert _encoder_tensor_cases(kind)[name][1] in message, message
    if group in ("config", "tokenizer"):
        assert f"{group}.json" in message, message


@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_a_sound_bert_family_folder_loads_whole_sharded_and_in_float16(kind, tmp_path):
    model = write_encoder(tmp_path / "one", kind)
    x = torch.randint(5, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x).logits
    for name, change, atol in (("one", None, 1e-6), ("sharded", shard, 1e-6),
                               ("half", lambda f: edit_weights(f, lambda w: w.update(
                                   {k: v.half() for k, v in w.items()})), 2e-2)):
        if change is not None:
            shutil.copytree(tmp_path / "one", tmp_path / name)
            change(tmp_path / name)
        ours, cfg, tok = load_hf_folder(tmp_path / name)
        assert cfg.readout == "mlm" and tok.mask_id == 4
        with torch.no_grad():
            torch.testing.assert_close(ours(x).logits, want, atol=atol, rtol=0)


def test_hostile_bert_family_folders_end_as_one_error_line(tmp_path, capsys):
    import sample
    from attnlab import heads
    for kind, case in [("bert", "config: vocab a string"), ("roberta", "shard: index: ../../ path"),
                       ("distilbert", "tensor: fp8 weights"), ("bert", "tokenizer: not JSON"),
                       ("roberta", "config: heads=0")]:
        folder = tmp_path / kind / case.replace("/", "_").replace(" ", "_") / "model"
        write_encoder(folder, kind)
        make_encoder_case(kind, case, folder)
        for main in (lambda: sample.main(["--run", str(folder)]),
                     lambda: heads.main(["search", "--run", str(folder), "--text", "the cat",
                                         "--from", "cat", "--to", "the"])):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_, errors_as_lines():
                main()
            stderr = capsys.readouterr().err
            err = [line for line in stderr.splitlines() if line.startswith("error")]
            assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, (case, stderr)
            assert str(folder) in err[0], err[0]


# -- the MLP's width: a checkpoint brings its own ----------------------------------------

@pytest.mark.parametrize("arch,key", [("llama", "intermediate_size"), ("mistral", "intermediate_size"),
                                      ("gpt_neox", "intermediate_size"), ("gpt2", "n_inner")])
def test_a_huge_mlp_width_is_refused_in_one_line_before_the_model_is_built(arch, key, tmp_path,
                                                                           tok_json, monkeypatch,
                                                                           capsys):
    import engine.budget
    import sample
    write_folder(tmp_path / "huge", arch, tok_json)
    edit_config(tmp_path / "huge", **{key: 10**9})             # past every cap
    assert "config.json" in refused(tmp_path / "huge")
    # Within the caps, but 2 layers x 3 x 16 x 2^18 weights are 100 MiB: the size check
    # counts the MLP's own width, not 8 x n_embd^2, and refuses with 64 MiB free.
    write_folder(tmp_path / "wide", arch, tok_json)
    edit_config(tmp_path / "wide", **{key: 1 << 18})
    monkeypatch.setattr(engine.budget, "available_bytes", lambda device: 64 << 20)
    refused(tmp_path / "wide", "too large for this machine")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, errors_as_lines():
        sample.main(["--run", str(tmp_path / "huge"), "--max_new_tokens", "2"])
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("error")]
    assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr


def test_a_folder_with_its_own_mlp_width_loads_and_a_mismatched_one_is_refused(tmp_path, tok_json):
    # 40 is neither SwiGLU's rule (64 at n_embd 16) nor 4 x n_embd
    for arch in ("llama", "gpt2"):
        model = _write_folder(tmp_path / arch, arch, tok_json, mlp_hidden=40)
        ours, cfg, _ = load_hf_folder(tmp_path / arch)
        assert cfg.mlp_hidden == 40 and ours.blocks[0].mlp.proj.in_features == 40
        for key, value in model.state_dict().items():
            assert torch.equal(value, ours.state_dict()[key]), key
        # the config says one width, the weights hold another: refused by name
        edit_config(tmp_path / arch, **{"intermediate_size" if arch == "llama" else "n_inner": 48})
        assert "model.safetensors" in refused(tmp_path / arch)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["gpt2", *ENCODER_KINDS[:1]])
def test_a_folder_cut_short_is_refused_with_the_way_to_a_whole_one(kind, name, tmp_path):
    """A download that stopped part-way leaves a file cut short. Its refusal named the
    file but left the user there: it now says to fetch the folder again or write it anew."""
    folder = tmp_path / "model"
    write_encoder(folder, kind) if kind in ENCODER_KINDS else write_folder(folder, kind)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[:len(data) // 2])
    message = refused(folder, str(folder / name))
    assert message.endswith(f"; {interop.FETCH_AGAIN}"), message
