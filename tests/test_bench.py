"""bench/*.py explain themselves: each --help opens with a whole sentence or more of what
the script measures, and says what every option does."""
import argparse
import importlib.util
import json
import os
import re
import sys

import pytest

from conftest import ROOT

SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "add_argument" in p.read_text())


class Parsing(BaseException):
    """Raised where a script's parser would parse, carrying the parser; a BaseException
    so that no `except Exception` in a main() swallows it."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parser_of(path) -> argparse.ArgumentParser:
    """The parser the script's main() builds, caught before it parses anything."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    env, argv, sys_path = dict(os.environ), sys.argv, list(sys.path)
    original = argparse.ArgumentParser.parse_known_args

    def caught(self, args=None, namespace=None):
        raise Parsing(self)

    argparse.ArgumentParser.parse_known_args = caught
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))                  # a script's own folder, as python runs it
    try:
        spec.loader.exec_module(module)                   # not as __main__: main() is not run
        module.main()
    except Parsing as parsing:
        return parsing.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv, sys.path[:] = argv, sys_path
        os.environ.clear()
        os.environ.update(env)
    raise AssertionError(f"{path.name}'s main() returned without parsing its arguments")


def test_there_are_bench_scripts_to_check():
    assert len(SCRIPTS) >= 15 and ROOT / "bench" / "cpu_kinds.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_each_bench_scripts_help_says_what_it_does_and_what_each_option_does(path):
    parser = parser_of(path)
    description = " ".join((parser.description or "").split())
    # A description cut at the docstring's first line ends mid-sentence, often on a comma.
    assert re.search(r"[.?!]\)?$", description), \
        f"{path.name}: its --help description stops mid-sentence: {description!r}"
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and not action.help]
    assert not silent, f"{path.name}: options without help text: {silent}"


def bench_script(name: str):
    """bench/NAME.py as a module (the scripts are not a package: their folder on the path
    while one is loaded)."""
    path = ROOT / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def attention_cost():
    return bench_script("attention_cost")


def test_attention_costs_default_is_quick_and_the_full_sweep_is_named():
    """The walkthrough's `python bench/attention_cost.py` ran past 10 minutes (T up to
    16,384) with no word of how long; the long sweep is now --full, its time stated."""
    parser = parser_of(ROOT / "bench" / "attention_cost.py")
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "a minute or two" in helps["--lengths"] and "over 10 minutes" in helps["--full"]
    module = attention_cost()
    assert max(module.QUICK_LENGTHS) <= 2048 and max(module.FULL_LENGTHS) == 16384


def test_attention_cost_writes_each_case_as_it_is_timed(tmp_path, monkeypatch):
    """The results were written only at the end, so a sweep stopped part way left
    `attnlab.figures cost` an empty panel."""
    import json
    module = attention_cost()
    monkeypatch.setattr(module, "OUT_JSON", tmp_path / "attention_cost.json")
    timed = []

    def measure(*args, **kwargs):
        if len(timed) == 3:
            raise KeyboardInterrupt                    # stopped part way
        timed.append(args)
        return 0.001 * len(timed), 0
    monkeypatch.setattr(module, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["attention_cost.py", "--devices", "cpu", "--plot", ""])
    with pytest.raises(KeyboardInterrupt):
        module.main()
    rows = json.loads((tmp_path / "attention_cost.json").read_text())
    assert [r["seconds"] for r in rows] == [0.001, 0.002, 0.003]
    assert list(tmp_path.iterdir()) == [tmp_path / "attention_cost.json"]      # no part file left


def card_time_script():
    return bench_script("card_time")


def test_card_time_counts_a_full_runs_evaluations(tmp_path):
    """A full run evaluates at step 0, at every eval_interval and at the last step where it
    falls between two; a field the preset leaves out is the default's."""
    module = card_time_script()
    between, on = tmp_path / "between.toml", tmp_path / "on.toml"
    between.write_text("[train]\nmax_iters = 450\neval_interval = 200\n")     # 0, 200, 400, 450
    on.write_text("[train]\nmax_iters = 400\neval_interval = 200\n")          # 0, 200, 400
    assert module.full_run(str(between), 1.0, 10.0) == (450, 4, 490.0)
    assert module.full_run(str(on), 1.0, 10.0) == (400, 3, 430.0)
    assert module.full_run("cpu", 1.0, 10.0) == (1500, 7, 1570.0)


