"""Models to and from transformers (engine/interop.py, attnlab/export.py,
attnlab/evaluate.py, train.py --train.init_from), each checked against transformers'
own implementation of the architecture: tiny models built here, nothing downloaded."""
import json
import re
import warnings
from dataclasses import asdict

import pytest
import torch

from conftest import run_script, train_tiny
from data.tokenizer import BPETokenizer, CharTokenizer
from engine.interop import ExportError, architecture_for, export, load_hf_folder
from model import GPT, ModelConfig

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,\n")

# Every configuration an architecture expresses, and the one it maps to.
MAPPED = {
    "gpt2": (dict(position="learned", norm="layernorm", mlp="gelu_tanh", norm_eps=1e-2), "GPT2LMHeadModel"),
    "gpt2-bias-untied": (dict(position="learned", bias=True, tie_embeddings=False), "GPT2LMHeadModel"),
    "default (neox)": (dict(), "GPTNeoXForCausalLM"),
    "neox-theta-eps": (dict(rope_theta=500.0, norm_eps=1e-2), "GPTNeoXForCausalLM"),
    "neox-gelu-tanh": (dict(mlp="gelu_tanh"), "GPTNeoXForCausalLM"),
    "neox-bias": (dict(bias=True, tie_embeddings=False), "GPTNeoXForCausalLM"),
    "llama-gqa": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, rope_theta=500.0, norm_eps=1e-2),
                  "LlamaForCausalLM"),
    "llama-mqa-bias-untied": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=1, bias=True,
                                   tie_embeddings=False), "LlamaForCausalLM"),
    "mistral-window": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, sliding_window=8),
                       "MistralForCausalLM"),
    # an MLP width of its own, not the variant's rule: written as intermediate_size / n_inner
    "llama-ffn200": (dict(norm="rmsnorm", mlp="swiglu", mlp_hidden=200), "LlamaForCausalLM"),
    "gpt2-ffn96": (dict(position="learned", mlp="gelu_tanh", bias=True, mlp_hidden=96),
                   "GPT2LMHeadModel"),
    "neox-ffn160": (dict(bias=True, mlp_hidden=160), "GPTNeoXForCausalLM"),
}


def scrambled(cfg: ModelConfig) -> GPT:
    """A model whose norms and biases are away from 1 and 0, so a mapping that dropped
    or swapped one of them shows in the logits."""
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("name", MAPPED)
def test_export_loads_in_transformers_with_equal_logits_and_greedy_text(name, tmp_path):
    overrides, hf_class = MAPPED[name]
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64,
                      **overrides)
    ours = scrambled(cfg)
    export(ours, cfg, CHARS, tmp_path / "out")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                 output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == hf_class
    assert not info["missing_keys"] and not info["unexpected_keys"]    # nothing left to chance
    x = torch.randint(0, CHARS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, atol=1e-5, rtol=0)
    prompt = x[:1, :6]
    mine = torch.cat(list(ours.generate(prompt, 50, temperature=0)), dim=1)
    theirs = hf.generate(prompt, max_new_tokens=50, do_sample=False, min_new_tokens=50,
                         pad_token_id=0)[:, prompt.shape[1]:]
    assert torch.equal(mine, theirs)                  # 50 tokens, past an 8-token window too
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "hello, world.\nfine"
    assert tok(text)["input_ids"] == CHARS.encode(text) and tok.decode(CHARS.encode(text)) == text
    assert (tmp_path / "out" / "generation_config.json").is_file()


