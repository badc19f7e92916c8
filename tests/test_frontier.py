"""The frontier command (attnlab/frontier.py): one row per mechanism with every column,
the key-blind floor beside every MQAR score, a --quick run that says its cells are
noise and writes to its own folder, a figure whose names cannot overlap, the cache's
size per token read from the model's own cache (exact ratios for GQA and MQA), a
mechanism the model cannot build skipped in one line, and options refused at parse
time."""
import csv
import re

import pytest
import torch

from attnlab import frontier
from attnlab.frontier import BASE, MECHANISMS, Mechanism, Settings, decode_columns, main
from common.errors import AttnlabError, ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")       # tiny models, trained here


def test_the_command_at_test_size_writes_every_column_and_skips_what_cannot_be_built(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(MECHANISMS, "future", Mechanism("not registered", {"position": "nowhere"}))
    monkeypatch.setattr(frontier, "LM_OPTIONS", [*frontier.LM_OPTIONS,
                                                 f"--data.cache_dir={tmp_path / 'cache'}"])
    out = tmp_path / "frontier"
    earlier = out / "lm" / "mha"             # an earlier run of this command into the same folder
    (earlier / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "checkpoints/stale"):
        (earlier / name).write_text("{}")
    assert main(["--quick", "--steps", "2", "--mechanisms", "mha", "future", "mqa",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if line.startswith("future:")]
    assert len(skipped) == 1 and "skipped" in skipped[0] and "nowhere" in skipped[0]
    with open(out / "frontier.csv", newline="") as f:
        rows = {r["mechanism"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["mha", "mqa", frontier.FLOOR]
    s = Settings(**frontier.QUICK)
    cells = [f"mqar_{n}_{p}" for n in s.mqar_lengths for p in s.pairs if 4 * p <= n]
    assert cells == ["mqar_16_1", "mqar_16_2", "mqar_16_4", "mqar_32_1", "mqar_32_2",
                     "mqar_32_4", "mqar_32_8"]
    expected = ["mechanism", "params", "val_loss", "train_tokens_per_s",
                *(f"decode_ms_at_{n}" for n in s.contexts), "cache_bytes_per_token",
                "state_bytes", *cells, "about"]
    assert list(rows["mha"]) == expected
    for name in ("mha", "mqa"):
        assert all(rows[name][c] != "" for c in expected)
        assert float(rows[name][f"decode_ms_at_{max(s.contexts)}"]) > 0   # measured, whatever its value
        assert all(0 <= float(rows[name][c]) <= 1 for c in cells)
    # The floor's row: a key-blind guess among the N values of each example, 1/N.
    floors = rows[frontier.FLOOR]
    assert [float(floors[c]) for c in cells] == pytest.approx([1, 1 / 2, 1 / 4, 1, 1 / 2, 1 / 4, 1 / 8])
    # MQA keeps one key/value head of the base model's four: a quarter of the bytes, exactly.
    assert float(rows["mqa"]["cache_bytes_per_token"]) * BASE["n_head"] == \
        float(rows["mha"]["cache_bytes_per_token"])
    assert (out / "frontier.png").stat().st_size > 0
    written = (out / "frontier.md").read_text()
    # The table itself says a --quick run's cells are noise, before any of them.
    assert written.index("noise") < written.index("| mha |")
    assert "--quick" in printed.split("| mha |")[0] and "noise" in printed.split("| mha |")[0]
    # Beside every MQAR score, in the same cell, its floor.
    mha = next(line for line in written.splitlines() if line.startswith("| mha |"))
    shown = mha.strip("|").split("|")
    at = expected.index("mqar_32_8")
    assert re.fullmatch(r" \d+% \(12%\) ", shown[at]), shown[at]
    for column in expected[1:-1]:          # each column says what it holds, under the table
        generic = "mqar_L_N" if column.startswith("mqar") else re.sub(r"_(\d+)$", r"_N", column)
        assert f"- `{generic}`: " in written, column
    assert not (earlier / "checkpoints" / "stale").exists()        # replaced, not refused


def test_quick_writes_to_its_own_folder_and_the_full_run_to_runs_frontier(monkeypatch, tmp_path):
    """A learner's --quick must not replace the measurement the docs point to."""
    seen = []
    monkeypatch.setattr(frontier, "writable_folder", lambda path: seen.append(path) or 1 / 0)
    for argv in (["--quick"], []):
        with pytest.raises(ZeroDivisionError):
            main(argv + ["--mechanisms", "mha"])
    assert [str(p) for p in seen] == ["runs/frontier-quick", "runs/frontier"]
    with pytest.raises(ZeroDivisionError):
        main(["--quick", "--out", str(tmp_path / "mine")])
    assert str(seen[-1]) == str(tmp_path / "mine")


def fake_rows(names, memory, scores):
    s = Settings(**frontier.QUICK)
    rows = []
    for name, bytes_, score in zip(names, memory, scores):
        row = {"mechanism": name, "cache_bytes_per_token": bytes_, "state_bytes": 0}
        row.update({f"mqar_{n}_{p}": score for n, p in frontier.mqar_cells(s)})
        rows.append(row)
    floors = {f"mqar_{n}_{p}": 1 / p for n, p in frontier.mqar_cells(s)}
    return rows, floors, s


def test_no_two_names_in_the_figure_overlap(tmp_path, monkeypatch):
    """Mechanisms with the same memory and the same score (linear and deltanet at the floor,
    gqa beside mha) each keep a readable name: no text of the figure covers another."""
    names = ["mha", "gqa", "mqa", "linear", "deltanet", "gated_deltanet", "hybrid", "window"]
    rows, floors, s = fake_rows(names, [1024, 1024, 1024, 0, 0, 0, 512, 0],
                                [1.0, 1.0, 1.0, 0.12, 0.12, 0.12, 1.0, 0.12])
    made = []
    from attnlab import plotting
    real = plotting.save_figure
    monkeypatch.setattr(frontier, "save_figure", lambda fig, path: made.append(fig) or real(fig, path))
    frontier.plot(rows, floors, s, tmp_path, note="--quick: every score is noise")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = made[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    from matplotlib.text import Text
    texts = [t for t in dict.fromkeys(fig.findobj(Text)) if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    for name in names:
        assert sum(text == name for text, _ in boxes) == 1, name
    named = [(text, box) for text, box in boxes if text in names]
    for i, (a, box_a) in enumerate(named):
        for b, box_b in named[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)


@pytest.mark.parametrize("n_head", [4, 8])
def test_bytes_per_token_are_the_keys_and_values_the_model_caches(n_head):
    s = Settings(contexts=(40, 72), decode_steps=3)
    size = {"n_head": n_head, "n_embd": 16 * n_head}
    rows = {name: decode_columns(Mechanism(name, {**size, **more}), s, vocab_size=11)
            for name, more in (("mha", {}), ("gqa", {"n_kv_head": n_head // 2}),
                               ("mqa", {"n_kv_head": 1}))}
    # K and V, per layer, per key/value head, d_k = 16 numbers each, 4 bytes in fp32.
    assert rows["mha"]["cache_bytes_per_token"] == 2 * BASE["n_layer"] * n_head * 16 * 4
    assert rows["gqa"]["cache_bytes_per_token"] * 2 == rows["mha"]["cache_bytes_per_token"]
    assert rows["mqa"]["cache_bytes_per_token"] * n_head == rows["mha"]["cache_bytes_per_token"]
    assert all(r["state_bytes"] == 0 for r in rows.values())     # nothing kept but K and V
    assert all(r["decode_ms_at_40"] > 0 and r["decode_ms_at_72"] > 0 for r in rows.values())


def test_a_window_s_cache_stops_growing():
    s = Settings(contexts=(48, 96), decode_steps=3)
    row = decode_columns(Mechanism("window", {"sliding_window": 8}), s, vocab_size=11)
    assert row["cache_bytes_per_token"] == 0
    # A rolling cache of 2W slots (it compacts once per W tokens), each K and V of 4 heads.
    assert row["state_bytes"] == 2 * 8 * 2 * BASE["n_layer"] * 4 * 16 * 4


def test_the_memory_facts_come_from_the_cache_the_model_makes(monkeypatch):
    # A mechanism that keeps a fixed state reports its own size through its cache.
    class Fixed:
        window = 0

        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def nbytes(self):
            return 4096

    from model import GPT
    made = GPT.new_cache
    monkeypatch.setattr(GPT, "new_cache", lambda self, n: Fixed(made(self, n)))
    row = decode_columns(Mechanism("fixed"), Settings(contexts=(32, 64), decode_steps=3), 11)
    assert (row["cache_bytes_per_token"], row["state_bytes"]) == (0, 4096)


@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], "--steps"),
    (["--contexts", "8", "64"], "--contexts"),
    (["--contexts", "64"], "2 to 5"),
    (["--pairs", "100"], "--pairs"),
    (["--pairs", "33"], "at most 32"),
    (["--mechanisms", "gqaa"], "did you mean 'gqa'"),
    (["--threads", "999"], "--threads"),
    (["--examples", "x"], "--examples"),
    (["--out", ""], "empty path"),
])
def test_bad_options_are_refused_before_any_work(argv, words, tmp_path):
    with pytest.raises((AttnlabError, ConfigError), match=words.replace("'", ".")):
        main(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "x")]))
    assert not (tmp_path / "x").exists()


def test_every_mechanism_of_the_frontier_is_one_the_model_builds():
    """The table names the mechanisms the model registers (model.mechanism), so none of
    its nine rows is skipped."""
    assert {name: frontier.why_not(m) for name, m in frontier.MECHANISMS.items()} == \
        dict.fromkeys(frontier.MECHANISMS)
    assert len(frontier.MECHANISMS) == 9


@pytest.mark.parametrize("context", [40, 300])
def test_the_windows_cache_holds_twice_the_window_as_its_page_says(context):
    """docs/after_the_article.md said the cache "stops growing at the window"; the rolling
    buffer keeps 2·W slots, cut back to the newest W-1 when full."""
    from pathlib import Path
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    window = MECHANISMS["window"].model["sliding_window"]
    model = GPT(ModelConfig(**{**BASE, **MECHANISMS["window"].model, "vocab_size": 32,
                               "block_size": 64})).eval()
    _, held = frontier.decode_at(model, context, 4)
    want = BASE["n_layer"] * 2 * (2 * window) * BASE["n_embd"] * 4        # K and V, fp32
    assert held == want == 32_768
    page = " ".join((Path(__file__).parents[1] / "docs/after_the_article.md").read_text().split())
    assert "stops growing at twice the window" in page and f"{want:,} bytes at any length" in page


@pytest.mark.parametrize("asked", ["cosine", "difrential"])
def test_an_unknown_mechanism_is_told_every_mechanism_the_frontier_measures(asked, monkeypatch):
    from model import mechanisms as registered
    monkeypatch.setitem(registered.MECHANISMS, "newcomer", registered.MECHANISMS["mha"])
    with pytest.raises(AttnlabError) as err:
        main(["--quick", "--mechanisms", "mha", asked])
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"--mechanisms {asked}: ")
    # every row, and every registered mechanism that is no row, measured when named
    for name in [*MECHANISMS, "differential", "gated_deltanet", "newcomer"]:
        assert name in said
    assert ("did you mean 'differential'" in said) == (asked == "difrential")