def cards_script():
    path = ROOT / "bench" / "cards.py"
    spec = importlib.util.spec_from_file_location("bench_cards", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_cards_switch_each_piece_off_on_its_own_card():
    """Every card of the issue is measured, each piece's row builds, differs from its card
    in the fields of that piece alone, and keeps the rest (gpt-oss without sinks keeps
    its windows: plain attention over the same keys)."""
    from dataclasses import asdict
    from model import GPT
    cards = cards_script()
    assert set(cards.PIECES) == {"gpt-oss", "qwen3-next", "deepseek-v3", "deepseek-v3.2",
                                 "gemma3", "kimi-linear"}
    rows = cards.rows_of(list(cards.PIECES))
    assert rows[0].preset == "cpu" and not rows[0].off
    for row in rows:
        model = cards.config_of(row).model
        GPT.skeleton(model.__class__(**{**asdict(model), "vocab_size": 8}))
        if row.off:
            card = asdict(cards.config_of(cards.Row(row.preset)).model)
            differs = {k for k, v in asdict(model).items() if card[k] != v}
            assert differs and differs == set(row.fields), row.name
    by_name = {r.name: cards.config_of(r).model for r in rows}
    plain, oss = by_name["gpt-oss--no-sinks"], by_name["gpt-oss"]
    assert plain.mechanism == "mha" and oss.mechanism == "sinks"
    assert (plain.sliding_window, plain.full_attention_every) == (32, 2)
    assert by_name["deepseek-v3--no-mtp"].mtp_depth == 0
    assert by_name["deepseek-v3--no-experts"].mlp == "swiglu"
    assert by_name["qwen3-next--no-gate"].mechanism.split(",")[-1] == "mha"


def test_cards_plan_their_steps_once_and_a_plan_given_runs_the_same_steps(tmp_path, monkeypatch):
    """Equal wall time without a timing deciding anything in a run: each row's steps come
    from one probe before training (printed and written to plan.json), and --plan runs the
    same steps again with nothing timed. The table gives each speed and size its ratio to
    the baseline row, and the val loss of a piece's row against its card's."""
    from attnlab import frontier
    cards = cards_script()
    rate = {"cpu": 10.0, "gemma3": 4.0, "gemma3--no-windows": 5.0,
            "gemma3--no-qk_norm": 4.5, "gemma3--no-sandwich": 6.0}
    trained = []

    def language_model(row, steps, s, out):
        trained.append((row.name, steps, os.environ["OMP_NUM_THREADS"]))
        return {"params": 1000, "val_loss": 2.0 + steps / 1000, "train_s": 20.0,
                "train_tokens_per_s": 2000.0 if row.name == "cpu" else 1000.0}

    def decoding(row, s):
        return {**{f"decode_ms_at_{n}": 1.0 for n in s.frontier_sizes.contexts},
                "cache_bytes_per_token": 4096.0 if row.name == "cpu" else 1024.0,
                "state_bytes": 0.0}

    recalled = []

    def mqar(mechanism, s):                 # at the frontier's width, the card's own layers
        recalled.append((mechanism.model["n_embd"], mechanism.model["n_layer"]))
        return {f"mqar_{n}_{p}": 0.5 for n, p in frontier.mqar_cells(s)}

    monkeypatch.setattr(cards, "probe", lambda rows, s: {r.name: rate[r.name] for r in rows})
    monkeypatch.setattr(cards, "language_model", language_model)
    monkeypatch.setattr(cards, "decoding", decoding)
    monkeypatch.setattr(frontier, "mqar", mqar)
    monkeypatch.setattr(frontier, "helpers", lambda s: 0)      # MQAR here, not in a process
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")                 # put back after the test
    monkeypatch.setattr(cards, "use_threads", lambda n, env: env.update(OMP_NUM_THREADS=str(n)))
    out = tmp_path / "cards"
    assert cards.main(["--quick", "--cards", "gemma3", "--seconds", "20", "--threads", "2",
                       "--out", str(out)]) == 0
    first = list(trained)
    assert first == [(name, round(20 * r), "2") for name, r in rate.items()]
    assert recalled == [(64, 4)] + [(64, 6)] * 4
    table = (out / "cards.md").read_text()
    assert "machine: " in table and "(0.50x)" in table and "(0.25x)" in table
    assert "| gemma3--no-windows | 1,000 | 100 | 20 | 2.100 | +0.020 |" in table

    def no_timing(rows, s):
        raise AssertionError("a plan given, yet a row was timed")
    monkeypatch.setattr(cards, "probe", no_timing)
    trained.clear()
    replay = tmp_path / "again"
    cards.main(["--quick", "--cards", "gemma3", "--plan", str(out / "plan.json"), "--out", str(replay)])
    assert trained == first
    body = lambda p: p.read_text().split("\n", 3)[3]          # past the dated machine line
    assert body(replay / "cards.md") == body(out / "cards.md")


def test_cards_refuse_a_plan_without_the_rows_asked_for(tmp_path):
    cards = cards_script()
    plan = tmp_path / "plan.json"
    plan.write_text('{"seconds": 5, "threads": 1, "rows": {"cpu": {"steps_per_s": 1.0, "steps": 5}}}')
    with pytest.raises(Exception, match="no steps for gemma3"):
        cards.read_plan(plan, cards.rows_of(["gemma3"]), False)
    plan.write_text('{"seconds": 5, "threads": 1, "rows": {"cpu": {"steps_per_s": 1.0, "steps": 2.5}}}')
    with pytest.raises(Exception, match="no whole number of steps for cpu"):
        cards.read_plan(plan, cards.rows_of([]), False)
    # A --quick plan evaluates and runs MQAR smaller: replayed without --quick it would not
    # compute what it did, so it is refused, and the other way round.
    plan.write_text('{"seconds": 5, "threads": 1, "quick": true, "rows": {"cpu": {"steps_per_s": 1.0, "steps": 5}}}')
    with pytest.raises(Exception, match="written by a run with --quick"):
        cards.read_plan(plan, cards.rows_of([]), False)
    assert cards.read_plan(plan, cards.rows_of([]), True)[3] == {"cpu": 5}
    plan.write_text('{"seconds": 5, "threads": 1, "rows": {"cpu": {"steps_per_s": 1.0, "steps": 5}}}')
    with pytest.raises(Exception, match="written by a run without --quick"):
        cards.read_plan(plan, cards.rows_of([]), True)


@pytest.mark.parametrize("edit,said", [
    ({"threads": 0}, "threads 0"), ({"seconds": -1}, "seconds -1"),
    ({"rows": {"cpu": {"steps_per_s": 5.0, "steps": 10**12}}}, "cpu's 1000000000000 steps at 5 steps/s"),
])
def test_cards_refuse_an_edited_plan(tmp_path, edit, said):
    """A plan's steps are its seconds times each rate; its seconds and threads in range."""
    cards = cards_script()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"seconds": 2, "threads": 1, "rows": {"cpu": {"steps_per_s": 5.0,
                                                                            "steps": 10}}, **edit}))
    with pytest.raises(Exception, match=f"{re.escape(said)} is not what this script plans"):
        cards.read_plan(plan, cards.rows_of([]), False)