@pytest.mark.parametrize("fields,blocking", [
    (dict(position="alibi"), "model.position=alibi"),
    (dict(position="sinusoidal"), "model.position=sinusoidal"),
    (dict(sliding_window=8, n_global=2), "model.n_global=2"),
    (dict(rope_scaling="yarn", rope_factor=2.0), "model.rope_scaling=yarn"),
    (dict(mlp="relu2"), "model.mlp=relu2"),
    (dict(qk_norm=True), "model.qk_norm=true"),
    (dict(logit_softcap=15.0), "model.logit_softcap=15.0"),
    (dict(value_embeds=True), "model.value_embeds=true"),
    (dict(skip_connections=True), "model.skip_connections=true"),
    (dict(token_mix=4), "model.token_mix=4"),
    (dict(mtp_depth=1), "model.mtp_depth=1"),
    (dict(readout="adaptive", readout_shortlist=20, tie_embeddings=False), "model.readout=adaptive"),
    (dict(norm="rmsnorm", mlp="swiglu", bias=True, sliding_window=8), "model.bias=true"),
])
def test_a_model_nothing_expresses_is_refused_before_any_file_is_written(fields, blocking, tmp_path):
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32,
                      **fields)
    with pytest.raises(ExportError, match=f"nearest is .*{blocking}"):
        export(GPT(cfg), cfg, CHARS, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


ENCODER = dict(causal=False, block="postnorm", position="rope", bias=True, readout="mlm")


@pytest.mark.parametrize("fields,arch", [
    (dict(token_mix=4), "GPTNeoXForCausalLM"),                 # what --budget sets on a CPU
    (dict(n_kv_head=2), "LlamaForCausalLM"),                   # GQA kept: Llama's parts
    (dict(mtp_depth=1), "GPTNeoXForCausalLM"),
    (dict(n_kv_head=1, sliding_window=8), "MistralForCausalLM"),
    (dict(sliding_window=8, n_global=2, token_mix=4), "MistralForCausalLM"),
    (dict(position="alibi", qk_norm=True), "GPTNeoXForCausalLM"),
    (ENCODER, "BertModel"),                                    # the encoder preset's parts
])
def test_a_refused_export_names_the_flags_that_make_the_model_exportable(fields, arch):
    """The flags the refusal ends with, applied to the config, give a model that exports
    as the architecture it names, and one that keeps the run's own choices where one can
    (a GQA run is not told to drop its key/value heads)."""
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=32, n_layer=1, n_head=4, n_embd=32,
                      **fields)
    with pytest.raises(ExportError) as err:
        architecture_for(cfg, CHARS)
    said = str(err.value)
    assert "\n" not in said and f"to export as {arch} " in said, said
    flags = dict(re.findall(r"--model\.(\w+)=(\S+)", said.split("train with", 1)[1]))
    assert flags, said
    fixed = ModelConfig(**{**asdict(cfg), **{k: json.loads(v) if v[0].isdigit() or v in ("true", "false")
                                             else v for k, v in flags.items()}})
    assert architecture_for(fixed).hf_class == arch
    # A BERT-family folder holds no character vocabulary: the run must train with a BPE one.
    assert ("--data.tokenizer=bpe" in said) == (arch == "BertModel")
    kept = {k: v for k, v in fields.items() if k in ("n_kv_head",)}
    assert all(getattr(fixed, k) == v for k, v in kept.items())


def gpt2_style_tokenizer(folder):
    """A byte-level BPE in GPT-2's format, saved the way save_pretrained saves one."""
    bpe = BPETokenizer.train(["The trophy did not fit in the suitcase because it was too big. "] * 50, 300)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.hf, eos_token="<|endoftext|>",
                                                  bos_token="<|endoftext|>")
    hf_tok.save_pretrained(folder)
    return bpe


HF_MODELS = {
    "gpt2": lambda v: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_positions=64, n_embd=64, n_layer=2, n_head=4)),
    "gpt2-gelu-exact": lambda v: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_positions=64, n_embd=64, n_layer=2, n_head=4, activation_function="gelu")),
    "llama-gqa": lambda v: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # real checkpoints choose their own MLP width (Llama 2 7B: 11008 at 4096)
    "llama-ffn128": lambda v: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)),
    "llama-ffn200": lambda v: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)),
    "mistral-ffn200": lambda v: transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=v, hidden_size=64, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8)),
    "gpt2-n_inner96": lambda v: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=96)),
    "neox-ffn160": lambda v: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=v, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=False,
        hidden_act="gelu", rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                            "rope_type": "default"})),
    "neox-sequential": lambda v: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=v, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=False,
        hidden_act="gelu_new", rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                                "rope_type": "default"})),
    "neox-gelu-exact": lambda v: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=v, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, use_parallel_residual=False,
        hidden_act="gelu", rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                            "rope_type": "default"})),
}


@pytest.mark.parametrize("name", HF_MODELS)
@pytest.mark.parametrize("shard", [False, True])
def test_a_transformers_folder_imports_with_equal_logits_and_round_trips(name, shard, tmp_path):
    folder = tmp_path / "hf"
    tok = gpt2_style_tokenizer(folder)
    torch.manual_seed(0)
    hf = HF_MODELS[name](tok.vocab_size).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder, max_shard_size="40KB" if shard else "1GB")
    assert (folder / "model.safetensors.index.json").is_file() == shard
    ours, cfg, tokenizer = load_hf_folder(folder)
    x = torch.randint(0, tok.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf(x).logits, atol=1e-5, rtol=0)
    assert tokenizer.encode("The trophy") == tok.encode("The trophy")
    export(ours, cfg, tokenizer, tmp_path / "again")
    again, cfg_again, _ = load_hf_folder(tmp_path / "again")
    assert cfg_again == cfg
    for key, value in ours.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    width = json.loads((folder / "config.json").read_text())
    width = width.get("intermediate_size", width.get("n_inner"))
    if width is not None:
        assert ours.blocks[0].mlp.proj.in_features == width
        assert json.loads((tmp_path / "again" / "config.json").read_text()).get(
            "intermediate_size", width) == width


