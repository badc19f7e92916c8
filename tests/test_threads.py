"""common/threads.py: torch's OpenMP threads wait passively unless told otherwise, set
by the scripts before torch loads (OpenMP reads the setting only then)."""
from pathlib import Path

import pytest

from common.threads import busy_cores, wait_passively

ROOT = Path(__file__).resolve().parent.parent


def test_threads_wait_asleep_only_when_other_work_holds_the_cpu():
    said = []
    env = {}
    wait_passively(env, busy=lambda: 1.2, say=said.append)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "1.2" in said[0]
    env = {}
    wait_passively(env, busy=lambda: 0.1, say=said.append)     # a quiet machine: spin
    assert env == {} and len(said) == 1
    env = {}
    wait_passively(env, busy=lambda: None, say=said.append)    # no /proc/stat: leave it
    assert env == {}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):         # the user's choice wins
        env = {name: "ACTIVE" if name == "OMP_WAIT_POLICY" else "1000"}
        wait_passively(env, busy=lambda: 2.0, say=said.append)
        assert "OMP_WAIT_POLICY" not in env or env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_busy_cores_reads_the_work_done_between_two_samples(tmp_path):
    """Two readings of /proc/stat's first line: 150 of 200 jiffies busy on 2 cores."""
    stat = tmp_path / "stat"
    readings = iter(["cpu 100 0 100 700 0 0 0 0 0 0\n", "cpu 200 0 150 750 0 0 0 0 0 0\n"])
    import builtins
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if str(path) == str(stat):
            stat.write_text(next(readings))
        return real_open(path, *a, **k)
    builtins.open = fake_open
    try:
        import os
        got = busy_cores(0, str(stat))
    finally:
        builtins.open = real_open
    assert got == pytest.approx((os.cpu_count() or 1) * 150 / 200)
    assert busy_cores(0, str(tmp_path / "missing")) is None


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_the_scripts_set_it_before_they_import_the_project(script):
    """The project's first import (engine/, which loads torch) comes after the setting."""
    lines = (ROOT / script).read_text().splitlines()
    first = min(i for i, line in enumerate(lines)
                if line.startswith(("from engine", "from model", "from data", "import torch")))
    assert any(line.startswith("wait_passively()") for line in lines[:first])


def test_the_choice_is_said_when_work_starts_not_before_an_error_line(capsys):
    """A mistyped option on a busy machine still gets one line: the threads line waits
    for report(), which train.py and sample.py call once the run is set up."""
    from common import threads
    threads._pending.clear()                  # importing train.py elsewhere may have left one
    env = {}
    wait_passively(env, busy=lambda: 1.5)
    assert capsys.readouterr().err == ""
    said = []
    threads.report(say=said.append)
    threads.report(say=said.append)                            # said once
    assert len(said) == 1 and "1.5" in said[0] and env == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_the_scripts_report_it_after_they_parse(script):
    text = (ROOT / script).read_text()
    assert text.index("parse_args(") < text.index("report_threads()")
