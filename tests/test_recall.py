"""The retrieval lab (attnlab/recall_task.py, attnlab/recall.py): the task says what it
claims, a tiny model learns it far above chance, the lab writes its heatmaps, and the
same command reads a transformers folder with the task in that folder's tokens."""
import random
import re
import warnings

import pytest
import torch

from attnlab import recall
from attnlab.recall_task import FACT, KEYS, TokenTask, char_task
from data.tokenizer import BPETokenizer, CharTokenizer


pytestmark = pytest.mark.usefixtures("one_thread")       # tiny models, trained here


@pytest.fixture(scope="module")
def chars():
    return char_task(digits=2, chars=20_000)


@pytest.fixture(scope="module")
def bpe_task(chars):
    # A byte-level BPE: the fact, question and answer merge differently from characters.
    text = chars.tokenizer.decode(chars.filler[:20_000].tolist())
    return TokenTask(BPETokenizer.train([text], 400), text, digits=3)


@pytest.mark.parametrize("which", ["chars", "bpe_task"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_answer_is_the_one_fact_in_the_text_and_the_depth_lands_where_asked(which, depth, request):
    task = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(int(depth * 10))
    for length in (96, 160):
        ex = task.example(length, depth, g)
        assert len(ex.ids) == length
        text = task.tokenizer.decode(ex.ids.tolist())
        facts = FACT.findall(text)
        assert facts == [(ex.key, ex.value)]                   # one fact, and it holds the answer
        assert task.tokenizer.decode(ex.answer.tolist()).strip() == ex.value
        # The text ends by asking for this key's code: the answer follows from the text alone.
        full = task.tokenizer.decode(ex.ids.tolist() + ex.answer[-1:].tolist())
        assert full.endswith(f"The code for {ex.key} is {ex.value}")
        # The fact starts after round(depth * F) of the F filler tokens.
        assert ex.fact_at == round(depth * ex.filler)
        before = task.tokenizer.decode(ex.ids[ex.fact_at:].tolist())
        assert before.startswith(f" The code for {ex.key} is")
        assert ex.ids[ex.value_at:ex.value_at + len(ex.answer)].tolist() == ex.answer.tolist()
        assert ex.answer_at.tolist() == list(range(length - len(ex.answer), length))
        assert len(re.findall(r"\d", full)) == 2 * len(ex.value)    # no other digit anywhere


def test_a_fact_that_does_not_fit_is_refused(chars):
    with pytest.raises(ValueError, match="cannot hold"):
        chars.example(20, 0.5, torch.Generator())
    with pytest.raises(ValueError, match="depth"):
        chars.example(96, 1.5, torch.Generator())


def test_a_tiny_model_retrieves_far_above_chance():
    # Random letters as filler and a one-letter phrase keep the context at 24 tokens,
    # so a one-layer model learns to find the one digit in a few seconds.
    rng = random.Random(0)
    filler = "".join(rng.choice("abcdefghij ") for _ in range(4000))
    task = TokenTask(CharTokenizer(set(filler) | set(KEYS) | set("0123456789 .")), filler,
                     digits=1, phrase="{key}")
    base = dict(recall.BASE)
    try:
        recall.BASE.update(n_layer=1, n_head=2, n_embd=32)
        model = recall.train_variant(task, recall.Variant("", {"position": "rope"}), 24, 200,
                                     lr=1e-2, log=lambda *a: None)
    finally:
        recall.BASE.clear()
        recall.BASE.update(base)
    rows = recall.grid(model, task, 24, [1], [0.0, 0.5, 1.0], 32)
    accuracy = sum(r["correct"] for r in rows) / len(rows)
    assert accuracy >= 0.6 > 5 * task.chance


def test_the_lab_writes_a_heatmap_per_variant_and_the_table(tmp_path, capsys):
    out = tmp_path / "lab"
    recall.main(["--variants", "learned", "window16x2", "--steps", "2", "--factors", "1", "2",
                 "--depths", "2", "--examples", "2", "--out", str(out)])
    assert "learned                2x (  192 tokens): n/a, learned positions stop at 96" in capsys.readouterr().out
    for name in ("recall_learned.png", "recall_window16x2.png", "recall_heatmaps.png",
                 "recall_distance.png"):
        assert (out / name).stat().st_size > 1000
    table = (out / "recall.md").read_text()
    assert "chance 1%" in table
    assert re.search(r"\| learned \| \d+% \| n/a \|", table)     # no positions past its table
    assert re.search(r"\| window16x2 \| 16 \| 2 \| 31 \| ", table)    # and the windows by distance
    # Drawn again from the table's rows, as read back from recall.csv: the same tables.
    recall.main(["--merge", str(out), "--out", str(tmp_path / "again")])
    again = (tmp_path / "again" / "recall.md").read_text()
    assert again == table and "| learned | 0 |" not in again


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_the_lab_tests_a_transformers_folder_in_its_own_tokens(layout, chars, tmp_path):
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    folder = tmp_path / layout
    text = chars.tokenizer.decode(chars.filler[:20_000].tolist())
    bpe = BPETokenizer.train([text], 400)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.hf, eos_token="<|endoftext|>").save_pretrained(folder)
    torch.manual_seed(0)
    if layout == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=bpe.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=bpe.vocab_size, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=64))
    hf.save_pretrained(folder)
    out = tmp_path / "out"
    recall.main(["--model", str(folder), "--factors", "1", "2", "--depths", "2",
                 "--examples", "2", "--out", str(out)])
    table = (out / "recall.md").read_text()
    assert f"| {layout} |" in table and "chance 1%" in table
    assert (out / f"recall_{layout}.png").is_file()
    if layout == "gpt2":                                 # learned positions: 64, no further
        assert f"| {layout} | 0% | n/a |" in table
    else:                                                # RoPE: the scalings are tested too
        assert "| llama + YaRN |" in table
    if layout == "gpt2":                                 # past its positions: refused up front
        with pytest.raises(recall.AttnlabError, match="give --context at most 64"):
            recall.main(["--model", str(folder), "--context", "128", "--out", str(out)])


