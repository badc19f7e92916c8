"""Bidirectional self-attention (model.causal=false): why a language model needs the
causal mask, and an encoder's masked-LM head filling in a blank."""
import pytest
import torch

from model import GPT, ModelConfig


def train_lm(causal: bool, steps: int = 40) -> tuple[float, GPT]:
    """A 1-layer model trained as a next-token predictor on fresh uniformly random
    tokens every step, where nothing earlier says anything about the next token: the
    best honest loss is ln(16) = 2.77."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, block_size=16, n_layer=1, n_head=2, n_embd=32,
                      position="learned", causal=causal, attention="eager")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = torch.randint(0, 16, (32, 17), generator=g)
        loss = model(data[:, :-1], data[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item(), model


def test_without_the_causal_mask_a_language_model_reads_the_answer():
    """The article's §04: with every token visible, the next token is in the input, so
    the loss collapses far below what any honest model can reach, and attention looks
    one step ahead (the query at i puts its weight on key i+1)."""
    honest, _ = train_lm(causal=True)
    leaked, model = train_lm(causal=False)
    assert honest > 2.5 and leaked < 0.5 * honest
    x = torch.randint(0, 16, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights = model(x, return_attention=True).attentions[0]            # (B, H, T, T)
    ahead = weights.diagonal(offset=1, dim1=-2, dim2=-1).max(dim=1).values  # best head, (B, T-1)
    assert ahead.mean() > 0.5
    with pytest.raises(Exception, match="encoder"):
        model.generate(x[:1, :2], 3)


def test_a_padded_key_gets_no_weight_and_changes_nothing():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, block_size=16, n_layer=2, n_head=2, n_embd=32,
                      position="learned", causal=False, block="postnorm", n_token_types=2,
                      readout="mlm", bias=True)
    model = GPT(cfg).eval()
    short = torch.tensor([[1, 2, 3, 4]])
    padded = torch.tensor([[1, 2, 3, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        alone = model(short).logits
        out = model(padded, attention_mask=mask, return_attention=True)
    torch.testing.assert_close(out.logits[:, :4], alone, atol=1e-5, rtol=0)
    assert all(w[..., 4:].abs().max() == 0 for w in out.attentions)


def test_fill_the_mask_names_the_masked_lm_heads_guess(tmp_path):
    from test_interop_bert import _tiny

    from attnlab.fill import fill
    from engine.interop import load_hf_folder
    theirs = _tiny("bert", tmp_path / "hf")
    model, _, tokenizer = load_hf_folder(tmp_path / "hf")
    (position, guesses), = fill(model, tokenizer, "the cat [MASK] on the mat", top=3)
    ids = torch.tensor([tokenizer.encode("the cat [MASK] on the mat")])
    with torch.no_grad():
        best = theirs(input_ids=ids).logits[0, position].softmax(-1).topk(3)
    assert [t for t, _ in guesses] == tokenizer.token_strings(best.indices.tolist())
    assert [p for _, p in guesses] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_bert_masking_chooses_15_percent_and_splits_them_80_10_10():
    from data.masking import mask_tokens
    ids = torch.randint(0, 1000, (64, 512), generator=torch.Generator().manual_seed(0)) + 10
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, 0] = True                                               # [CLS] is never chosen
    inputs, targets = mask_tokens(ids, mask_id=3, vocab_size=1010,
                                  generator=torch.Generator().manual_seed(1), keep=keep)
    chosen = targets != -1
    assert not chosen[:, 0].any() and torch.equal(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    n = chosen.sum().item()
    assert abs(n / ids[:, 1:].numel() - 0.15) < 0.005
    as_mask = (inputs[chosen] == 3).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()
    assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1) < 0.01     # and ~0.1 random


@pytest.mark.usefixtures("one_thread")
def test_a_small_encoder_learns_to_fill_masked_characters(corpus):
    """The objective end to end: a 2-layer bidirectional model on the bundled plays, its
    masked-token loss falling below the uniform guess (ln V) within 80 steps (3.24
    against 4.22: a start, about what the characters' frequencies alone give)."""
    import math

    from data.masking import mask_tokens
    from data.tokenizer import CharTokenizer
    text = corpus.read_text()
    tok = CharTokenizer.train(text)
    mask_id = tok.vocab_size                                         # one id past the characters
    data = torch.tensor(tok.encode(text))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size + 1, block_size=32, n_layer=2, n_head=2, n_embd=64,
                      causal=False, block="postnorm", position="learned", bias=True, readout="mlm")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(80):
        starts = torch.randint(0, len(data) - 32, (32,), generator=g)
        x = torch.stack([data[s:s + 32] for s in starts])
        inputs, targets = mask_tokens(x, mask_id, tok.vocab_size, g)
        loss = model(inputs, targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * math.log(tok.vocab_size)


# -- the encoder preset: train.objective=mlm through the training loop ------------------

def encoder_run(corpus, out, name, steps, every=10):
    """The encoder preset cut to a tiny model, trained in this process; its Run."""
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    cfg = cli.build("encoder", [f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
                                f"--train.out_dir={out / 'runs'}", f"--train.run_name={name}",
                                "--model.n_layer=2", "--model.n_embd=32", "--model.n_head=2",
                                "--model.block_size=32", "--train.batch_size=8",
                                f"--train.max_iters={steps}", f"--train.eval_interval={every}",
                                "--train.eval_iters=2", "--train.log_interval=1"])
    run = setup_run(cfg, log=lambda *a, **k: None)
    train(run)
    return run


def records(run_dir):
    import json
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def encoder20(corpus, tmp_path_factory):
    return encoder_run(corpus, tmp_path_factory.mktemp("encoder"), "enc", 20)


def test_the_encoder_preset_trains_on_masked_tokens_and_reports_their_accuracy(encoder20):
    from engine.objectives import masked_accuracy
    run = encoder20
    tok = run.data.tokenizer
    assert tok.mask_id == tok.vocab_size - 1 == run.cfg.model.vocab_size - 1
    assert tok.encode("a[MASK]b") == [tok.encode("a")[0], tok.mask_id, tok.encode("b")[0]]
    evals = [r for r in records(run.run_dir) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert all(0 <= r["val_accuracy"] <= 1 and "val_bpb" not in r for r in evals)
    # The loss is taken on the chosen 15% alone: the same batch, scored by hand.
    x, y = run.batches.load(__import__("numpy").arange(8))
    inputs, targets = run.objective_batch(x, y, 7)
    assert 0 < (targets != -1).float().mean() < 0.3 and torch.equal(targets[targets != -1], x[targets != -1])
    with torch.no_grad():
        out = run.model(inputs, targets)
    chosen = targets != -1
    by_hand = torch.nn.functional.cross_entropy(out.logits[chosen], targets[chosen])
    torch.testing.assert_close(out.loss, by_hand)
    right, scored = masked_accuracy(out.logits, targets)
    assert scored == chosen.sum() and right == (out.logits.argmax(-1) == targets)[chosen].sum()


def test_a_resumed_encoder_run_masks_and_trains_exactly_as_an_unbroken_one(corpus, tmp_path):
    from engine.loop import train
    from engine.resume import resume_config
    from engine.run import setup_run
    straight = encoder_run(corpus, tmp_path, "straight", 8, every=4)
    broken = encoder_run(corpus, tmp_path, "broken", 4, every=4)
    cfg, run_dir, ckpt = resume_config(str(broken.run_dir), str(tmp_path / "runs"),
                                       {"train": {"max_iters": "8"}})
    train(setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a, **k: None))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s", "mfu")}
                        for r in rs]
    assert strip(records(run_dir)) == strip(records(straight.run_dir))


