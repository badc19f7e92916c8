"""BERT-family folders (engine/interop_bert.py) against transformers' own models: the
article's all-MiniLM-L6-v2, and tiny random BERT, DistilBERT and RoBERTa masked LMs."""
import pytest
import torch

from attnlab.capture import run_with_cache
from common.errors import CheckpointError
from conftest import wordpiece_tokenizer
from engine.inference import load_run
from engine.interop import export, load_hf_folder

ARTICLE = "The trophy didn't fit in the suitcase because it was too big."
ARTICLE_TOKENS = ['[CLS]', 'the', 'trophy', 'didn', "'", 't', 'fit', 'in', 'the', 'suitcase',
                  'because', 'it', 'was', 'too', 'big', '.', '[SEP]']


def padded(tokenizer, texts):
    """(ids, attention_mask) for texts of unequal length, padded on the right with 0."""
    rows = [tokenizer.encode(t) for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask


def test_minilm_tokens_and_sizes_are_the_articles(minilm):
    model, cfg, tokenizer, _ = load_run(minilm)
    ids = tokenizer.encode(ARTICLE)
    assert tokenizer.token_strings(ids) == ARTICLE_TOKENS
    assert (cfg.model.n_layer, cfg.model.n_head, len(ids)) == (6, 12, 17)     # "6 12 17"
    assert cfg.model.readout == "none" and not cfg.model.causal
    with pytest.raises(Exception, match="no output layer"):
        model.readout(torch.zeros(1, 1, cfg.model.n_embd))


def test_minilm_equals_transformers_at_every_layer_with_padding(minilm):
    """Every layer's hidden states and attention weights, for two sentences of different
    lengths in one padded batch, equal BertModel's eager attention within 1e-5 (fp32) at
    every real token, and within fp32 rounding of the stream's size at the padding."""
    from transformers import BertModel
    model, _, tokenizer, _ = load_run(minilm)
    hf = BertModel.from_pretrained(minilm, attn_implementation="eager").eval()
    ids, mask = padded(tokenizer, [ARTICLE, "The river bank eroded."])
    assert mask[1].sum() < mask[0].sum()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, output_attentions=True,
                    output_hidden_states=True)
    names = [f"blocks.{l}.{n}" for l in range(6) for n in ("resid_pre", "resid_post", "pattern")]
    _, cache = run_with_cache(model, ids, only=names, attention_mask=mask)
    real = mask.bool()
    for layer in range(6):
        torch.testing.assert_close(cache[f"blocks.{layer}.pattern"], theirs.attentions[layer],
                                   atol=1e-5, rtol=0)
        ours, hf_h = cache[f"blocks.{layer}.resid_post"], theirs.hidden_states[layer + 1]
        torch.testing.assert_close(ours[real], hf_h[real], atol=1e-5, rtol=0)
        # Padding rows (queries no token attends from) carry values up to about 10 whose
        # fp32 rounding differs by kernel: on an AMX Xeon ours and BertModel's differ by
        # 1.6e-5 there, each within 1.7e-5 of BertModel in float64. A mask or scale bug
        # moves them by far more than a few millionths of the stream's size.
        torch.testing.assert_close(ours, hf_h, atol=4e-6 * hf_h.abs().max().item(), rtol=0)
    # The first block's input is the normalised embedding sum, hidden_states[0].
    torch.testing.assert_close(cache["blocks.0.resid_pre"], theirs.hidden_states[0], atol=1e-5, rtol=0)
    # Padding gets no weight from any query.
    assert cache["blocks.0.pattern"][1, :, :, mask[1] == 0].abs().max() == 0


def test_minilm_import_export_import_is_bit_identical(minilm, tmp_path):
    model, cfg, tokenizer = load_hf_folder(minilm)
    arch = export(model, cfg, tokenizer, tmp_path / "out")
    assert arch.hf_class == "BertModel"
    again, cfg2, tokenizer2 = load_hf_folder(tmp_path / "out")
    assert cfg2 == cfg
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert tokenizer2.encode(ARTICLE) == tokenizer.encode(ARTICLE)
    # What the source said and the weights do not carry is written back as it was.
    import json
    source, out = (json.loads((d / "config.json").read_text()) for d in (minilm, tmp_path / "out"))
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings"):
        assert out[key] == source[key], key
    limits = [json.loads((d / "tokenizer_config.json").read_text())["model_max_length"]
              for d in (minilm, tmp_path / "out")]
    assert limits == [512, 512]


# -- tiny random masked LMs saved by save_pretrained ---------------------------------

def _tiny(kind, folder, inner=128):
    import transformers as T
    torch.manual_seed(0)
    sizes = dict(vocab_size=64, max_position_embeddings=40)
    if kind == "distilbert":
        config = T.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=inner, **sizes)
        model = T.DistilBertForMaskedLM(config)
    else:
        Config, Model = {"bert": (T.BertConfig, T.BertForMaskedLM),
                         "roberta": (T.RobertaConfig, T.RobertaForMaskedLM)}[kind]
        config = Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=inner, pad_token_id=0, **sizes)   # [PAD] is 0
        model = Model(config)
    with torch.no_grad():       # every weight away from its initial value, LayerNorms included
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(folder)
    wordpiece_tokenizer().save(str(folder / "tokenizer.json"))
    return model