def test_the_short_task_fits_a_small_window_and_batches_keep_the_fact_near_when_asked():
    task = char_task(digits=2, chars=20_000, short=True)
    g = torch.Generator().manual_seed(0)
    ex = task.example(64, 1.0, g)
    text = task.tokenizer.decode(ex.ids.tolist() + ex.answer[-1:].tolist())
    assert text.endswith(f" {ex.key} is {ex.value}. {ex.key} is {ex.value}")
    assert task.distance(ex) == task.nearest() == len(f" {ex.key} is {ex.value}.")
    body = text[:-len(f" {ex.key} is {ex.value}. {ex.key} is {ex.value}")]
    assert set(body) <= set("abcdefghijklmnopqrstuvwxyz ")          # the filler: letters alone
    x, y = task.batch(64, 64, g, reach=0.25)
    distances = (y >= 0).float().argmax(1) - (x == task.tokenizer.encode(".")[0]).float().argmax(1)
    filler = task.example(64, 0.0, g).filler
    # The fact's "." ends it; with reach r the fact sits in the nearest r of the filler.
    assert distances.max() <= task.nearest() + 0.25 * filler + 1
    assert distances.max() > task.nearest() + 0.1 * filler              # and spreads over it


@pytest.mark.parametrize("window, layers", [(10, 1), (4, 3), (6, 2)])
def test_a_window_stack_reaches_exactly_as_far_back_as_the_lab_says(window, layers):
    # Change the fact's first digit at each distance and see whether the prediction of
    # the question's first digit moves: it must for every distance up to reach(W, L)
    # (random weights move it by chance-free amounts) and never beyond, by the mask.
    from model import GPT, ModelConfig
    task = char_task(digits=2, chars=20_000, short=True)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=task.tokenizer.vocab_size, block_size=48, n_layer=layers,
                            n_head=2, n_embd=16, sliding_window=window)).eval()
    digit = {task.tokenizer.encode(str(d))[0] for d in range(10)}
    reached = []
    g = torch.Generator().manual_seed(1)
    for depth in [i / 30 for i in range(31)]:
        ex = task.example(48, depth, g)
        other = ex.ids.clone()
        at = ex.value_at + 1                                     # the fact's first digit
        assert int(other[at]) in digit
        other[at] = min(digit - {int(other[at])})
        with torch.no_grad():
            a, b = (model(x[None]).logits[0, ex.answer_at[1]] for x in (ex.ids, other))
        reached.append((task.distance(ex), not torch.equal(a, b)))
    far = recall.reach(window, layers)
    assert all(moved == (d <= far) for d, moved in reached), (far, reached)
    assert any(d <= far for d, _ in reached) and any(d > far for d, _ in reached)


