"""The variant matrix and the length-extrapolation study, end to end on a tiny setting."""
import csv
import json

from conftest import ROOT, run_script


def test_compare_then_extrapolate(corpus, tmp_path):
    out = tmp_path / "cmp"
    # The tiny preset with its token files in this test's folder (compare has no option
    # for the cache; the preset carries it to every variant and to extrapolate). A config
    # file names only folders below the one the command runs from, so both run there.
    base = tmp_path / "tiny.toml"
    base.write_text((ROOT / "configs" / "tiny.toml").read_text() + '\n[data]\ncache_dir = "cache"\n')
    proc = run_script("-m", "attnlab.compare", "--base", base, "--steps", "12", "--out", out,
                      "--data", corpus, "--variant", "rope=", "--variant",
                      "learned=--model.position=learned", "--variant", "alibi=--model.position=alibi",
                      cwd=tmp_path)
    assert "results.md" in proc.stdout
    # The cache the config file names is below the folder the command ran from, not the project.
    assert (tmp_path / "cache").is_dir() and not (ROOT / "cache").exists()
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["variant"] for r in rows] == ["rope", "learned", "alibi"]
    for r in rows:
        evals = [json.loads(l) for l in (out / r["variant"] / "metrics.jsonl").read_text().splitlines()]
        untrained = next(e["val_loss"] for e in evals if e.get("step") == 0 and "val_loss" in e)
        assert float(r["val_loss"]) < untrained - 0.1 and float(r["tokens_per_s"]) > 0
        assert float(r["peak_memory_mb"]) > 50 and int(r["params"]) > 1000
    table = (out / "results.md").read_text()
    assert table.count("\n") == 5 and "bpb" in table
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"

    proc = run_script("-m", "attnlab.extrapolate", "--from", out, "--factors", "1", "2", "4",
                      "--batches", "2", cwd=tmp_path)
    md = (out / "extrapolation.md").read_text()
    assert "| learned | learned | " in md and "n/a" in md             # not a crash
    assert "rope + YaRN" in md and "rope + NTK" in md and "rope + PI" in md
    rows = list(csv.DictReader(open(out / "extrapolation.csv")))
    rope = {r["factor"]: float(r["val_loss"]) for r in rows if r["scheme"] == "rope"}
    assert set(rope) == {"1", "2", "4"}
    pi_at_1 = [float(r["val_loss"]) for r in rows if r["scheme"] == "rope + PI" and r["factor"] == "1"]
    assert pi_at_1 == [rope["1"]]                                     # 1x scaling is plain RoPE
    assert (out / "extrapolation.png").stat().st_size > 10_000


def test_compare_refuses_a_bad_variant_before_training(tmp_path):
    proc = run_script("-m", "attnlab.compare", "--base", "tiny", "--out", tmp_path / "x",
                      "--variant", "bad=--model.position=rotary", check=False)
    assert proc.returncode == 2 and "valid choices: alibi, learned" in proc.stderr
    assert not list((tmp_path / "x").glob("*/metrics.jsonl"))
