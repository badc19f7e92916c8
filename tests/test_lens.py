"""Editing the forward pass (attnlab/lens.py): ablation against editing the weights,
patching against its identity case, and the lens, ablate, patch and induction commands.
What is read from a model is tested in tests/test_capture.py."""
import re
import pytest
import torch

from attnlab.lens import ablate, patch, run_with_cache
from conftest import small_model as model_for




TOKENS = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(1))


def test_zero_ablating_a_head_equals_zeroing_its_columns_of_w_o():
    model = model_for()
    D = model.config.head_dim
    with ablate(model, heads=[(1, 2)]), torch.no_grad():
        ablated = model(TOKENS).logits
    edited = model_for()
    with torch.no_grad():
        edited.blocks[1].attn.w_o.weight[:, 2 * D:3 * D] = 0
        torch.testing.assert_close(ablated, edited(TOKENS).logits, atol=1e-6, rtol=0)
        assert (ablated - model(TOKENS).logits).abs().max() > 1e-3    # it did something
        assert torch.equal(model(TOKENS).logits, edited(TOKENS).logits) is False


def test_ablating_nothing_is_bit_identical_and_hooks_leave_no_trace():
    model = model_for()
    with torch.no_grad():
        before = model(TOKENS, TOKENS).loss
        with ablate(model):
            same = model(TOKENS, TOKENS).loss
        run_with_cache(model, TOKENS)
        after = model(TOKENS, TOKENS).loss
    assert torch.equal(before, same) and torch.equal(before, after)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_mean_ablation_and_mlp_ablation():
    model = model_for()
    _, reference = run_with_cache(model, TOKENS)
    with ablate(model, mlps=[0]), torch.no_grad():
        _, cache = run_with_cache(model, TOKENS, only=["blocks.0.mlp_out"])
    assert (cache["blocks.0.mlp_out"] == 0).all()
    with ablate(model, heads=[(0, 1)], mode="mean", means=reference), torch.no_grad():
        _, cache = run_with_cache(model, TOKENS, only=["blocks.0.z"])
    mean = reference["blocks.0.z"][..., 1, :].mean(dim=(0, 1))
    torch.testing.assert_close(cache["blocks.0.z"][..., 1, :], mean.expand(2, 12, -1))


def test_patching_a_prompt_into_itself_changes_nothing_and_into_another_moves_it():
    model = model_for()
    clean_logits, clean = run_with_cache(model, TOKENS)
    corrupt = TOKENS.clone()
    corrupt[:, 3] = (corrupt[:, 3] + 1) % 30
    patched = ["blocks.0.resid_pre", "blocks.1.attn_out", "blocks.0.mlp_out", "blocks.1.z"]
    corrupt_logits, own = run_with_cache(model, corrupt, only=patched)   # the model's own backend
    for name in patched:
        with patch(model, own, [name]), torch.no_grad():
            assert torch.equal(model(corrupt).logits, corrupt_logits)
    with patch(model, clean, ["blocks.1.resid_pre"]), torch.no_grad():   # everything after it
        torch.testing.assert_close(model(corrupt).logits, clean_logits, atol=1e-5, rtol=0)
    with patch(model, clean, ["blocks.0.resid_pre"], positions=[3]), torch.no_grad():
        torch.testing.assert_close(model(corrupt).logits, clean_logits, atol=1e-5, rtol=0)
    with patch(model, clean, ["blocks.0.resid_pre"], positions=[2]), torch.no_grad():
        assert (model(corrupt).logits - clean_logits)[:, 3:].abs().max() > 1e-3


@pytest.mark.usefixtures("one_thread")
def test_the_induction_detector_finds_the_circuit_a_short_training_grows():
    """A seeded 2-layer attention-only model, trained here (about 15 s), copies the
    repeated half; the detector names a previous-token head in layer 0 and an
    induction head in layer 1, and switching the induction heads off undoes the copying."""
    from attnlab.induction import (INDUCTION_THRESHOLD, half_losses, head_scores, report,
                                   repeated_sequences, train_attention_only)
    model = train_attention_only(steps=3000, log=lambda *a: None)
    prev, induct = head_scores(model, span=12)
    assert induct[1].max() >= 0.5 and induct[0].max() < 0.2          # induction lives in layer 1
    assert prev[0].max() >= 0.4                                       # fed by a previous-token head
    x = repeated_sequences(64, 12, 64, torch.Generator().manual_seed(99))
    first, second = half_losses(model, x, 12)
    heads = [(1, h) for h in range(4) if induct[1, h] >= INDUCTION_THRESHOLD]
    _, without = half_losses(model, x, 12, heads=heads)
    assert second < 0.5 < first - 2 and without > first - 1
    said = []
    report(model, 12, log=said.append)
    assert re.fullmatch(r"previous-token head: layer 0, head \d \(score 0\.\d+\); induction "
                        r"head: layer 1, head \d \(score 0\.\d+\)", said[-1])