def rows_csv(folder, variant, factors, digits=None, context=96, na=()):
    """A recall.csv as a run writes it (digits None: from before the lab recorded them)."""
    folder.mkdir(parents=True, exist_ok=True)
    head = "variant,factor,length,depth,distance,correct,window,layers,global,about,context,digits"
    lines = [head if digits else head.rsplit(",", 2)[0]]
    for f in factors:
        for d in (0.0, 1.0):
            fact = "" if f in na else "True"
            cells = [variant, f, f * context, d, "" if f in na else 10, fact, 0, 2, 0, variant]
            lines.append(",".join(map(str, cells + ([context, digits] if digits else []))))
    (folder / "recall.csv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.parametrize("argv, says", [
    (["--digits", "0"], "from 1 to 9"), (["--digits", "-1"], "from 1 to 9"),
    (["--variants", "rope", "--merge", "x"], "give one or the other"),
    (["--variants", "rope", "--model", "x"], "give one or the other"),
    # An allocation of 256 TB, and a ValueError from a filler too short, each a traceback.
    (["--context", "1000000000000", "--steps", "1"], "'1000000000000' is not a whole number from 0 to 8,192"),
    (["--factors", "1000000", "--steps", "1", "--variants", "rope"], "from 1 to 64"),
    (["--context", "4096", "--factors", "1", "64", "--variants", "rope"], "examples of 262,144 tokens"),
    (["--steps", "0"], "from 1 to 1,000,000"), (["--depths", "1000000000"], "from 2 to 101"),
    (["--context", "10", "--variants", "rope"], "leaves no room for filler")])
def test_the_lab_refuses_bad_options_before_training(argv, says, tmp_path, monkeypatch):
    monkeypatch.setattr(recall, "train_variant", lambda *a, **k: pytest.fail("trained first"))
    with pytest.raises(recall.AttnlabError, match=says):
        recall.main([*argv, "--out", str(tmp_path / "out" / "recall")])
    assert not (tmp_path / "out").exists()          # a refusal leaves no empty --out behind