def test_pickled_weights_are_refused_with_the_way_out(tmp_path):
    from common.errors import CheckpointError
    folder = tmp_path / "hf"
    gpt2_style_tokenizer(folder)
    hf = HF_MODELS["gpt2"](300)
    hf.config.save_pretrained(folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin are pickles.*safe_serialization"):
        load_hf_folder(folder)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    tok = gpt2_style_tokenizer(folder)
    torch.manual_seed(0)
    HF_MODELS["gpt2"](tok.vocab_size).save_pretrained(folder)
    return folder


def test_sample_and_head_search_read_a_gpt2_folder(gpt2_folder):
    proc = run_script("sample.py", "--run", gpt2_folder, "--prompt",
                      "The trophy did not fit in the suitcase because it", "--max_new_tokens", "5")
    assert proc.stdout.startswith("The trophy did not fit in the suitcase because it")
    proc = run_script("-m", "attnlab.heads", "search", "--run", gpt2_folder, "--text",
                      "The trophy did not fit in the suitcase because it was too big",
                      "--from", "it", "--to", "trophy")
    assert proc.stdout.count("layer ") >= 5 and "looking at tokens" in proc.stdout


@pytest.fixture(scope="module")
def parent_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("parent")
    return out, train_tiny(corpus, out, "parent", "--train.max_iters=40", "--train.lr=3e-3")


def evaluate_loss(run, data, *extra):
    proc = run_script("-m", "attnlab.evaluate", "--run", run, "--data", data, *extra)
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.startswith(("attnlab ", "transformers "))}
    return {name: float(values[0]) for name, values in rows.items()}


def test_fine_tuning_starts_at_the_parent_and_improves_on_the_new_text(parent_run, corpus, tmp_path):
    out, parent = parent_run
    new = tmp_path / "new.txt"
    new.write_text(corpus.read_text()[::-1][:30_000])       # the same characters, reversed text
    run = tmp_path / "runs" / "ft"
    run_script("train.py", "--config", "finetune", f"--train.init_from={parent}",
               f"--data.path={new}", f"--data.cache_dir={out / 'cache'}", "--train.device=cpu",
               f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=ft", "--train.max_iters=60",
               "--train.eval_interval=30", "--train.lr=2e-3", "--train.batch_size=8")
    saved = json.loads((run / "config.json").read_text())
    assert saved["parent"]["path"] == str(parent) and len(saved["parent"]["weights_sha256"]) == 64
    before = evaluate_loss(parent, new)["attnlab"]
    at_start = evaluate_loss(run / "checkpoints" / "step_0000000", new)["attnlab"]
    after = evaluate_loss(run / "checkpoints" / "step_0000060", new)["attnlab"]
    assert at_start == before and after < before - 0.05
    refused = run_script("train.py", "--config", "finetune", f"--train.init_from={parent}",
                         f"--data.path={new}", "--model.n_layer=3", check=False)
    assert refused.returncode == 2 and "model.n_layer=3 (the source has 2)" in refused.stderr
    resumed = run_script("train.py", "--resume", run, "--train.max_iters=70",
                         f"--train.out_dir={tmp_path / 'runs'}")
    assert "done at step 70" in resumed.stdout


def test_evaluate_of_an_export_equals_transformers_own_loss(parent_run, corpus, tmp_path):
    _, parent = parent_run
    run_script("-m", "attnlab.export", "--run", parent, "--out", tmp_path / "exported")
    text = tmp_path / "text.txt"
    text.write_text(corpus.read_text()[-3000:])
    losses = evaluate_loss(parent, text, "--compare", tmp_path / "exported", "--stride", "8")
    assert abs(losses["attnlab"] - losses["transformers"]) < 1e-4
    refused = run_script("-m", "attnlab.export", "--run", parent, "--out", tmp_path / "exported",
                         check=False)
    assert refused.returncode == 2 and "not an empty folder" in refused.stderr