def test_an_encoder_run_is_refused_by_sample_and_filled_by_fill(encoder20):
    from conftest import run_script
    from attnlab.fill import fill
    from engine.inference import load_run
    run = encoder20
    refused = run_script("sample.py", "--run", run.run_dir, check=False)
    assert refused.returncode != 0
    line, = [l for l in refused.stderr.splitlines() if l.startswith("error:")]
    assert "python -m attnlab.fill --run" in line and "Traceback" not in refused.stderr
    assert line.endswith("or sample another run with --run DIR")     # a learner who meant a decoder
    model, _, tokenizer, _ = load_run(run.run_dir)
    (position, guesses), = fill(model, tokenizer, "To be, or not to [MASK]e", top=3)
    assert position == len("To be, or not to ") and len(guesses) == 3
    probs = torch.softmax(model(torch.tensor([tokenizer.encode("To be, or not to [MASK]e")])).logits[0, position], -1)
    assert [p for _, p in guesses] == pytest.approx(probs.topk(3).values.tolist(), abs=1e-6)


def test_the_masked_objective_is_refused_on_a_causal_model():
    from common.errors import ConfigError
    from engine import cli
    with pytest.raises(ConfigError, match="model.causal=false"):
        cli.build("encoder", ["--model.causal=true"])


def test_the_leak_demo_shows_the_loss_collapse_the_look_ahead_and_the_last_position(corpus, tmp_path,
                                                                                     capsys):
    """python -m attnlab.article leak, cut to a 1-layer, 1-head model and 120 steps: the
    non-causal run's training loss falls far below the causal one's, its head looks one
    step ahead, and at the last position (where generation reads) it is worse than the
    causal model, since there was never a next token there to copy."""
    from attnlab.article import leak, leak_figure
    honest, leaked = leak(120, tmp_path / "runs", str(corpus), sample_tokens=30,
                          extra=("--model.n_layer=1", "--model.n_head=1",
                                 f"--data.cache_dir={tmp_path / 'cache'}"))
    assert honest.causal and not leaked.causal
    assert honest.train_loss > 2.0 and leaked.train_loss < 0.5 * honest.train_loss
    assert honest.next_mass == 0 and leaked.next_mass > 0.6
    assert leaked.last_loss > honest.last_loss
    assert len(leaked.sample) >= 30 and len(honest.sample) >= 30
    assert leak_figure([honest, leaked], tmp_path / "leak.png").stat().st_size > 0
    # sample.py refuses the leaked run in one line that sends its user to the demo.
    import sample
    from engine.cli import errors_as_lines
    capsys.readouterr()
    with pytest.raises(SystemExit), errors_as_lines():
        sample.main(["--run", str(tmp_path / "runs" / "not-causal")])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "attnlab.article leak" in err[0]


