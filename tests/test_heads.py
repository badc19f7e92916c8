"""Looking inside attention (attnlab/heads.py): a planted pattern is found."""
import math
import re

import numpy as np
import pytest
import torch

from attnlab.capture import attention_maps
from attnlab.heads import head_stats, save_grid, save_head, search, token_spans
from data.tokenizer import CharTokenizer
from model import GPT, ModelConfig


def planted_model(tokenizer, source: str, target: str, layer: int = 1, head: int = 1):
    """A 2-layer model whose attention is set by hand: in (layer, head) the query of
    `source` matches only the key of `target`; every other head attends uniformly."""
    V = tokenizer.vocab_size
    model = GPT(ModelConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=2 * V, block_size=64,
                            position="none", norm="rmsnorm", mlp="gelu_tanh")).eval()
    D = model.config.head_dim
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.wte.weight.copy_(torch.eye(V, 2 * V))            # token t -> unit vector e_t
        for block in model.blocks:
            block.norm_attn.weight.fill_(1.0)
            block.norm_mlp.weight.fill_(1.0)
        a, b = tokenizer.encode(source)[0], tokenizer.encode(target)[0]
        w = model.blocks[layer].attn.w_qkv.weight              # rows: q heads, k heads, v heads
        w[head * D, a] = 20.0                                  # query of `source` ...
        w[(2 + head) * D, b] = 20.0                            # ... matches the key of `target`
    return model


def test_head_search_finds_the_planted_head():
    text = "the trophy did not fit because it was big"
    tok = CharTokenizer(set(text))
    model = planted_model(tok, "t", "y", layer=1, head=1)     # the "t" of "it" -> the "y"
    tokens, maps = attention_maps(model, tok, text)
    assert len(maps) == 2 and maps[0].shape == (2, len(text), len(text))
    ranking, query, targets = search(maps, text, token_spans(tok, text), "it", "trophy")
    weight, layer, head = ranking[0]
    assert (layer, head) == (1, 1) and weight > 0.99
    assert tokens[query] == "t" and "".join(tokens[t] for t in targets) == "trophy"
    assert ranking[1][0] < 0.5                 # the uniform heads give "trophy" its share only


def test_head_statistics_label_recognisable_patterns():
    T = 12
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1
    sink = torch.zeros(T, T)
    sink[:, 0] = 1
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    assert head_stats(previous)["label"] == "previous-token head"
    assert head_stats(previous)["mean_distance"] == 1.0
    assert head_stats(sink)["label"] == "first-token (sink) head"
    # `first` is the mean weight on token 0 over the queries that have a choice (1..T-1):
    # a causal uniform head gives query i a weight of 1/(i+1) there.
    assert head_stats(sink)["first"] == 1.0
    assert head_stats(uniform)["first"] == pytest.approx(sum(1 / (i + 1) for i in range(1, T)) / (T - 1))
    assert head_stats(previous)["first"] == pytest.approx(1 / (T - 1))
    assert head_stats(uniform)["entropy"] > head_stats(previous)["entropy"] == 0


def test_heatmaps_are_written_as_png(tmp_path):
    text = "to be or not"
    tok = CharTokenizer(set(text))
    model = planted_model(tok, "o", "t")
    tokens, maps = attention_maps(model, tok, text)
    for path in (save_grid(tmp_path / "grid.png", tokens, maps),
                 save_head(tmp_path / "head.png", tokens, maps[1][1], 1, 1)):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bertviz_head_view_exports_a_complete_html_file(tmp_path):
    import json
    import re
    text = "to be or not"
    tok = CharTokenizer(set(text))
    tokens, maps = attention_maps(planted_model(tok, "o", "t"), tok, text)
    from attnlab.heads import export_head_view
    html = export_head_view(tmp_path / "view.html", tokens, maps).read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    params = json.loads(re.search(r"const params = (\{.*?\}); // HACK", html).group(1))
    attn = params["attention"][0]["attn"]
    assert len(attn) == 2 and len(attn[0]) == 2 and len(attn[0][0]) == len(text)   # L, H, T
    assert params["attention"][0]["left_text"] == list(text)