def test_evaluate_scores_every_token_once_from_its_window():
    """Against a brute-force reference: each token's log-probability from a full pass
    over the window that first contains it as a new target."""
    from attnlab.evaluate import sliding_loss, windows
    for n, context, stride in [(50, 16, 8), (50, 16, 16), (10, 32, 16), (33, 8, 3)]:
        covered = [p for _, end, first in windows(n, context, stride) for p in range(first, end)]
        assert covered == list(range(1, n))
    cfg = ModelConfig(vocab_size=CHARS.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=32)
    model = scrambled(cfg)
    ids = torch.randint(0, CHARS.vocab_size, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    nats, count = sliding_loss(lambda x: model(x).logits, ids, 16, 8, progress=False)
    expected = 0.0
    for t in range(1, 50):
        start = 0 if t <= 16 else ((t - 17) // 8 + 1) * 8       # the window where t is first new
        with torch.no_grad():
            logits = model(torch.tensor([ids[start:t]])).logits[0, -1].double()
        expected -= torch.log_softmax(logits, -1)[ids[t]].item()
    assert count == 49 and nats == pytest.approx(expected, rel=1e-6)


def _one_error_line(capsys, main, argv):
    from engine.cli import errors_as_lines
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, errors_as_lines():
        main(argv)
    stderr = capsys.readouterr().err            # progress bars aside, one line: error: ...
    err = [line for line in stderr.splitlines() if line.startswith("error")]
    assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr
    return err[0]


def test_a_character_model_exported_comes_back_as_characters_naming_what_it_lacks(
        parent_run, corpus, tmp_path, capsys):
    """Exported, a character model's tokenizer is transformers' one-token-per-character
    form; read back it is the character tokenizer again, so a character it never saw is
    named in one line (sample, heads, evaluate, fine-tuning), as its own run does."""
    import sample
    from attnlab import evaluate, heads
    from engine.inference import load_run
    out, parent = parent_run
    model, cfg, original, _ = load_run(parent)
    export(model, cfg.model, original, tmp_path / "exported")
    exported = str(tmp_path / "exported")
    _, cfg_back, tok, _ = load_run(exported)
    assert tok.kind == "char" and cfg_back.data.tokenizer == "char" and tok.chars == original.chars
    assert tok.encode(corpus.read_text()[:500]) == original.encode(corpus.read_text()[:500])
    text = tmp_path / "new.txt"
    text.write_text(corpus.read_text()[:5000] + "Zoë paid 5 €\n")
    for main, argv in [(sample.main, ["--run", exported, "--prompt", "Zoë", "--max_new_tokens", "2"]),
                       (heads.main, ["grid", "--run", exported, "--text", "Zoë", "--out", str(tmp_path / "g.png")]),
                       (evaluate.main, ["--run", exported, "--data", str(text)])]:
        assert "'ë'" in _one_error_line(capsys, main, argv)
    tuned = run_script("train.py", "--config", "finetune", f"--train.init_from={exported}",
                       f"--data.path={text}", f"--data.cache_dir={out / 'cache'}",
                       f"--train.out_dir={tmp_path / 'runs'}", "--train.max_iters=2", check=False)
    lines = [l for l in tuned.stderr.splitlines() if l.startswith(("error", "Traceback"))]
    assert tuned.returncode == 2 and len(lines) == 1 and "'ë', '€'" in lines[0], tuned.stderr[-2000:]


def test_a_foreign_tokenizer_without_an_unknown_token_names_the_characters_it_lacks():
    """A word-level tokenizer with no [UNK] (tokenizers raises a bare Exception)."""
    from tokenizers import Regex, Tokenizer as Backend, models, pre_tokenizers
    from common.errors import TokenizerError
    from data.tokenizer import Tokenizer
    backend = Backend(models.WordLevel({"to": 0, "be": 1, "or": 2, "not": 3}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer.parse(backend.to_str())
    assert tok.kind == "bpe" and tok.encode("to be or not") == [0, 1, 2, 3]
    for call in (tok.encode, tok.encode_array, tok.spans):
        with pytest.raises(TokenizerError, match="no token for 'what'; remove them"):
            call("to be or what")
    single = Backend(models.WordLevel({c: i for i, c in enumerate("abc ")}, unk_token=None))
    # (a Split by any other regular expression is refused before it is built)
    single.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok = Tokenizer.parse(single.to_str())
    assert tok.kind == "bpe"                     # no decoder that joins characters: not ours
    with pytest.raises(TokenizerError, match="no token for 'Z', 'é'; remove them"):
        tok.encode("a b Z é")