def test_cards_refuse_no_threads():
    with pytest.raises(Exception, match="--threads 0: give 1 to"):
        cards_script().main(["--quick", "--threads", "0"])


class Killed(Exception):
    """A kill, as a test can raise one (pytest stops at a KeyboardInterrupt)."""


def test_cards_killed_resume_from_the_row_they_were_on(tmp_path, monkeypatch):
    """A sitting killed part way loses at most the row it was on: started again with its
    plan and folder, the rows measured before are read back (rows/), not trained or
    scored again, and the table is the one an unbroken run writes."""
    from attnlab import frontier
    cards = cards_script()
    trained, recalled, kills = [], [], ["gemma3--no-qk_norm"]

    def language_model(row, steps, s, out):
        if row.name in kills:
            kills.remove(row.name)
            raise Killed
        trained.append(row.name)
        return {"params": 1000, "val_loss": 2.0 + steps / 1000, "train_s": 20.0,
                "train_tokens_per_s": 1000.0}

    def mqar(mechanism, s):
        recalled.append(mechanism.about)
        return {f"mqar_{n}_{p}": 0.5 for n, p in frontier.mqar_cells(s)}

    monkeypatch.setattr(cards, "probe", lambda rows, s: {r.name: 4.0 for r in rows})
    monkeypatch.setattr(cards, "language_model", language_model)
    monkeypatch.setattr(cards, "decoding", lambda row, s: {
        **{f"decode_ms_at_{n}": 1.0 for n in s.frontier_sizes.contexts},
        "cache_bytes_per_token": 1024.0, "state_bytes": 0.0})
    monkeypatch.setattr(frontier, "mqar", mqar)
    monkeypatch.setattr(frontier, "helpers", lambda s: 0)
    monkeypatch.setattr(cards, "use_threads", lambda n, env: None)
    out = tmp_path / "cards"
    with pytest.raises(Killed):
        cards.main(["--quick", "--cards", "gemma3", "--seconds", "5", "--out", str(out)])
    assert trained == ["cpu", "gemma3", "gemma3--no-windows"] and recalled == []
    trained.clear()
    with pytest.raises(Exception, match="planned for 5 s on 1 thread.*another --out"):
        cards.main(["--quick", "--cards", "gemma3", "--seconds", "6", "--out", str(out)])
    # The same command again goes on with the sitting (its plan.json), as --plan would.
    cards.main(["--quick", "--cards", "gemma3", "--seconds", "5", "--out", str(out)])
    assert trained == ["gemma3--no-qk_norm", "gemma3--no-sandwich"]
    assert len(recalled) == 5
    recalled.clear(), trained.clear()
    again = (out / "cards.md").read_text()
    cards.main(["--quick", "--cards", "gemma3", "--plan", str(out / "plan.json"), "--out", str(out)])
    assert trained == [] and recalled == []                   # every row kept: nothing redone
    body = lambda text: text.split("\n", 3)[3]
    assert body((out / "cards.md").read_text()) == body(again)
    # What a row's numbers depend on is its key: a longer MQAR schedule measures anew.
    kept = json.loads((out / "rows" / "gemma3.mqar.json").read_text())
    kept["key"]["sizes"]["mqar_steps"] += 1
    (out / "rows" / "gemma3.mqar.json").write_text(json.dumps(kept))
    cards.main(["--quick", "--cards", "gemma3", "--plan", str(out / "plan.json"), "--out", str(out)])
    assert recalled == ["the card as its preset"]
    # A kept row edited into what this script never writes is measured again, not shown.
    kept = json.loads((out / "rows" / "gemma3.lm.json").read_text())
    kept["result"]["val_loss"] = "abc"
    (out / "rows" / "gemma3.lm.json").write_text(json.dumps(kept))
    trained.clear()
    cards.main(["--quick", "--cards", "gemma3", "--out", str(out)])
    assert trained == ["gemma3"]