def test_a_registered_mechanism_that_is_no_row_is_measured_by_name():
    known = frontier.measurable()
    assert known["differential"].model == {"mechanism": "differential"}
    assert frontier.why_not(known["differential"]) is None


def test_the_mqar_models_not_yet_started_move_to_a_second_process(monkeypatch):
    """Once the language models are done, the MQAR models the first helper has not begun
    go to a second process, last first; the ones it has begun stay where they are."""
    from contextlib import ExitStack
    from attnlab import frontier

    class Waiting:
        def __init__(self, started):
            self.started = started

        def cancel(self):
            return not self.started

    submitted = []

    class Second:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, call, mechanism, s):
            submitted.append(mechanism)
            return ("second", mechanism)

        def shutdown(self, wait=True, cancel_futures=False):
            pass

        _processes = {}

    monkeypatch.setattr(frontier, "ProcessPoolExecutor", Second)
    monkeypatch.setattr(frontier, "helpers", lambda s: 1)
    chosen = {n: f"entry {n}" for n in ("mha", "gqa", "linear", "deltanet")}
    recall = {"mha": Waiting(True), "gqa": Waiting(True), "linear": Waiting(False),
              "deltanet": Waiting(False)}
    with ExitStack() as stack:
        frontier.share_the_rest(recall, chosen, frontier.Settings(), stack)
    assert submitted == ["entry deltanet", "entry linear"]
    assert recall["linear"] == ("second", "entry linear") and isinstance(recall["mha"], Waiting)


