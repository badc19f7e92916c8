"""common/cpu.py: an ATEN_CPU_CAPABILITY the CPU cannot run is refused with one line
before torch loads (torch itself would die of SIGILL at its first such kernel)."""
import subprocess
import sys
from pathlib import Path

import pytest

from common.cpu import NEEDS, capability_problem, cpu_flags, vector_flags

ROOT = Path(__file__).resolve().parent.parent
AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma avx avx2 bmi2"        # Zen 3
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"


def cpuinfo(tmp_path, flags: str | None) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: a CPU\n" + (f"flags\t\t: {flags}\n" if flags else ""))
    return str(path)


def test_avx512_asked_of_an_avx2_cpu_is_refused_saying_what_to_do(tmp_path):
    problem = capability_problem({"ATEN_CPU_CAPABILITY": "avx512"}, cpuinfo(tmp_path, AVX2_FLAGS))
    assert "avx512f, avx512bw, avx512vl, avx512dq" in problem
    assert problem.endswith("unset ATEN_CPU_CAPABILITY, or set it to avx2")
    older = capability_problem({"ATEN_CPU_CAPABILITY": "avx2"}, cpuinfo(tmp_path, "fpu sse sse2 avx"))
    assert "avx2, fma" in older and older.endswith("set it to default")


@pytest.mark.parametrize("value,flags", [
    ("avx512", AVX512_FLAGS), ("avx2", AVX2_FLAGS), ("default", "fpu sse"), (None, "fpu sse"),
    ("avx512", None), ("sve256", None)])   # no flags line (an ARM CPU): torch's to judge
def test_what_the_cpu_runs_passes(tmp_path, value, flags):
    env = {} if value is None else {"ATEN_CPU_CAPABILITY": value}
    assert capability_problem(env, cpuinfo(tmp_path, flags)) is None


@pytest.mark.parametrize("value", ["AVX2", "AVX512", "avx512_vnni", "garbage", ""])
def test_a_value_torch_would_ignore_is_named_as_a_typo(tmp_path, value):
    """torch compares the value case-sensitively and ignores any other with a two-line
    warning; the scripts say it in one line, with the values it takes."""
    problem = capability_problem({"ATEN_CPU_CAPABILITY": value}, cpuinfo(tmp_path, AVX512_FLAGS))
    assert problem == (f"ATEN_CPU_CAPABILITY={value} is not a value torch knows on this CPU, "
                       "so it would be ignored; set it to avx512, avx2 or default (lower case), "
                       "or unset it")
    # only what this CPU can run is offered
    assert "set it to avx2 or default (lower case)" in capability_problem(
        {"ATEN_CPU_CAPABILITY": value}, cpuinfo(tmp_path, AVX2_FLAGS))
    assert "set it to default (lower case)" in capability_problem(
        {"ATEN_CPU_CAPABILITY": value}, cpuinfo(tmp_path, "fpu sse sse2 avx"))


def test_no_cpuinfo_no_check(tmp_path):
    """macOS has no /proc/cpuinfo: torch decides there, as before."""
    assert cpu_flags(str(tmp_path / "missing")) is None
    assert capability_problem({"ATEN_CPU_CAPABILITY": "avx512"}, str(tmp_path / "missing")) is None


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_the_scripts_check_before_torch_loads(script):
    lines = (ROOT / script).read_text().splitlines()
    first = min(i for i, line in enumerate(lines)
                if line.lstrip().startswith(("from engine", "from model", "from data", "from attnlab", "import torch")))
    assert any(line.startswith("refuse_unrunnable_capability()") for line in lines[:first])


@pytest.mark.skipif(cpu_flags() is None or cpu_flags().issuperset(NEEDS["avx512"]),
                    reason="needs an x86 CPU without AVX-512")