def test_cards_refuse_a_run_folder_of_another_plan(tmp_path):
    """lm/ROW left by a start with other steps is refused, not resumed into the table."""
    cards = cards_script()
    row = cards.Row("gemma3")
    run = tmp_path / "lm" / "gemma3"
    (run / "checkpoints").mkdir(parents=True)
    from dataclasses import asdict
    model = asdict(cards.config_of(row).model)
    (run / "config.json").write_text(json.dumps({"model": model, "train": {"max_iters": 200}}))
    assert cards.earlier_run(row, 200, tmp_path)
    with pytest.raises(Exception, match="another config or plan.*--plan it was started with"):
        cards.earlier_run(row, 201, tmp_path)
    (run / "config.json").write_text(json.dumps({"model": {**model, "n_head": 2},
                                                 "train": {"max_iters": 200}}))
    with pytest.raises(Exception, match="another config or plan"):
        cards.earlier_run(row, 200, tmp_path)
    (run / "config.json").write_text("[1, 2")
    with pytest.raises(Exception, match="not a run of this script's"):
        cards.earlier_run(row, 200, tmp_path)
    assert not cards.earlier_run(cards.Row("cpu"), 200, tmp_path)


def test_cards_refuse_a_folder_of_another_plan_before_any_work(tmp_path, monkeypatch):
    """A row whose lm/ folder holds another plan's run is refused before the first row
    trains, not after the others' hour of work."""
    cards = cards_script()
    out = tmp_path / "cards"
    (out / "lm" / "gemma3--no-sandwich" / "checkpoints").mkdir(parents=True)
    (out / "lm" / "gemma3--no-sandwich" / "config.json").write_text(
        '{"model": {}, "train": {"max_iters": 1}}')
    trained = []
    monkeypatch.setattr(cards, "probe", lambda rows, s: {r.name: 4.0 for r in rows})
    monkeypatch.setattr(cards, "language_model", lambda row, *a: trained.append(row.name))
    monkeypatch.setattr(cards, "use_threads", lambda n, env: None)
    with pytest.raises(Exception, match="gemma3--no-sandwich holds a run of another config"):
        cards.main(["--quick", "--cards", "gemma3", "--seconds", "5", "--out", str(out)])
    assert trained == []