def test_the_head_tools_open_an_encoder_run(encoder20, tmp_path, capsys):
    from attnlab import heads
    run_dir = str(encoder20.run_dir)
    assert heads.main(["grid", "--run", run_dir, "--text", "To be, or not", "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").stat().st_size > 0
    capsys.readouterr()
    assert heads.main(["search", "--run", run_dir, "--text", "To be, or not", "--from", "or", "--to", "be"]) == 0
    assert "or → be" in capsys.readouterr().out


def test_fill_past_the_trained_context_warns_or_refuses_as_the_head_tools_do(tmp_path, capsys):
    """Learned positions end at their table: refused in one line. RoPE goes on past the
    trained context: one warning line, and the guesses still come."""
    from test_interop_bert import _tiny

    from attnlab.fill import fill
    from common.errors import AttnlabError
    from engine.interop import load_hf_folder
    _tiny("bert", tmp_path / "hf")                            # 40 learned positions
    learned, _, tokenizer = load_hf_folder(tmp_path / "hf")
    long_text = "the cat sat on the mat " * 8 + "[MASK]"
    assert len(tokenizer.encode(long_text)) > learned.config.block_size
    with pytest.raises(AttnlabError, match="reads at most 40"):
        fill(learned, tokenizer, long_text)
    torch.manual_seed(0)
    rope = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16,
                           position="rope", causal=False, readout="mlm", bias=True)).eval()
    capsys.readouterr()
    (position, guesses), = fill(rope, tokenizer, long_text, top=2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the text is 51 tokens, past the 16")
    assert len(guesses) == 2
    fill(rope, tokenizer, "the cat [MASK]")                 # within the context: nothing said
    assert capsys.readouterr().err == ""


def adopted(argv):
    """The config train.py --config finetune trains with, for these options."""
    from engine import cli
    from engine.pretrained import adopt_source
    parser = cli.Parser("python train.py", add_help=False)
    cli.add_config_options(parser)
    given = cli.overrides_of(parser.parse_args(argv))
    cfg = cli.build("finetune", argv)
    adopt_source(cfg, given.get("model", {}), given.get("train", {}))
    return cfg


def test_fine_tuning_an_encoder_keeps_its_objective_and_refuses_the_leak(encoder20, corpus, tmp_path):
    from common.errors import ConfigError
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    src = f"--train.init_from={encoder20.run_dir}"
    cfg = adopted([src])
    assert (cfg.train.objective, cfg.model.causal) == ("mlm", False)
    assert adopted([src, "--train.objective=mlm"]).train.objective == "mlm"
    with pytest.raises(ConfigError, match="is an encoder .*model.causal=false.*train.objective=next"):
        adopted([src, "--train.objective=next"])
    cfg = adopted([src, "--train.objective=next", "--model.causal=true"])
    assert (cfg.train.objective, cfg.model.causal) == ("next", True)
    # A decoder source is as before: the preset's next-token objective, causal.
    out = tmp_path
    decoder = setup_run(cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
                                           f"--train.out_dir={out / 'runs'}", "--train.run_name=dec",
                                           "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=2",
                                           "--model.block_size=16", "--train.max_iters=1",
                                           "--train.eval_iters=1"]), log=lambda *a, **k: None)
    train(decoder)
    cfg = adopted([f"--train.init_from={decoder.run_dir}"])
    assert (cfg.train.objective, cfg.model.causal) == ("next", True)
    with pytest.raises(ConfigError, match="model.causal=true hides"):
        adopted([f"--train.init_from={decoder.run_dir}", "--train.objective=mlm"])
