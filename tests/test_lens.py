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
