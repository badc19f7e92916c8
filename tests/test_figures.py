"""The mask-pattern figure (attnlab/figures.py)."""
import re
from pathlib import Path

import pytest

from attnlab.figures import mask_patterns, save_mask_patterns


def test_mask_patterns_png_is_a_real_image(tmp_path):
    path = save_mask_patterns(tmp_path / "masks.png", length=16, window=4, n_global=2)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_patterns_count_what_each_computes():
    p = mask_patterns(16, 4, 2)
    counts = [int(m.sum()) for m in p.values()]
    assert counts[0] == 16 * 17 // 2                      # the causal triangle
    assert counts[1] == 4 * 16 - (1 + 2 + 3)              # a band of width 4
    assert counts[2] > counts[1]                           # plus the global columns


def test_every_article_figure_is_written(tmp_path, capsys, monkeypatch):
    """Every figure, the two trained ones with a few steps only (the trainings
    themselves are tested in test_lens.py and test_seq2seq.py)."""
    import attnlab.induction as induction
    import attnlab.seq2seq as seq2seq
    from attnlab.figures import FIGURES, main
    short = lambda train: (lambda *a, steps=0, **k: train(*a, steps=5, **k))
    monkeypatch.setattr(induction, "train_attention_only", short(induction.train_attention_only))
    monkeypatch.setattr(seq2seq, "train", short(seq2seq.train))
    main(["all", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "softmax(scores 1, 2, 3) = (0.09, 0.24, 0.67)" in printed
    assert "softmax(same scores x8) = (0.00, 0.00, 1.00)" in printed
    assert "= 6.1" in printed and "d_k =  512" in printed
    from attnlab.figures import file_of
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(file_of(name) for name in FIGURES)
    for name in written:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each under the name the docs show it by, so `all --out docs/figures` renews them.
    docs = Path(__file__).resolve().parent.parent / "docs" / "figures"
    assert set(written) <= {p.name for p in docs.iterdir()}


def test_a_figure_that_fails_part_way_leaves_the_old_file_whole(tmp_path):
    """save_figure draws into memory and renames the whole file over the old one: a
    savefig that dies half-way (a killed run, a full disk) leaves the old figure, not
    half of a new one, and no temporary file beside it."""
    from attnlab.plotting import pyplot, save_figure
    path = tmp_path / "attention.png"
    path.write_bytes(b"the old figure")
    fig = pyplot().figure()

    def dies_half_way(target, **kwargs):
        if hasattr(target, "write"):
            target.write(b"\x89PNG half")
        else:
            Path(target).write_bytes(b"\x89PNG half")
        raise OSError("No space left on device")

    fig.savefig = dies_half_way
    with pytest.raises(OSError):
        save_figure(fig, path)
    assert path.read_bytes() == b"the old figure"
    assert [p.name for p in tmp_path.iterdir()] == ["attention.png"]
    # and a figure that is saved replaces it, as a PNG of the suffix asked for
    fig = pyplot().figure()
    assert save_figure(fig, tmp_path / "attention.PNG").read_bytes()[:4] == b"\x89PNG"


def test_one_figure_goes_where_out_says(tmp_path, capsys):
    """--out an existing folder, a new folder ending in a slash or without a suffix, or a
    file in a folder not made yet; the `wrote` line names the file written."""
    from attnlab.figures import main
    from common.errors import AttnlabError
    (tmp_path / "old").mkdir()
    for out, written in [(tmp_path / "old", tmp_path / "old" / "masks.png"),
                         (f"{tmp_path / 'new'}/", tmp_path / "new" / "masks.png"),
                         (tmp_path / "a" / "b" / "m.png", tmp_path / "a" / "b" / "m.png"),
                         # a new name without a suffix is a folder, as the help says ("a
                         # PNG path or a folder"), not figs.png beside it
                         (tmp_path / "x" / "figs", tmp_path / "x" / "figs" / "masks.png")]:
        main(["masks", "--out", str(out)])
        assert capsys.readouterr().out == f"wrote {written}\n"
        assert written.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(AttnlabError, match=r"--out .*x\.xyz: a figure cannot be saved as \.xyz"):
        main(["masks", "--out", str(tmp_path / "x.xyz")])
    with pytest.raises(AttnlabError, match="`all` writes a figure each into a folder"):
        main(["all", "--out", str(tmp_path / "f.png")])
    (tmp_path / "file").write_text("")
    with pytest.raises(AttnlabError, match=r"--out .*file/m\.png: .*file is a file, not a folder"):
        main(["masks", "--out", str(tmp_path / "file" / "m.png")])
    assert not (tmp_path / "f.png").exists() and not (tmp_path / "x.xyz").exists()


def test_the_head_view_is_refused_a_name_that_is_not_a_page(tmp_path):
    from attnlab.heads import main
    from common.errors import AttnlabError
    with pytest.raises(AttnlabError, match=r"the head view is a web page; name it \.html"):
        main(["html", "--text", "ROMEO.", "--out", str(tmp_path / "view.png")])


def test_an_out_through_a_file_is_refused_before_any_work(tmp_path, capsys):
    """Checked before the model is loaded or a figure drawn: nothing is printed first."""
    from attnlab import figures, heads, induction, lens
    from common.errors import AttnlabError
    (tmp_path / "notes.md").write_text("")
    through = str(tmp_path / "notes.md" / "x.png")
    for call in (lambda: figures.main(["all", "--out", str(tmp_path / "notes.md" / "x")]),
                 lambda: heads.main(["html", "--text", "ROMEO.", "--out", str(tmp_path / "notes.md" / "v.html")]),
                 lambda: heads.main(["grid", "--text", "ROMEO.", "--out", through]),
                 lambda: lens.main(["logit", "--text", "ROMEO.", "--out", through]),
                 lambda: induction.main(["--out", str(tmp_path / "notes.md" / "f")])):
        with pytest.raises(AttnlabError, match=r"notes\.md is a file, not a folder"):
            call()
        assert capsys.readouterr().out == ""


def test_an_out_that_is_a_device_is_refused_before_any_work(capsys):
    """--out /dev/null (to throw the figure away) wrote /dev/null.png."""
    from attnlab import figures, heads, induction, lens
    from common.errors import AttnlabError
    for call in (lambda: figures.main(["all", "--out", "/dev/null"]),
                 lambda: heads.main(["grid", "--text", "ROMEO.", "--out", "/dev/null"]),
                 lambda: lens.main(["logit", "--text", "ROMEO.", "--out", "/dev/null"]),
                 lambda: induction.main(["--out", "/dev/null"])):
        with pytest.raises(AttnlabError, match=r"^--out /dev/null(/softmax.png: /dev/null is a "
                                               r"device or a pipe, not a folder| is neither a file "
                                               r"nor a folder)"):
            call()
        assert capsys.readouterr().out == ""
    assert not __import__("pathlib").Path("/dev/null.png").exists()


def drawn(monkeypatch) -> list:
    """The figures save_figure is handed, caught at savefig (nothing is drawn to disk)."""
    from matplotlib.figure import Figure
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    return figures


def maps_and_tokens():
    import torch
    g = torch.Generator().manual_seed(0)
    tokens = list("ROMEO. What")
    T = len(tokens)
    causal = torch.ones(T, T).tril().bool()
    maps = [torch.softmax(torch.randn(2, T, T, generator=g).masked_fill(~causal, float("-inf")), -1)
            for _ in range(2)]
    return tokens, maps


def labelled(ax) -> tuple[list[str], list[str]]:
    return ([t.get_text() for t in ax.get_xticklabels()],
            [t.get_text() for t in ax.get_yticklabels()])


def colour_scales(fig) -> int:
    return sum(hasattr(ax, "_colorbar") for ax in fig.axes)


def test_every_attention_figure_labels_its_tokens_and_has_a_colour_scale(tmp_path, monkeypatch):
    import attnlab.induction as induction
    import attnlab.seq2seq as seq2seq
    from attnlab import heads
    from attnlab.plotting import save_layer_map
    tokens, maps = maps_and_tokens()
    shown = [t.replace(" ", "␣") for t in tokens]
    figures = drawn(monkeypatch)
    heads.save_grid(tmp_path / "g.png", tokens, maps)
    heads.save_head(tmp_path / "h.png", tokens, maps[1][0], 1, 0)
    save_layer_map(tmp_path / "l.png", maps[0][0][:2], tokens, "loss change when a head is "
                   "zero-ablated (base 2.346; layers and heads counted from 0, as they take them)",
                   xlabel="head (from 0)", scale="loss change", cmap="viridis", center=False)
    grid, head, lens = figures
    for fig in (grid, head, lens):
        assert colour_scales(fig) == 1
    panels = [ax for ax in grid.axes if not hasattr(ax, "_colorbar")]
    assert labelled(panels[0])[1] == shown and labelled(panels[-1])[0] == shown   # beside, under
    assert labelled(head.axes[0]) == (shown, shown)
    assert labelled(lens.axes[0]) == (shown, ["0", "1"])
    # The trained ones, on models trained a few steps only.
    model = induction.train_attention_only(steps=2)
    induction.plot_heads(model, 12, {"previous-token head": (0, 1), "induction head": (1, 0)},
                         tmp_path / "i.png")
    seq2seq.plot_cross_attention(seq2seq.train(steps=2, log=lambda *a: None), "attention",
                                 tmp_path / "c.png")
    from attnlab.article import LeakRow, leak_figure
    leak_figure([LeakRow(causal, 1.0, 1.0, [(0, 4.0), (1, 2.0)], 1.0, 0.5, (0, 1), m[0], "",
                         tokens) for causal, m in ((True, maps[0]), (False, maps[1]))],
                tmp_path / "leak.png")
    save_mask_patterns(tmp_path / "m.png", length=8, window=3, n_global=1)
    for fig in figures[3:]:
        assert colour_scales(fig) == 1
        for ax in (ax for ax in fig.axes if not hasattr(ax, "_colorbar")):
            keys, queries = labelled(ax)
            assert keys and queries and all(keys) and all(queries), fig
    assert labelled(figures[-1].axes[0])[0] == [str(i) for i in range(8)]
    for fig in figures:                  # a scale says what it measures; a title fits
        assert all(ax.get_ylabel() for ax in fig.axes if hasattr(ax, "_colorbar")), fig
        fig.canvas.draw()
        for text in [ax.title for ax in fig.axes] + list(fig.texts):
            box = text.get_window_extent()
            assert box.x0 >= 0 and box.x1 <= fig.bbox.width, text.get_text()
    assert lens.axes[0].get_xlabel()


def test_titles_and_search_count_layers_and_heads_alike(tmp_path, capsys, monkeypatch):
    """The grid's titles counted from 0 and search's lines from 1 named the same head
    two ways; the head search ranks first is drawn under the same name."""
    from test_interop_bert import _tiny

    from attnlab.heads import main
    _tiny("bert", tmp_path / "hf")
    run = ["--run", str(tmp_path / "hf"), "--text", "the cat sat on the mat"]
    main(["search", *run, "--from", "mat", "--to", "cat", "--top", "1"])
    note, first = capsys.readouterr().out.splitlines()
    layer, head = map(int, re.match(r"  layer (\d+), head (\d+):", first).groups())
    figures = drawn(monkeypatch)
    main(["head", *run, "--layer", str(layer), "--head", str(head), "--out", str(tmp_path / "h.png")])
    main(["grid", *run, "--out", str(tmp_path / "g.png")])
    head_fig, grid_fig = figures
    assert head_fig.axes[0].get_title().startswith(f"layer {layer}, head {head} ")
    titles = [ax.get_title() for ax in grid_fig.axes]
    assert titles[0] == "layer 0, head 0" and f"layer {layer}, head {head}" in titles
    assert "counted from 0" in note and "counted from 0" in grid_fig._suptitle.get_text()


def test_the_articles_printouts_count_layers_from_0_as_every_other_tool_does(
        tmp_path, capsys, monkeypatch):
    """`article bank` printed "after layer 1" for the first layer while `article distance`,
    on the same model, printed it as layer 0."""
    from test_interop_bert import _tiny

    from attnlab import article
    from attnlab.article import main
    _tiny("bert", tmp_path / "hf")
    cosines = article.bank_cosines            # the tiny vocabulary has no "bank"
    monkeypatch.setattr(article, "bank_cosines", lambda model, tokenizer: cosines(
        model, tokenizer, ("the cat sat", "a cat ran"), "cat"))
    printed = {}
    for what in ("bank", "distance"):
        main([what, "--run", str(tmp_path / "hf")])
        out = capsys.readouterr().out
        assert "counted from 0" in out.splitlines()[0], out
        printed[what] = [int(n) for n in re.findall(r"^\s*(?:after layer )?(\d+)\s", out, re.M)]
    assert printed["bank"] == printed["distance"] == [0, 1], printed