def test_the_detector_names_no_induction_head_where_none_copies():
    """An untrained model's best induction score is far under the threshold: it is
    reported as no induction head, not as the head that happens to score highest."""
    from attnlab.induction import report
    torch.manual_seed(0)
    said = []
    prev, induct, _, _ = report(model_for(vocab_size=64, block_size=32), 12, vocab=64, log=said.append)
    assert induct.max() < 0.5 and prev.max() < 0.3
    assert re.fullmatch(r"no previous-token head \(none scores 0\.3 or more; the best, layer \d, "
                        r"head \d, scores 0\.\d+\); no induction head \(none scores 0\.5 or "
                        r"more; the best, layer \d, head \d, scores 0\.\d+\)", said[-1])


@pytest.mark.parametrize("span", ["0", "-5", "3"])
def test_the_induction_experiment_refuses_a_span_it_cannot_repeat(span):
    from attnlab.induction import main
    from common.errors import AttnlabError
    with pytest.raises((AttnlabError, SystemExit)):
        main(["--span", span, "--steps", "1"])


@pytest.mark.parametrize("argv, says", [
    (["logit"], "give some text with --text"),
    (["ablate"], "give some text with --text"),
    (["patch"], "patch needs --clean TEXT and --corrupt TEXT"),
    (["patch", "--clean", "abc"], "patch needs --clean TEXT and --corrupt TEXT"),
    (["patch", "--text", "abc"], "patch needs --clean TEXT and --corrupt TEXT"),
    (["patch", "--clean", "abcdefgh abcdefgh", "--corrupt", "abcdefgh abcdefga"],
     "give a shorter --clean"),
])
def test_each_study_asks_for_the_options_it_takes(argv, says, tmp_path):
    """patch reads --clean and --corrupt, never --text: its refusals name its own options."""
    from attnlab import lens
    from common.errors import AttnlabError
    from data.tokenizer import CharTokenizer
    from engine.interop import export
    tok = CharTokenizer("abcdefgh ")
    model = model_for(vocab_size=tok.vocab_size, position="learned")      # 16 positions
    export(model, model.config, tok, tmp_path / "m")
    with pytest.raises(AttnlabError) as caught:
        lens.main([*argv, "--run", str(tmp_path / "m"), "--out", str(tmp_path), "--device", "cpu"])
    assert says in str(caught.value)
    assert ("--text" in str(caught.value)) == (argv[0] != "patch"), caught.value


def test_lens_ablate_patch_and_induction_commands(tmp_path, capsys):
    from attnlab import induction, lens
    from common.errors import AttnlabError
    from conftest import run_script
    from engine.interop import export
    from data.tokenizer import CharTokenizer
    tok = CharTokenizer("abcdefgh ")
    model = model_for(vocab_size=tok.vocab_size, position="learned")
    export(model, model.config, tok, tmp_path / "m")          # any loadable model will do
    run = ["--run", str(tmp_path / "m"), "--out", str(tmp_path), "--device", "cpu"]
    # Each names the figure it wrote as attnlab.figures does: "wrote PATH", not a bare path.
    lens.main(["logit", "--text", "abc defg", *run])
    out = capsys.readouterr().out
    assert out.count("\n") >= 3 and (tmp_path / "logit_lens.png").is_file()
    assert f"wrote {tmp_path / 'logit_lens.png'}\n" in out
    lens.main(["ablate", "--text", "abc defg", *run])
    out = capsys.readouterr().out
    assert "layer 1, head" in out and (tmp_path / "head_ablation.png").is_file()
    assert f"wrote {tmp_path / 'head_ablation.png'}\n" in out
    lens.main(["patch", "--clean", "abc defg", "--corrupt", "abd defg", *run])
    out = capsys.readouterr().out
    assert "recovered" in out and (tmp_path / "patching.png").is_file()
    assert f"wrote {tmp_path / 'patching.png'}\n" in out
    with pytest.raises(AttnlabError, match="equal length"):
        lens.main(["patch", "--clean", "abc", "--corrupt", "ab", *run])
    induction.main(run)
    out = capsys.readouterr().out
    assert re.search(r"previous-token head.*; (no )?induction head", out)
    assert f"wrote {tmp_path / 'induction_heads.png'}\n" in out
    assert (tmp_path / "induction_heads.png").is_file()
    # --out is a folder for the figure, made where missing, as its help says (a folder not
    # there yet used to become the figure's own name, new.png), or the figure's own name.
    induction.main([*run[:2], "--out", str(tmp_path / "new"), "--device", "cpu"])
    assert f"wrote {tmp_path / 'new' / 'induction_heads.png'}\n" in capsys.readouterr().out
    induction.main([*run[:2], "--out", str(tmp_path / "mine.svg"), "--device", "cpu"])
    assert f"wrote {tmp_path / 'mine.svg'}\n" in capsys.readouterr().out
    assert (tmp_path / "mine.svg").read_text().lstrip().startswith("<?xml")
    # The spelling these had as subcommands of heads still runs them, with the same options.
    (tmp_path / "logit_lens.png").unlink()
    lens_again = run_script("-m", "attnlab.heads", "lens", "--text", "abc defg", *run)
    assert lens_again.stdout.count("\n") >= 3 and (tmp_path / "logit_lens.png").is_file()
    unequal = run_script("-m", "attnlab.heads", "patch", "--clean", "abc", "--corrupt", "ab",
                         *run, check=False)
    assert unequal.returncode == 2 and "equal length" in unequal.stderr