@pytest.mark.parametrize("kind", ["bert", "distilbert", "roberta"])
def test_a_tiny_masked_lm_imports_with_equal_outputs_and_round_trips(kind, tmp_path):
    theirs = _tiny(kind, tmp_path / "hf")
    model, cfg, tokenizer = load_hf_folder(tmp_path / "hf")
    assert cfg.readout == "mlm" and cfg.tie_embeddings
    ids = torch.tensor([tokenizer.encode("the cat sat on the mat ."),
                        tokenizer.encode("a dog runs on a mat .")])
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    arch = export(model, cfg, tokenizer, tmp_path / "out")
    assert arch.model_type == kind and arch.hf_class == type(theirs).__name__
    again, cfg2, _ = load_hf_folder(tmp_path / "out")
    assert cfg2 == cfg
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # And transformers reads the export back as the class it came from, equal outputs.
    reread = type(theirs).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reread(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


def test_masked_token_prediction_through_the_head(tmp_path):
    theirs = _tiny("bert", tmp_path / "hf")
    model, _, tokenizer = load_hf_folder(tmp_path / "hf")
    ids = torch.tensor([tokenizer.encode("the cat [MASK] on the mat")])
    at = ids[0].tolist().index(tokenizer.mask_id)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0, at], theirs(input_ids=ids).logits[0, at],
                                   atol=1e-5, rtol=0)


def test_an_encoder_refuses_to_generate(minilm):
    model, _, tokenizer, _ = load_run(minilm)
    with pytest.raises(Exception, match="encoder"):
        next(model.generate(torch.tensor([tokenizer.encode("the")]), 1))


def test_a_bert_folder_with_integer_weights_is_refused_with_the_tensor_named(tmp_path):
    """The BERT reader checks dtypes from the headers as the decoder readers do."""
    import json
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel
    BertModel(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32)).save_pretrained(tmp_path)
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "model.safetensors")
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    from engine.interop import load_hf_folder
    with pytest.raises(CheckpointError, match=rf"not floating point: {name} \(I32\)"):
        load_hf_folder(tmp_path)


def test_a_bert_tokenizer_with_ids_past_the_vocabulary_is_refused_with_its_path(tmp_path):
    """An id past the embedding table would be an IndexError at the first such word."""
    import json
    _tiny("bert", tmp_path)
    path = tmp_path / "tokenizer.json"
    data = json.loads(path.read_text())
    data["model"]["vocab"]["cat"] = 1_000_000_000
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer.json has token ids up to 1,000,000,000 "
                                              r"but config.json's vocab_size is 64"):
        load_hf_folder(tmp_path)


def test_fine_tuning_a_bert_folder_is_refused_in_one_line_naming_it(tmp_path):
    from conftest import run_script
    _tiny("bert", tmp_path / "hf")
    text = tmp_path / "new.txt"
    text.write_text("the cat sat on the mat . " * 50)
    proc = run_script("train.py", "--config", "finetune", f"--train.init_from={tmp_path / 'hf'}",
                      f"--data.path={text}", "--train.max_iters=1", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line, = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert f"{tmp_path / 'hf'} is a BERT-family encoder with a wordpiece tokenizer" in line
    assert "data.tokenizer" not in line


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_a_feed_forward_width_other_than_4x_maps_to_mlp_hidden(kind, tmp_path):
    """A BERT-family folder with a 48-wide feed-forward layer (not 4 x 32): equal
    outputs, and an export transformers reads back with the same width."""
    import json
    theirs = _tiny(kind, tmp_path / "hf", inner=48)
    model, cfg, tokenizer = load_hf_folder(tmp_path / "hf")
    assert cfg.mlp_hidden == 48
    ids = torch.tensor([tokenizer.encode("the cat sat on the mat .")])
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=0)
    export(model, cfg, tokenizer, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["intermediate_size" if kind == "bert" else "hidden_dim"] == 48
    reread = type(theirs).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reread(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


def test_an_encoder_with_a_character_vocabulary_is_told_to_train_with_bpe(tmp_path):
    """The encoder preset trains on characters, which no BERT-family tokenizer.json holds:
    the refusal says which flag gives a vocabulary that exports."""
    from data.tokenizer import CharTokenizer
    from engine.interop import ExportError
    from model import GPT, ModelConfig
    chars = CharTokenizer("abcdefgh .")
    cfg = ModelConfig(vocab_size=chars.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16,
                      causal=False, block="postnorm", position="learned", bias=True, readout="mlm")
    with pytest.raises(ExportError, match=r"not a character vocabulary: train with --data\.tokenizer=bpe$"):
        export(GPT(cfg), cfg, chars, tmp_path / "out")
    assert not (tmp_path / "out").exists()
