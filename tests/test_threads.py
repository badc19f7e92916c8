"""common/threads.py: torch's OpenMP threads wait passively unless told otherwise, set
by the scripts before torch loads (OpenMP reads the setting only then); and while a run
trains, fewer threads where other work holds a core."""
import os
from pathlib import Path

import pytest
import torch

from common import threads
from common.threads import (Reading, ThreadState, busy_cores, choose_threads, other_cores,
                            wait_passively)

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
    for one in ({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1,2"}):   # no thread waits
        env = dict(one)
        wait_passively(env, busy=lambda: 1.5, say=said.append)
        assert env == one and len(said) == 1
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


@pytest.mark.parametrize("script,call", [("train.py", "start_on_free_cores()"),
                                         ("sample.py", "wait_passively()")])
def test_the_scripts_set_it_before_they_import_the_project(script, call):
    """The project's first import (engine/, which loads torch) comes after the setting."""
    lines = (ROOT / script).read_text().splitlines()
    first = min(i for i, line in enumerate(lines)
                if line.lstrip().startswith(("from engine", "from model", "from data", "import torch")))
    assert any(line.startswith(call) for line in lines[:first])


@pytest.fixture
def fresh_start():
    threads._start.clear()
    threads._pending.clear()
    yield
    threads._start.clear()
    threads._pending.clear()


def test_a_training_run_started_under_load_starts_on_the_free_cores_and_takes_them_back(
        fresh_start, monkeypatch):
    """A burst at the start no longer fixes how the threads wait for the whole run: the wait
    policy stays, torch starts on the cores left free, and the watch (or, before --budget
    measures, free_again) gives the others back once the machine is free."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    env, said, count = {}, [], [2]
    threads.start_on_free_cores(env, busy=lambda: 1.1, say=said.append)
    assert env == {} and said == ["threads: other work holds 1.1 of 2 cores, so torch starts on "
                                  "1 thread and takes the others back once the machine is free "
                                  "(set OMP_NUM_THREADS to choose)"]
    threads.apply_start(lambda: count[0], lambda n: count.__setitem__(0, n))
    assert count == [1]
    assert not threads.free_again(lambda n: count.__setitem__(0, n), busy=lambda: 1.0)
    assert count == [1]                                        # still busy: stays
    watch = threads.watch(True, 1, lambda: count[0], lambda n: count.__setitem__(0, n), said.append,
                          env=env)
    assert isinstance(watch, threads.ThreadWatch) and watch.full == 2 and watch.state.threads == 1
    assert threads.free_again(lambda n: count.__setitem__(0, n), busy=lambda: 0.1)
    assert count == [2] and not threads._start
    assert threads._pending[-1] == "threads: the machine is free again: torch goes back to 2 threads"


def test_a_start_under_load_without_a_watch_gets_its_threads_back_at_once(fresh_start, monkeypatch):
    """A GPU run or torchrun has no watch: the threads come back when that is known."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    threads.start_on_free_cores({}, busy=lambda: 1.5, say=lambda line: None)
    count = [2]
    threads.apply_start(lambda: count[0], lambda n: count.__setitem__(0, n))
    assert count == [1]
    threads.watch(False, 1, lambda: count[0], lambda n: count.__setitem__(0, n), print, env={})
    assert count == [2]


@pytest.mark.parametrize("env,busy,passive", [
    ({}, 0.1, False),                                  # quiet: nothing changes
    ({"OMP_NUM_THREADS": "2"}, 1.5, False),             # the user's count
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 1.5, False),        # the user's policy
    ({"WORLD_SIZE": "2"}, 1.5, True)])                 # torchrun: no watch, so passive
def test_a_start_under_load_is_left_alone_where_the_user_chose(fresh_start, monkeypatch, env,
                                                                busy, passive):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    threads.start_on_free_cores(env, busy=lambda: busy, say=lambda line: None)
    assert not threads._start
    assert (env.get("OMP_WAIT_POLICY") == "PASSIVE") == passive


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


def test_other_work_is_the_machines_less_this_processs_own():
    """2 cores, 2 s: the machine busy 300 of 400 ticks (1.5 cores), this process 2 CPU
    seconds (1 core): other programs held 0.5."""
    before, after = Reading(10.0, 1000, 4000, 5.0), Reading(12.0, 1300, 4400, 7.0)
    assert other_cores(before, after, cores=2) == pytest.approx(0.5)
    assert other_cores(before, Reading(12.0, 1300, 4400, 9.0), cores=2) == 0.0  # never below 0
    assert other_cores(None, after, 2) is None and other_cores(before, None, 2) is None
    assert other_cores(after, after, 2) is None                                  # no time passed


def test_fewer_threads_while_other_work_holds_a_core_and_back_when_free():
    """The readings of docs/benchmarks.md: a spinner beside 2 spinning threads reads about
    0.6, beside 1 thread 1.0, a quiet machine under 0.1."""
    def run(readings, full=2, cores=2, state=None):
        state, seen = state or ThreadState(full), []
        for other in readings:
            state = choose_threads(state, other, full, cores)
            seen.append(state.threads)
        return state, seen
    assert run([0.05, 0.0, None, 0.3])[1] == [2, 2, 2, 2]          # quiet, or too little
    state, seen = run([0.6, 1.0, 1.0, 0.05, 0.05, 0.05, 0.05])
    assert seen == [1, 1, 1, 1, 1, 2, 2]                           # back after FREE_LOOKS free looks
    # Load that comes and goes: each return asks for twice as many free looks.
    state, seen = run([0.7] + [0.05] * 6, state=state)
    assert seen == [1] * 6 + [2]
    # Work between FREE and HELD neither drops the threads nor counts as free.
    assert run([1.0, 0.05, 0.05, 0.3, 0.05, 0.05, 0.3, 0.05])[1] == [1] * 8
    # More cores: the threads fit beside the cores the other work holds.
    assert run([0.9, 3.5, 0.9], full=16, cores=16)[1] == [15, 12, 12]
    assert run([1.5], full=4, cores=8)[1] == [4]                   # free cores enough already


def _fake_readings(other: float):
    """Readings in which other programs hold `other` cores beside this process's one."""
    cores, k = os.cpu_count() or 1, iter(range(1, 10_000))

    def read():
        t = next(k)
        return Reading(float(t), int(100 * t * (1 + other)), 100 * t * cores, float(t))
    return read


def test_a_run_that_meets_other_work_goes_on_with_fewer_threads_and_says_so_once(
        corpus, tmp_path, monkeypatch, capsys):
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one core: torch uses one thread")
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "LOOK_EVERY", 0.0)              # a look at every step's end
    monkeypatch.setattr(threads, "read_machine", _fake_readings(cores - 1.0))
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.max_iters=4",
                             "--train.run_name=t"])
    run = setup_run(cfg, log=lambda *a: None)
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(run)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(was)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("threads:")]
    assert after == 1
    assert said == [f"threads: other work now holds {cores - 1:.1f} of {cores} cores: torch goes on "
                    "with 1 thread, spinning threads would fight it (set OMP_NUM_THREADS to choose)"]


@pytest.mark.parametrize("on_cpu,processes,threads_now,env", [
    (False, 1, 2, {}), (True, 2, 2, {}), (True, 1, 1, {}), (True, 1, 2, {"OMP_NUM_THREADS": "2"}),
    (True, 1, 2, {"OMP_WAIT_POLICY": "PASSIVE"}), (True, 1, 2, {"GOMP_SPINCOUNT": "1000"})])
def test_no_watch_where_threads_do_not_spin_or_the_user_chose(on_cpu, processes, threads_now, env):
    """A GPU run, torchrun, one thread, the user's thread count or wait policy, or threads
    that wait_passively already made wait asleep: nothing to watch."""
    chosen = threads.watch(on_cpu, processes, lambda: threads_now, lambda n: None, print, env=env)
    assert not isinstance(chosen, threads.ThreadWatch)
    if os.path.exists("/proc/stat"):
        assert isinstance(threads.watch(True, 1, lambda: 2, lambda n: None, print, env={}),
                          threads.ThreadWatch)