def test_a_frontier_worker_dies_with_its_parent_and_an_error_stops_it():
    """A worker pool's process is killed with this one (PR_SET_PDEATHSIG) and leaves
    Ctrl-C to it; closing the pool's stack on an error stops the model it is training
    instead of waiting for it (waiting, this test would sleep for ten minutes)."""
    import signal
    import time
    from contextlib import ExitStack
    from attnlab import frontier
    with pytest.raises(RuntimeError):
        with ExitStack() as stack:
            pool = frontier.worker_pool(stack)
            assert pool.submit(_worker_facts).result() == (signal.SIG_IGN, signal.SIGKILL)
            long, waiting = pool.submit(time.sleep, 600), pool.submit(time.sleep, 600)
            while not long.running():
                time.sleep(0.05)
            raise RuntimeError("an error in the parent")
    assert long.done() and waiting.done()         # failed, not run: the pool is closed


def _worker_facts():
    import ctypes
    import signal
    death = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death))            # PR_GET_PDEATHSIG
    return signal.getsignal(signal.SIGINT), death.value


def test_a_per_layer_list_is_measured_by_its_name_and_a_wrong_part_refused():
    """--mechanisms linear,mha (the docs' other hybrid order) is a row; a list with a part
    that is no mechanism is refused with the others."""
    from attnlab import frontier
    known = frontier.measurable(["linear,mha", "linear,mhaa"])
    assert known["linear,mha"].model == {"mechanism": "linear,mha"}
    assert "linear,mhaa" not in known
    with pytest.raises(Exception, match="--mechanisms linear,mhaa: not a mechanism"):
        frontier.settings_of(frontier.parser().parse_args(["--quick", "--mechanisms", "linear,mhaa"]))
    frontier.settings_of(frontier.parser().parse_args(["--quick", "--mechanisms", "linear,mha"]))


def test_quick_never_replaces_a_measured_table(tmp_path):
    from attnlab import frontier
    (tmp_path / "frontier.md").write_text("Frontier, 2026-12-07 ...\n| mechanism |\n")
    with pytest.raises(Exception, match="holds a measured frontier"):
        frontier.refuse_to_replace_a_measurement(tmp_path, quick=True)
    frontier.refuse_to_replace_a_measurement(tmp_path, quick=False)      # a measurement may
    (tmp_path / "frontier.md").write_text(f"**{frontier.QUICK_NOTE}**\n\nFrontier ...\n")
    frontier.refuse_to_replace_a_measurement(tmp_path, quick=True)       # noise over noise