def test_train_py_refuses_it_with_one_line_on_this_cpu(tmp_path):
    """Without the check, this dies with exit status 132 and prints nothing."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "tiny",
                           f"--train.out_dir={tmp_path}"], cwd=tmp_path, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "ATEN_CPU_CAPABILITY": "avx512",
                                          "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(
        "error: ATEN_CPU_CAPABILITY=avx512 asks torch for kernels this CPU cannot run")


@pytest.mark.skipif(cpu_flags() is None or cpu_flags().issuperset(NEEDS["avx512"]),
                    reason="needs an x86 CPU without AVX-512")
def test_the_tools_refuse_it_too(tmp_path):
    """`python -m attnlab.NAME` says it in one line; a notebook's import raises, naming it."""
    env = {"PATH": "/usr/bin:/bin", "ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    tool = subprocess.run([sys.executable, "-m", "attnlab.heads", "grid", "--text", "ROMEO."],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert tool.returncode == 2 and tool.stdout == ""
    assert tool.stderr.splitlines() == [tool.stderr.strip()] and tool.stderr.startswith(
        "error: ATEN_CPU_CAPABILITY=avx512 asks torch for kernels this CPU cannot run")
    notebook = subprocess.run([sys.executable, "-c", "import attnlab.lens"], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=120)
    assert notebook.returncode == 1
    assert notebook.stderr.strip().splitlines()[-1].startswith(
        "ImportError: ATEN_CPU_CAPABILITY=avx512 asks torch for kernels")


def test_the_kind_deciding_flags_are_the_vector_fma_amx_and_bf16_ones(tmp_path):
    path = cpuinfo(tmp_path, "fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile sha_ni")
    assert vector_flags(path) == "amx_tile avx2 avx512_bf16 avx512f fma"
    assert vector_flags(cpuinfo(tmp_path, None)) == "?"


X86 = pytest.mark.skipif(cpu_flags() is None, reason="needs an x86 CPU (its flags in /proc/cpuinfo)")
# A value torch ignores is refused on any x86 CPU, with AVX-512 or without: the checks
# below run on both kinds. (`avx512` on an AVX2 CPU, which dies of SIGILL, is above.)
IGNORED = {"PATH": "/usr/bin:/bin", "ATEN_CPU_CAPABILITY": "AVX2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
RUNNABLE = [name for name, needs in NEEDS.items() if (cpu_flags() or set()).issuperset(needs)]
REFUSED = ("error: ATEN_CPU_CAPABILITY=AVX2 is not a value torch knows on this CPU, so it "
           f"would be ignored; set it to {', '.join(RUNNABLE)} or default (lower case), or unset it\n")
# Only a repro meant for torch's own tracker stays torch alone.
BENCH_WITHOUT_THE_CHECK = {"capability.py", "flex_cpu_repro.py"}


@X86
@pytest.mark.parametrize("code", ["import engine.run", "from data.tokens import load_tokens",
                                  "import attnlab.lens"])
def test_importing_the_packages_checks_nothing(tmp_path, code):
    """Importing is not starting: a notebook that imports engine/, data/ or attnlab/
    is not refused (the scripts and `python -m` tools check as they start)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env=IGNORED, timeout=120)
    assert proc.returncode == 0 and "error:" not in proc.stderr


@X86
@pytest.mark.parametrize("module", ["data.prepare", "attnlab.heads"])
def test_the_package_tools_refuse_it_in_one_line(tmp_path, module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tmp_path,
                          capture_output=True, text=True, env=IGNORED, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", REFUSED)


def test_every_bench_script_checks_before_anything_else():
    """bench/capability.py is each script's first import, before torch and the project."""
    for path in sorted((ROOT / "bench").glob("*.py")):
        if path.name in BENCH_WITHOUT_THE_CHECK:
            continue
        imports = [line for line in path.read_text().splitlines()
                   if line.startswith(("import ", "from ")) and not line.startswith("from __future__")]
        assert imports[0].startswith("import capability"), f"{path.name} imports {imports[0]!r} first"


@X86
def test_a_bench_script_refuses_it_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "train_speed.py"), "--help"],
                          cwd=tmp_path, capture_output=True, text=True, env=IGNORED, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", REFUSED)


def test_threads_wait_asleep_only_when_other_work_holds_the_cpu():
    """How threads wait, chosen as a script starts: passive where other work holds half a
    core; nothing where the machine is quiet, unreadable, torch uses one thread, or the
    user said how threads wait. The line says the numbers stay the same."""
    from common.cpu import wait_passively_if_busy
    env = {}
    line = wait_passively_if_busy(env, busy=lambda: 1.2)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "1.2" in line and "the same numbers" in line
    for load in (0.1, None):                                   # quiet, or no /proc/stat
        env = {}
        assert wait_passively_if_busy(env, busy=lambda: load) is None and env == {}
    for given in ({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1,2"},
                  {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        env = dict(given)
        assert wait_passively_if_busy(env, busy=lambda: 2.0) is None and env == given


def test_a_tool_started_beside_other_work_waits_asleep_as_the_scripts_do(tmp_path):
    """python -m attnlab.induction spun its threads against other work and took 16 times
    its quiet time; imported (a notebook, a test), the package changes nothing."""
    from common.cpu import check_tool_start
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t: avx2 avx512f avx512_bf16\n")
    for argv, want in ((["-m"], {"OMP_WAIT_POLICY": "PASSIVE"}), (["x.py"], {}), ([""], {})):
        env = {}
        check_tool_start(argv, env, str(cpuinfo), busy=lambda: 1.5)
        assert env == want, argv