def test_search_names_the_word_that_comes_in_the_wrong_order():
    from common.errors import AttnlabError
    text = "it did not fit the trophy"
    spans = [(i, i + 1) for i in range(len(text))]
    with pytest.raises(AttnlabError, match="'it' occurs only before.*--from after --to"):
        search([torch.zeros(1, len(text), len(text))], text, spans, "it", "trophy")
    with pytest.raises(AttnlabError, match="'zebra' does not occur"):
        search([torch.zeros(1, len(text), len(text))], text, spans, "it", "zebra")


def test_the_html_view_cannot_be_closed_early_by_a_token(tmp_path):
    pytest.importorskip("bertviz")
    from attnlab.heads import export_head_view
    tokens = ["a", "</script><script>alert(1)</script>", "c"]
    html = export_head_view(tmp_path / "v.html", tokens, [torch.rand(2, 3, 3)]).read_text()
    assert "alert(1)" in html and "</script><script>alert(1)" not in html


# -- the article's own model, all-MiniLM-L6-v2 (a BERT encoder) ----------------------

ARTICLE = "The trophy didn't fit in the suitcase because it was too big."


def test_search_on_minilm_prints_the_articles_head(minilm, capsys):
    from attnlab.heads import main
    main(["search", "--run", str(minilm), "--text", ARTICLE, "--from", "it", "--to", "trophy"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("token 11 ('it') looking at tokens [2] ('trophy')")
    # Counted from 0 as everywhere in the project: the article's layer 4, head 2.
    assert "counted from 0" in lines[0] and "the article counts from 1" in lines[0]
    assert lines[1] == "  layer 3, head 1: it → trophy = 0.581"


def test_every_attention_tool_reads_minilm_and_the_rest_say_why_not(minilm, tmp_path, capsys):
    from attnlab.heads import main
    from common.errors import AttnlabError
    run = ["--run", str(minilm), "--text", ARTICLE]
    main(["grid", *run, "--out", str(tmp_path / "grid.png")])
    main(["head", *run, "--layer", "3", "--head", "1", "--out", str(tmp_path / "head.png")])
    main(["html", *run, "--out", str(tmp_path / "view.html")])
    assert all((tmp_path / n).stat().st_size > 1000 for n in ("grid.png", "head.png", "view.html"))
    # Each names what it wrote as attnlab.figures does, not as a bare path.
    assert capsys.readouterr().out.splitlines() == [f"wrote {tmp_path / n}"
                                                    for n in ("grid.png", "head.png", "view.html")]
    main(["stats", *run])
    rows = capsys.readouterr().out.splitlines()[2:]         # the numbering note, the header
    assert len(rows) == 6 * 12
    assert any(r.endswith("previous-token head") for r in rows)     # a neighbour head
    assert any(r.endswith("next-token head") for r in rows)         # it looks ahead: an encoder
    for what in ("stats", "search"):                  # they print: an --out was taken and ignored
        with pytest.raises(AttnlabError, match=f"heads {what} prints its answer and writes no file"):
            main([what, *run, "--from", "it", "--to", "trophy", "--out", str(tmp_path / "s.png")])
    assert not (tmp_path / "s.png").exists()
    for tool in ("lens", "ablate", "patch"):          # forwarded to python -m attnlab.lens
        with pytest.raises(AttnlabError, match="reads the model's token scores.*no output layer"):
            main([tool, *run, "--clean", ARTICLE, "--corrupt", ARTICLE])
    with pytest.raises(AttnlabError, match="encoder"):
        main(["induction", "--run", str(minilm)])


def test_stats_says_its_layers_and_heads_are_counted_from_0(tmp_path, capsys):
    from test_interop_bert import _tiny

    from attnlab.heads import main
    _tiny("bert", tmp_path / "hf")
    main(["stats", "--run", str(tmp_path / "hf"), "--text", "the cat sat"])
    note, header, *rows = capsys.readouterr().out.splitlines()
    assert "counted from 0" in note and "--layer/--head" in note
    assert header.split()[:2] == ["layer", "head"] and rows[0].split()[:2] == ["0", "0"]



def test_stats_refuses_a_text_of_one_token_rather_than_print_nan(corpus, tmp_path, capsys):
    """A 1-token text has no query after the first: stats printed nan and called every
    head a first-token (sink) head."""
    from conftest import train_tiny

    from attnlab.heads import main
    from common.errors import AttnlabError
    run = train_tiny(corpus, tmp_path, "r", "--train.max_iters=1")
    with pytest.raises(AttnlabError, match="the text is 1 token; heads stats averages over the "
                       "tokens after the first, so give a --text of at least 2 tokens"):
        main(["stats", "--run", str(run), "--text", "e"])
    assert "sink" not in capsys.readouterr().out

# -- words are whole words; every tool says the same about the context; numbering ---

def test_search_refuses_a_word_found_only_inside_another():
    from common.errors import AttnlabError
    text = "The trophy didn't fit"
    spans = [(i, i + 1) for i in range(len(text))]                 # one token per character
    maps = [torch.zeros(1, len(text), len(text))]
    with pytest.raises(AttnlabError, match=r"'it' does not occur in the text as a whole word "
                       r"\(only inside another word\).*words are 'The' 'trophy' 'didn' 't' 'fit'"):
        search(maps, text, spans, "it", "trophy")
    # Where the whole word comes after a word holding it, the whole word is taken.
    text = "The trophy didn't fit because it was big"
    spans = [(i, i + 1) for i in range(len(text))]
    _, query, targets = search([torch.zeros(1, len(text), len(text))], text, spans, "it", "trophy")
    assert query == text.index(" it ") + 2 and targets == list(range(4, 10))


def test_search_respects_leading_space_tokens_and_tokens_holding_more_letters():
    from common.errors import AttnlabError
    from attnlab.heads import find_word
    text = "The king said she was tired"
    words = text.split(" ")
    spans, at = [], 0                       # GPT-2's way: a token carries the space before it
    for i, w in enumerate(words):
        start = at - (i > 0)
        spans.append((start, at + len(w)))
        at += len(w) + 1
    assert find_word(text, "she", spans) == [3] and find_word(text, "The king", spans) == [0, 1]
    with pytest.raises(AttnlabError, match="'he' does not occur in the text as a whole word"):
        find_word(text, "he", spans)
    merged = spans[:3] + [(spans[3][0], spans[4][1]), spans[5]]       # one token " she was"
    with pytest.raises(AttnlabError, match="'she' is part of the token.*' she was'"):
        find_word(text, "she", merged)


def test_search_on_minilm_refuses_it_inside_fit(minilm):
    from attnlab.heads import main
    from common.errors import AttnlabError
    with pytest.raises(AttnlabError, match="'it' does not occur in the text as a whole word"):
        main(["search", "--run", str(minilm), "--text", "The trophy didn't fit",
              "--from", "it", "--to", "trophy"])


def _loaded(monkeypatch, module, model, tok, tmp_path):
    monkeypatch.setattr(module, "load", lambda args: (model, None, tok, tmp_path))


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_every_tool_warns_or_refuses_past_the_context_in_the_same_words(
        position, monkeypatch, tmp_path, capsys):
    from conftest import small_model

    from attnlab import heads, lens
    from common.errors import AttnlabError
    text = "the trophy did not fit because it was big"               # 41 > 16 characters
    tok = CharTokenizer(set(text))
    model = small_model(vocab_size=tok.vocab_size, position=position)
    for module in (heads, lens):
        _loaded(monkeypatch, module, model, tok, tmp_path)
    runs = [(heads.main, ["grid", "--text", text]), (heads.main, ["head", "--text", text]),
            (heads.main, ["html", "--text", text]), (lens.main, ["logit", "--text", text]),
            (lens.main, ["ablate", "--text", text]),
            (lens.main, ["patch", "--clean", text, "--corrupt", text])]
    for run, argv in runs:
        capsys.readouterr()
        if position == "learned":
            with pytest.raises(AttnlabError, match=r"^the text is 41 tokens; this model reads at "
                               r"most 16 \(its learned positions end there\)"):
                run([*argv, "--run", "x", "--out", str(tmp_path)])
            continue
        run([*argv, "--run", "x", "--out", str(tmp_path)])
        err = capsys.readouterr().err.splitlines()
        assert err == ["warning: the text is 41 tokens, past the 16 this model was trained on; "
                       "its rope positions go on, but it never saw such lengths"], argv


def test_plot_titles_say_layers_and_heads_count_from_0(monkeypatch, tmp_path):
    from attnlab import heads
    figures = []
    monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: figures.append(fig) or path)
    maps = [torch.rand(2, 3, 3)]
    heads.save_head(tmp_path / "h.png", list("abc"), maps[0][1], 3, 1)
    heads.save_grid(tmp_path / "g.png", list("abc"), maps)
    head_fig, grid_fig = figures
    assert head_fig.axes[0].get_title().startswith("layer 3, head 1 (from 0")
    assert "counted from 0" in grid_fig._suptitle.get_text()


def test_the_docs_quote_the_lens_refusal_as_it_is_printed(minilm):
    from conftest import ROOT

    from attnlab.heads import main
    from common.errors import AttnlabError
    with pytest.raises(AttnlabError) as refused:
        main(["lens", "--run", str(minilm), "--text", ARTICLE])
    quoted = [line.strip() for line in (ROOT / "docs" / "article_model.md").read_text().splitlines()
              if "reads the model's token scores" in line]
    assert quoted == [f"error: {refused.value}"]


def test_a_model_that_mixes_neighbours_says_the_maps_are_not_all_of_it(corpus, tmp_path, capsys):
    """With model.token_mix a token also reads the ones just before it through the mix,
    which no attention map shows and no head's ablation closes; the terminal tools, the
    page and sample.py's header say so, a plain model's do not."""
    from conftest import train_tiny

    from attnlab.heads import main
    from attnlab.serve import Service
    from engine.inference import load_run
    for mix, said in ((3, True), (0, False)):
        run = train_tiny(corpus, tmp_path / str(mix), "m", "--train.max_iters=2",
                         f"--model.token_mix={mix}")
        capsys.readouterr()
        main(["stats", "--run", str(run), "--text", "the cat sat"])
        assert ("the 2 before it" in capsys.readouterr().err) == said
        from attnlab.lens import main as lens
        lens(["ablate", "--run", str(run), "--text", "the cat sat", "--out", str(tmp_path / f"a{mix}.png")])
        assert ("switching every head off leaves open" in capsys.readouterr().err) == said
        from sample import main as sample
        sample(["--run", str(run), "--max_new_tokens", "2"])
        assert ("each token mixed with the 2 before it" in capsys.readouterr().err) == said
        model, cfg, tokenizer, ckpt = load_run(run)
        page = Service(model, cfg, tokenizer, str(ckpt)).info()["config"]
        assert ("model.token_mix=3" in page) == said


def test_a_text_far_past_the_context_is_refused_before_its_weights_are_kept(monkeypatch, tmp_path):
    """'the king said ' 7,200 times asked for 81 GB of attention weights (RoPE goes on past
    the context, so the text was read whole); every tool that reads a text is bounded
    at the one check (here made small, so the test's text is short)."""
    from attnlab import capture, heads, lens
    from common.errors import AttnlabError
    from conftest import small_model
    monkeypatch.setattr(capture, "MAPS_BYTES", 1 << 20)     # 2 layers x 4 heads: 181 tokens
    text = "the king said " * 20                              # 280 tokens
    tok = CharTokenizer(set(text))
    model = small_model(vocab_size=tok.vocab_size, position="rope")
    for module in (heads, lens):
        _loaded(monkeypatch, module, model, tok, tmp_path)
    for run, argv in [(heads.main, ["search", "--text", text, "--from", "said", "--to", "king"]),
                      (heads.main, ["grid", "--text", text, "--out", str(tmp_path)]),
                      (lens.main, ["logit", "--text", text, "--out", str(tmp_path)])]:
        with pytest.raises(AttnlabError, match="the text is 280 tokens, past this model's context "
                           "of 16; .* at most 181 tokens of this model: give a shorter --text"):
            run([*argv, "--run", "x"])


def test_on_a_hybrid_head_and_grid_draw_the_layers_that_have_weights(corpus, tmp_path, monkeypatch,
                                                                       capsys):
    """Whether a layer has weights is its mechanism's fact (model/mechanisms.py,
    no_weights), per layer: in deltanet,mha layer 1 draws, layer 0 is refused by name,
    and the grid leaves layer 0 out and says so, in the figure and in one printed line."""
    from conftest import train_tiny

    from attnlab import heads
    from common.errors import AttnlabError
    run = train_tiny(corpus, tmp_path, "hyb", "--train.max_iters=2", "--model.mechanism=deltanet,mha")
    drawn = []
    monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    args = ["--run", str(run), "--text", "The king said he was tired", "--out", str(tmp_path / "x.png")]
    heads.main(["head", *args, "--layer", "1", "--head", "0"])
    assert drawn[-1].axes[0].get_title().startswith("layer 1, head 0")
    weights = drawn[-1].axes[0].images[0].get_array()
    assert np.allclose(weights.sum(-1), 1, atol=1e-5) and np.all(np.triu(weights, 1) == 0)
    with pytest.raises(AttnlabError) as refused:
        heads.main(["head", *args, "--layer", "0", "--head", "0"])
    assert str(refused.value).startswith("layer 0 is model.mechanism=deltanet, which has no "
                                         "attention weights to draw") and "\n" not in str(refused.value)
    assert str(refused.value).endswith("layers with weights: 1")
    capsys.readouterr()
    heads.main(["grid", *args])
    titles = [ax.get_title() for ax in drawn[-1].axes if ax.get_title()]
    assert titles == ["layer 1, head 0", "layer 1, head 1"]
    assert "layer 0 left out: model.mechanism=deltanet" in drawn[-1]._suptitle.get_text()
    assert capsys.readouterr().err.splitlines() == [
        "note: layer 0 left out: model.mechanism=deltanet has no attention weights to draw"]
    from attnlab.serve import Service
    from engine.inference import load_run
    model, cfg, tokenizer, ckpt = load_run(run)         # the page's search: the same rule
    found = Service(model, cfg, tokenizer, str(ckpt)).search("The king said he was tired", "he", "king")
    assert {row["layer"] for row in found["ranking"]} == {1}


def test_grid_draws_the_layer_asked_for_and_refuses_what_it_does_not_read(tmp_path, monkeypatch):
    """`grid --layer 9` on a 2-layer model was drawn whole, the option ignored."""
    from attnlab import heads
    from common.errors import AttnlabError
    text = "the trophy did not fit"
    tok = CharTokenizer(set(text))
    model = planted_model(tok, "t", "y")
    monkeypatch.setattr(heads, "load", lambda args: (model, None, tok, tmp_path / "ckpt"))
    drawn = []
    monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    args = ["--text", text, "--out", str(tmp_path / "g.png")]
    heads.main(["grid", *args, "--layer", "1"])
    assert [ax.get_title() for ax in drawn[-1].axes if ax.get_title()] == \
        ["layer 1, head 0", "layer 1, head 1"]
    heads.main(["grid", *args])
    assert len([ax for ax in drawn[-1].axes if ax.get_title()]) == 4
    for argv, said in ((["grid", "--layer", "9"], "--layer 9: this model has layers 0-1"),
                       (["grid", "--layer", "-1"], "--layer -1: this model has layers 0-1"),
                       (["head", "--layer", "2"], "--layer 2: this model has layers 0-1"),
                       (["grid", "--head", "1"], "heads grid reads every head and takes no --head"),
                       (["stats", "--layer", "1"], "heads stats reads every head and takes no --layer")):
        with pytest.raises(AttnlabError, match=re.escape(said)):
            heads.main([*argv, "--text", text] + (["--out", str(tmp_path / "g.png")]
                                                  if argv[0] != "stats" else []))


def test_differential_weights_are_labelled_as_no_distribution_and_get_no_entropy(
        tmp_path, monkeypatch, capsys):
    """The colour bar said "each row sums to 1" and stats printed an entropy for
    differential attention, whose rows sum to 1 - λ and may go below 0."""
    from attnlab import heads
    from attnlab.plotting import WEIGHT
    text = "the trophy did not fit"
    tok = CharTokenizer(set(text))
    torch.manual_seed(0)
    for mechanism, sums_to_one in (("differential", False), ("mha", True)):
        model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                                block_size=64, mechanism=mechanism)).eval()
        monkeypatch.setattr(heads, "load", lambda args: (model, None, tok, tmp_path / "ckpt"))
        drawn = []
        monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
        for what in ("grid", "head"):
            heads.main([what, "--text", text, "--out", str(tmp_path / "g.png")])
            label = drawn[-1].axes[-1].get_ylabel()          # the colour bar's
            assert (label == WEIGHT) == sums_to_one, label
            assert sums_to_one or "model.mechanism=differential need not sum to 1" in label
        capsys.readouterr()
        heads.main(["stats", "--text", text])
        printed = capsys.readouterr()
        entropies = [line.split()[2] for line in printed.out.splitlines()[2:]]
        assert len(entropies) == 4 and (set(entropies) == {"n/a"}) != sums_to_one
        assert ("entropy does not apply" in printed.err) != sums_to_one