# -- switching a model-card piece off ------------------------------------------------------

def plain_twin(model, **fields):
    """The model's weights in a model whose layers are plain multi-head attention: what
    the piece adds (a sink logit, W_G, the indexer) left behind, checked by name."""
    twin = model_for(**fields)
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(n.split(".")[-2] in ("sinks", "w_gate", "w_iq", "w_ik", "ik_norm", "w_iw")
                               or n.endswith(".sinks") for n in unexpected) and unexpected
    return twin


@pytest.mark.parametrize("mechanism,piece", [("sinks", "sink"), ("gated", "gate"), ("sparse", "chosen")])
def test_a_piece_switched_off_is_plain_attention_with_the_same_weights(mechanism, piece):
    """The sink removed, the gates held open, the indexer off: each layer is then the
    article's multi-head attention, which a model built without the piece computes."""
    from attnlab.lens import switched_off
    fields = {"position": "none" if mechanism == "sparse" else "rope"}
    model = model_for(mechanism=mechanism, sparse_top_k=3, **fields) if mechanism == "sparse" else \
        model_for(mechanism=mechanism, **fields)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with torch.no_grad():
        own = model(TOKENS).logits
        with switched_off(model, 0, piece), switched_off(model, 1, piece):
            off = model(TOKENS).logits
        assert (off - own).abs().max() > 1e-4                              # it did something
        torch.testing.assert_close(off, plain_twin(model, **fields)(TOKENS).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(TOKENS).logits, own, atol=0, rtol=0)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert not any(m._forward_hooks or "dense_warmup" in vars(m) for m in model.modules())


def test_an_expert_switched_off_equals_zeroing_its_down_projection():
    from attnlab.lens import switched_off
    fields = dict(mlp="moe", moe_experts=4, moe_top_k=2, moe_shared=1, bias=True)
    model, edited = model_for(**fields), model_for(**fields)
    with torch.no_grad():
        edited.blocks[1].mlp.proj.weight[1 + 2].zero_()                   # after the one shared expert
        edited.blocks[1].mlp.proj.bias[1 + 2].zero_()
        with switched_off(model, 1, "experts", expert=2):
            off = model(TOKENS).logits
        torch.testing.assert_close(off, edited(TOKENS).logits, atol=1e-6, rtol=0)
        assert (off - model(TOKENS).logits).abs().max() > 1e-5
    assert not any("expert" in vars(m) for m in model.modules())


def test_lens_pieces_prints_each_pieces_loss_change(tmp_path, monkeypatch, capsys):
    """The printed change is the loss of the plain twin (the piece left out) minus the
    model's, for each layer alone; an expert's, the loss with its down projection zeroed."""
    from attnlab import lens
    from common.errors import AttnlabError
    from data.tokenizer import CharTokenizer
    text = "the trophy did not fit in the suitcase"
    tok = CharTokenizer(set(text))
    fields = dict(vocab_size=tok.vocab_size, block_size=64)
    model = model_for(mechanism="sinks,gated", mlp="moe", moe_experts=3, moe_top_k=1, **fields)
    monkeypatch.setattr(lens, "load", lambda args: (model, None, tok, tmp_path / "ckpt"))
    lens.main(["pieces", "--text", text, "--out", str(tmp_path / "x.png")])
    out = capsys.readouterr().out
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        base = model(ids[:, :-1], ids[:, 1:]).loss.item()
        assert f"loss of the text {base:.4f}" in out
        for layer, words in ((0, "sink removed"), (1, "gates held open")):
            mixed = model_for(mechanism="mha,gated" if layer == 0 else "sinks,mha", mlp="moe",
                              moe_experts=3, moe_top_k=1, **fields)
            mixed.load_state_dict(model.state_dict(), strict=False)
            change = float(re.search(rf"layer {layer}, {words}.*: ([+-][\d.]+)", out)[1])
            assert change == pytest.approx(mixed(ids[:, :-1], ids[:, 1:]).loss.item() - base, abs=6e-5)
        edited = model_for(mechanism="sinks,gated", mlp="moe", moe_experts=3, moe_top_k=1, **fields)
        edited.blocks[1].mlp.proj.weight[1 + 2].zero_()                   # after the one shared expert
        row = re.search(r"^\s+1 (.*)$", out.split("expert 2")[1], re.M)[1].split()
        assert float(row[2]) == pytest.approx(edited(ids[:, :-1], ids[:, 1:]).loss.item() - base, abs=6e-5)
    monkeypatch.setattr(lens, "load", lambda args: (model_for(**fields), None, tok, tmp_path / "ckpt"))
    with pytest.raises(AttnlabError, match="has no model-card piece to switch off"):
        lens.main(["pieces", "--text", text, "--out", str(tmp_path / "x.png")])