def test_an_out_that_cannot_be_written_is_refused_before_any_training(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(recall, "train_variant", lambda *a, **k: pytest.fail("trained first"))
    with pytest.raises(recall.AttnlabError, match="is a file, not a folder"):
        recall.main(["--variants", "rope", "--out", str(tmp_path / "file")])
    with pytest.raises(recall.AttnlabError, match="cannot be written"):
        recall.main(["--variants", "rope", "--out", str(tmp_path / "file" / "below")])


@pytest.mark.parametrize("damage", ["variant,factor\nrope", "variant,factor,length,depth,distance,"
                                    "correct\nrope,abc,96,0.0,1,True", ""])
def test_a_damaged_csv_is_refused_with_its_path(damage, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recall.csv").write_text(damage)
    with pytest.raises(recall.AttnlabError, match=re.escape(str(tmp_path / "run" / "recall.csv"))):
        recall.main(["--merge", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_merge_takes_chance_and_context_from_the_runs_and_marks_cells_never_run(tmp_path):
    a = rows_csv(tmp_path / "a", "learned", [1, 2], digits=1, na=(2,))
    b = rows_csv(tmp_path / "b", "rope", [1, 2, 4], digits=1)
    recall.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "recall.md").read_text()
    assert "chance 10%" in table and "trained context 96 tokens" in table
    assert "| learned | 100% | n/a | - |" in table and "| rope | 100% | 100% | 100% |" in table
    c = rows_csv(tmp_path / "c", "alibi", [1], digits=1, context=128)
    with pytest.raises(recall.AttnlabError, match="one context"):
        recall.main(["--merge", str(a), str(c), "--out", str(tmp_path / "out")])
    old = rows_csv(tmp_path / "old", "rope", [1])        # no digits kept: --digits says
    recall.main(["--merge", str(old), "--digits", "1", "--out", str(tmp_path / "out")])
    assert "chance 10%" in (tmp_path / "out" / "recall.md").read_text()


def test_an_out_used_before_keeps_the_other_variants_and_replaces_the_ones_run_again(tmp_path):
    out = rows_csv(tmp_path / "out", "learned", [1], digits=2)
    rows_csv(tmp_path / "keep", "rope", [1], digits=2)
    (out / "recall.csv").write_text((out / "recall.csv").read_text() + "".join(
        (tmp_path / "keep" / "recall.csv").read_text().splitlines(True)[1:]))
    recall.main(["--variants", "learned", "--steps", "2", "--factors", "1", "--depths", "2",
                 "--examples", "2", "--out", str(out)])
    rows = recall.read_rows(out)
    assert sorted({r["variant"] for r in rows}) == ["learned", "rope"]
    assert sum(r["variant"] == "learned" for r in rows) == 2 * 2          # replaced, not added
    assert sum(r["variant"] == "rope" for r in rows) == 2                 # kept as it was
    with pytest.raises(recall.AttnlabError, match="give another --out"):
        recall.main(["--variants", "learned", "--context", "128", "--out", str(out)])


def test_a_stopped_run_resumes_without_training_the_variants_it_finished(tmp_path, monkeypatch):
    out, trained = tmp_path / "out", []
    real = recall.train_variant

    def stopped_at_alibi(task, variant, *a, **k):
        if variant is recall.VARIANTS["alibi"]:
            raise KeyboardInterrupt                  # Ctrl-C while the second variant trains
        trained.append(variant)
        return real(task, variant, *a, **k)

    monkeypatch.setattr(recall, "train_variant", stopped_at_alibi)
    argv = ["--variants", "learned", "alibi", "--steps", "2", "--factors", "1", "--depths", "2",
            "--examples", "2", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        recall.main(argv)
    before = recall.read_rows(out)
    assert {r["variant"] for r in before} == {"learned"}
    monkeypatch.setattr(recall, "train_variant", lambda task, variant, *a, **k: (
        trained.append(variant), real(task, variant, *a, **k))[1])
    recall.main(argv + ["--resume"])
    assert trained == [recall.VARIANTS["learned"], recall.VARIANTS["alibi"]]   # learned once only
    after = recall.read_rows(out)
    assert [r for r in after if r["variant"] == "learned"] == [r for r in before if r["variant"] == "learned"]
    assert sum(r["variant"] == "alibi" for r in after) == 2 * 2
    # Other options than the ones it was measured with: trained again, not kept.
    trained.clear()
    recall.main([*argv[:4], "3", *argv[5:], "--resume"])
    assert trained == [recall.VARIANTS["learned"], recall.VARIANTS["alibi"]]
    with pytest.raises(recall.AttnlabError, match="leave --resume out"):
        recall.main(["--merge", str(out), "--resume", "--out", str(tmp_path / "m")])