def test_a_hybrids_colour_bar_speaks_of_the_layers_drawn(tmp_path, monkeypatch):
    """On mha,differential, layer 0's figure is a softmax's and says its rows sum to 1;
    layer 1's and the whole grid's say differential's rows need not."""
    from attnlab import heads
    from attnlab.plotting import WEIGHT
    text = "the trophy did not fit"
    tok = CharTokenizer(set(text))
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32,
                            block_size=64, mechanism="mha,differential")).eval()
    monkeypatch.setattr(heads, "load", lambda args: (model, None, tok, tmp_path / "ckpt"))
    drawn = []
    monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    for what, layer, sums_to_one in (("grid", [], False), ("grid", ["--layer", "0"], True),
                                     ("grid", ["--layer", "1"], False),
                                     ("head", ["--layer", "0"], True),
                                     ("head", ["--layer", "1"], False)):
        heads.main([what, "--text", text, *layer, "--out", str(tmp_path / "g.png")])
        label = drawn[-1].axes[-1].get_ylabel()
        assert (label == WEIGHT) == sums_to_one, (what, layer, label)


def test_weights_below_0_are_drawn_on_a_scale_centred_on_0(tmp_path, monkeypatch):
    from attnlab import heads
    drawn = []
    monkeypatch.setattr(heads, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    signed, plain = torch.rand(2, 3, 3) - 0.3, torch.rand(2, 3, 3)
    for maps, cmap, lowest in (([plain, signed], "RdBu_r", -1), ([plain], "viridis", 0)):
        heads.save_grid(tmp_path / "g.png", list("abc"), maps)
        heads.save_head(tmp_path / "h.png", list("abc"), maps[-1][0], 0, 0)
        for fig in drawn[-2:]:
            images = [im for ax in fig.axes for im in ax.images]
            assert {im.get_cmap().name for im in images} == {cmap}
            assert {im.get_clim()[0] for im in images} == {lowest}


# -- what the model-card pieces add: heads sinks, gates, chosen --------------------------

PIECE_TEXT = "the trophy did not fit in the suitcase"


def piece_model(tmp_path, monkeypatch, **fields):
    """A small model of `fields` over a character tokenizer, loaded by heads as a run."""
    from attnlab import heads
    from conftest import small_model
    tok = CharTokenizer(set(PIECE_TEXT))
    model = small_model(vocab_size=tok.vocab_size, block_size=64, **fields)
    monkeypatch.setattr(heads, "load", lambda args: (model, None, tok, tmp_path / "ckpt"))
    return model, tok


def table(out: str, columns: int) -> dict:
    """The first table's rows: (layer, head) -> its numbers."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == columns + 2 and parts[0].isdigit() and parts[1].isdigit():
            rows[int(parts[0]), int(parts[1])] = [float(x.rstrip("%")) for x in parts[2:]]
        elif rows:
            break
    return rows


def token_rows(out: str, after: str) -> list[list[float]]:
    """The numbers of each token's line in the per-token table that follows `after`."""
    lines = out.split(after, 1)[1].splitlines()[2:]
    return [[float(x) for x in line.split()[-2:]] for line in lines if line.strip()]


def test_heads_sinks_prints_each_heads_share_and_each_tokens(tmp_path, monkeypatch, capsys):
    from attnlab import heads
    from attnlab.capture import run_with_cache
    model, tok = piece_model(tmp_path, monkeypatch, mechanism="sinks", n_head=2)
    with torch.no_grad():
        model.blocks[1].attn.sinks.copy_(torch.tensor([3.0, -2.0]))     # layer 1 takes most
    heads.main(["sinks", "--text", PIECE_TEXT])
    out = capsys.readouterr().out
    _, cache = run_with_cache(model, torch.tensor([tok.encode(PIECE_TEXT)]))
    rows = table(out, 4)
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (layer, head), (mean, least, most, first) in rows.items():
        p = f"blocks.{layer}."
        # The sink's share by its own definition: what the row's weights on the keys miss of 1.
        share = 1 - cache[p + "pattern"][0, head].double().sum(-1)
        assert (mean, least, most) == pytest.approx(
            [share.mean().item(), share.min().item(), share.max().item()], abs=6e-4)
        assert first == pytest.approx(cache[p + "pattern"][0, head, 1:, 0].mean().item(), abs=6e-4)
    assert "each token's sink share, layer 1" in out
    rows = token_rows(out, "each token's sink share, layer 1")
    assert len(rows) == len(PIECE_TEXT)
    expected = 1 - cache["blocks.1.pattern"][0].double().sum(-1).T             # (T, H)
    np.testing.assert_allclose(np.array(rows), expected.numpy(), atol=6e-4)


def test_heads_gates_prints_each_heads_openness_and_each_tokens(tmp_path, monkeypatch, capsys):
    from attnlab import heads
    model, tok = piece_model(tmp_path, monkeypatch, mechanism="gated", n_head=2)
    x = {}
    hooks = [b.attn.register_forward_pre_hook(lambda m, a, l=l: x.__setitem__(l, a[0].double()))
             for l, b in enumerate(model.blocks)]
    heads.main(["gates", "--text", PIECE_TEXT, "--layer", "0"])
    for h in hooks:
        h.remove()
    out = capsys.readouterr().out
    rows = table(out, 3)
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (layer, head), (mean, least, most) in rows.items():
        g = model.blocks[layer].attn.w_gate
        gate = torch.sigmoid(x[layer][0] @ g.weight.double().T + (0 if g.bias is None else g.bias.double()))
        per_head = gate.view(len(PIECE_TEXT), 2, -1).mean(-1)[:, head]
        assert (mean, least, most) == pytest.approx(
            [per_head.mean().item(), per_head.min().item(), per_head.max().item()], abs=6e-4)
    rows = token_rows(out, "each token's gate openness, layer 0")
    gate = torch.sigmoid(x[0][0] @ model.blocks[0].attn.w_gate.weight.double().T)
    np.testing.assert_allclose(np.array(rows), gate.view(len(PIECE_TEXT), 2, -1).mean(-1).detach().numpy(),
                               atol=6e-4)


def test_heads_chosen_weighs_the_indexers_keys_by_full_attention(tmp_path, monkeypatch, capsys):
    """Full attention's weight on the chosen keys and its k heaviest among them, recomputed
    from the captured q and k (the softmax over every visible key) and the chosen keys."""
    from attnlab import heads
    from attnlab.capture import run_with_cache
    top_k = 5
    model, tok = piece_model(tmp_path, monkeypatch, mechanism="sparse", n_head=2, sparse_top_k=top_k,
                             position="none")
    from attnlab import pieces
    drawn = []
    monkeypatch.setattr(pieces, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    heads.main(["chosen", "--text", PIECE_TEXT, "--out", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    _, cache = run_with_cache(model, torch.tensor([tok.encode(PIECE_TEXT)]))
    T = len(PIECE_TEXT)
    layer = int(re.search(r"each token, layer (\d)", out)[1])
    dots = {tuple(map(int, xy)) for ax in drawn[-1].axes for c in ax.collections
            for xy in c.get_offsets()}                 # (key, query): one dot per chosen key
    assert dots == {(k, q) for q, k in zip(*np.nonzero(cache[f"blocks.{layer}.chosen"][0].numpy()))}
    assert f"wrote {tmp_path / 'c.png'}" in out
    picking = np.arange(T) + 1 > top_k                         # queries that see more than k keys
    rows = table(out, 2)
    assert sorted(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (layer, head), (share, heaviest) in rows.items():
        p = f"blocks.{layer}."
        q, k = cache[p + "q"][0, head].double().numpy(), cache[p + "k"][0, head].double().numpy()
        scores = np.where(np.tril(np.ones((T, T), bool)), q @ k.T / math.sqrt(q.shape[-1]), -np.inf)
        full = np.exp(scores - scores.max(-1, keepdims=True))
        full /= full.sum(-1, keepdims=True)
        chosen = cache[p + "chosen"][0].numpy()
        assert share == pytest.approx((full * chosen).sum(-1)[picking].mean(), abs=6e-4)
        top = [set(np.argsort(-full[t], kind="stable")[:top_k]) for t in range(T)]
        found = [len(top[t] & set(np.flatnonzero(chosen[t]))) / top_k for t in range(T)]
        assert heaviest == pytest.approx(100 * np.mean(np.array(found)[picking]), abs=0.06)


def test_a_piece_view_of_a_model_without_the_piece_says_how_to_train_one(tmp_path, monkeypatch):
    from attnlab import heads
    from common.errors import AttnlabError
    piece_model(tmp_path, monkeypatch, mechanism="sinks,mha")
    for view, said in (("sinks", None), ("gates", "has no attention gates; heads gates looks at a "
                                                 "model trained with --model.mechanism=gated"),
                       ("chosen", "has no lightning indexer")):
        if said:
            with pytest.raises(AttnlabError, match=re.escape(said)):
                heads.main([view, "--text", PIECE_TEXT])
    with pytest.raises(AttnlabError, match=re.escape("--layer 1: the layers with this piece are 0")):
        heads.main(["sinks", "--text", PIECE_TEXT, "--layer", "1"])
    with pytest.raises(AttnlabError, match="heads sinks reads every head and takes no --head"):
        heads.main(["sinks", "--text", PIECE_TEXT, "--head", "1"])


def test_help_and_a_mistyped_subcommand_list_every_subcommand_that_runs(capsys):
    """--help and the invalid-choice error listed grid ... chosen, while lens, ablate,
    patch and induction ran and docs/walkthrough.md sends learners to them."""
    from attnlab import heads
    text = " ".join(heads.parser().format_help().split())
    for name in heads.FORWARDED:
        assert name in re.search(r"\{([a-z,]+)\}", text).group(1).split(",")
        with pytest.raises(SystemExit) as done:
            heads.main([name, "--help"])          # each one listed runs
        assert done.value.code == 0
    from common.errors import AttnlabError, ConfigError
    with pytest.raises(ConfigError, match="invalid choice: 'lense'") as err:
        heads.main(["lense"])
    assert "\n" not in str(err.value)
    for name in ["grid", "head", "search", "stats", "html", *heads.PIECE_VIEWS, *heads.FORWARDED]:
        assert f"'{name}'" in str(err.value)
    with pytest.raises(AttnlabError, match="heads lens takes its options after its name"):
        heads.main(["--text", "hi", "lens"])
