"""engine/machine.py: the machine in one room. `auto` names an entry of model/attention.py's
backends, chosen once from the config and the machine's kind and set on the model by name
(no copy of the formula runs outside model/); precision and threads
are decided from facts, never from a timing or the load, so the same command gives the
same numbers on a quiet and a busy machine, and across a kill -9 and a resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import machine
from model.attention import ATTENTION_BACKENDS, eager_attention, sdpa_attention
from model.config import ModelConfig
from model.attention import Mask
from reference import attention as reference_attention, mask_rule
from test_attention import MASKS, _inputs

ROOT = Path(__file__).resolve().parent.parent
F = torch.nn.functional


@pytest.fixture
def native_bf16(monkeypatch):
    """The room's choice as on a CPU with native bf16, whatever this one has: the
    arithmetic is the same, only slower where bf16 is emulated."""
    monkeypatch.setattr(machine, "native_bf16", lambda: True)


# --- what runs in bf16 on a CPU is the formula itself, or torch's kernel ------------------
@pytest.mark.parametrize("position", ["none", "alibi"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_the_bf16_backends_equal_the_float64_reference(backend, mask_name, position):
    """Every mask (causal, a chunk after a cache, a decoding step, a window, global tokens)
    and ALiBi's bias, forward and backward, in bf16 as autocast runs them on a CPU: within
    bf16's rounding of the formula in float64 on the same rounded inputs. Scores in bf16
    keep 8 bits, so the bound is 1% of the norm; a lost 1/√d_k, a hidden diagonal or an
    inverted mask is 10-100x beyond it."""
    q_start, q_len, k_len, window, n_global = MASKS[mask_name]
    q64, k64, v64, _, bias_fn = _inputs(MASKS[mask_name], position)
    q, k, v = (t.bfloat16().requires_grad_() for t in (q64, k64, v64))
    mask = Mask.over(q_start, q_len, k_len, window=window, n_global=n_global, bias_fn=bias_fn)
    allowed = mask_rule(range(q_start, q_start + q_len), range(k_len), window, n_global)
    bias = None if mask.bias is None else mask.bias.double().numpy()
    ref, _, backward = reference_attention(*(t.detach().double().numpy() for t in (q, k, v)),
                                           allowed, bias)
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, mask)
    assert out.dtype == torch.bfloat16
    rel = lambda x, r: np.linalg.norm(x.detach().double().numpy() - r) / np.linalg.norm(r)
    assert rel(out, ref) < 1e-2
    d_out = torch.from_numpy(np.random.default_rng(1).standard_normal(ref.shape)).bfloat16()
    out.backward(d_out)
    for name, t, expected in zip("qkv", (q, k, v), backward(d_out.double().numpy())):
        assert rel(t.grad, expected) < 2e-2, name


def test_no_second_copy_of_the_formula_runs_outside_model():
    """The engine names an entry of model/attention.py's registry; it computes nothing."""
    source = (ROOT / "engine" / "machine.py").read_text(encoding="utf-8")
    for written in ("softmax", "baddbmm", "scaled_dot_product_attention", "bmm("):
        assert written not in source, written


# --- auto: chosen once, set by name -----------------------------------------------------------
def _cfg(T=128, **kw):
    return ModelConfig(**{"vocab_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
                          "block_size": T, **kw})


@pytest.mark.parametrize("device,dtype,window,T,native,expected", [
    ("cpu", torch.float32, 0, 128, True, "sdpa"),
    ("cpu", torch.bfloat16, 0, 128, True, "eager"),
    ("cpu", torch.bfloat16, 0, 128, False, "sdpa"),
    # the README's window example, context 128 and a window of 32: the dense path
    ("cpu", torch.float32, 32, 128, True, "sdpa"),
    ("cpu", torch.bfloat16, 32, 128, True, "eager"),
    ("cpu", torch.float32, 32, 32 * machine.BAND_PAYS_FROM - 1, True, "sdpa"),
    ("cpu", torch.float32, 32, 32 * machine.BAND_PAYS_FROM, True, "banded"),
    ("cuda", torch.bfloat16, 0, 128, True, "sdpa"),
    ("cuda", torch.bfloat16, 32, 32 * machine.BAND_PAYS_FROM, True, "flex"),
    ("cuda", torch.bfloat16, 32, 128, True, "sdpa")])
def test_auto_takes_the_band_only_where_it_pays_and_the_formula_for_cpu_bf16(
        device, dtype, window, T, native, expected, monkeypatch):
    monkeypatch.setattr(machine, "native_bf16", lambda: native)
    cfg = _cfg(T=T, sliding_window=window, n_embd=64, n_head=2)
    assert machine.attention_backend(cfg, torch.device(device), dtype) == expected


def _calls_from_forward(layer, x, positions, mask, need_weights=False):
    """The Python calls on the way from MultiHeadAttention.forward to torch's
    scaled_dot_product_attention, or to eager_attention: the forward itself counted as 0."""
    paths, stack = [], []

    def profile(frame, event, arg):
        if event == "call":
            stack.append(frame.f_code.co_name)
        elif event == "return" and stack:
            stack.pop()
        elif event == "c_call" and getattr(arg, "__name__", "") == "scaled_dot_product_attention" \
                and "forward" in stack:
            paths.append(stack[len(stack) - stack[::-1].index("forward"):] + [arg.__name__])
        if event == "call" and frame.f_code.co_name == "eager_attention":
            paths.append(stack[len(stack) - stack[::-1].index("forward"):])
    sys.setprofile(profile)
    try:
        layer(x, positions, mask, need_weights=need_weights)
    finally:
        sys.setprofile(None)
    return paths


@pytest.mark.parametrize("backend,path", [
    ("sdpa", ["attend", "sdpa_attention", "scaled_dot_product_attention"]),
    ("eager", ["attend", "eager_attention"])])
def test_forward_reaches_the_formula_through_attend_and_nothing_else(backend, path):
    """What a learner counts with a profiler: forward calls `attend` (the one method a
    mechanism overrides), which calls the backend set once by name, which calls torch."""
    from model import GPT
    from model.attention import MultiHeadAttention, use_backend
    model = GPT(_cfg(T=16, position="none"))
    use_backend(model, backend)
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert layers and all(m.kernel is ATTENTION_BACKENDS[backend].attend for m in layers)
    x = torch.randn(1, 16, 32, dtype=torch.bfloat16)
    positions = model.positions
    layer = layers[0].to(torch.bfloat16)
    mask = Mask.over(0, 16, 16)
    assert _calls_from_forward(layer, x, positions, mask) == [path]
    assert _calls_from_forward(layer, x, positions, mask, need_weights=True) == [["attend", "eager_attention"]]


def test_fit_attention_keeps_a_backend_named_and_replaces_auto(native_bf16):
    from model import GPT
    from model.attention import MultiHeadAttention
    cpu = torch.device("cpu")
    named = GPT(_cfg(attention="sdpa"))
    assert machine.fit_attention(named, named.config, cpu, torch.bfloat16) == "sdpa"
    assert all(m.kernel is sdpa_attention for m in named.modules() if isinstance(m, MultiHeadAttention))
    auto = GPT(_cfg())
    assert machine.fit_attention(auto, auto.config, cpu, torch.bfloat16) == "eager"
    assert all(m.kernel is eager_attention for m in auto.modules() if isinstance(m, MultiHeadAttention))


def test_use_backend_sets_only_attention_layers():
    """A module's own attribute named `kernel` (a feature map) is its maths, not a backend."""
    from model import GPT
    from model.attention import MultiHeadAttention, use_backend
    model = GPT(_cfg(T=16))
    feature_map = model.blocks[1].mlp.kernel = torch.nn.ELU()
    for backend in ("eager", "sdpa"):                                 # set twice
        use_backend(model, backend)
        assert all(m.kernel is ATTENTION_BACKENDS[backend].attend
                   for m in model.modules() if isinstance(m, MultiHeadAttention))
    assert model.blocks[1].mlp.kernel is feature_map


@pytest.mark.parametrize("mechanism,said", [
    ("linear", "linear: its own maths"), ("linear,mha", "eager for mha; linear: its own maths"),
    ("deltanet,mla", "deltanet, mla: their own maths"), ("differential", "eager"),
    ("sigmoid", "sigmoid: its own maths")])
def test_the_device_line_names_a_kernel_only_for_the_layers_that_run_it(native_bf16, mechanism, said):
    from model import GPT
    model = GPT(_cfg(mechanism=mechanism))
    assert machine.fit_attention(model, model.config, torch.device("cpu"), torch.bfloat16) == said


# --- precision from the kind, threads from the config ------------------------------------------
@pytest.mark.parametrize("flags,native,kind", [
    ({"avx512f", "avx512_bf16", "amx_bf16"}, True, "amx"), ({"avx512f", "avx512_bf16"}, True, "avx512-bf16"),
    ({"asimd", "bf16"}, True, "native-bf16"), ({"avx2"}, False, "no-bf16"),
    ({"avx512f", "avx512_bf16"}, False, "no-bf16")])
def test_the_cpu_kind_comes_from_its_flags_and_torchs_bf16_check(flags, native, kind, monkeypatch):
    monkeypatch.setattr(machine, "native_bf16", lambda: native)
    assert machine.cpu_kind_name(flags) == kind
    assert machine.CPU_KINDS[kind].native_bf16 is native


@pytest.mark.parametrize("kind", sorted(machine.CPU_KINDS))
def test_auto_precision_on_a_cpu_is_its_kinds_fact_and_times_nothing(kind, monkeypatch):
    """The same width on the same kind gives the same precision whatever the load: no
    probe runs (each is made to fail), and the widths follow the kind's entry."""
    from engine import device
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: kind)
    monkeypatch.setattr(machine, "native_bf16", lambda: machine.CPU_KINDS[kind].native_bf16)
    monkeypatch.setattr(device, "probe_cpu_flops", lambda *a: pytest.fail("a probe ran"))
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("something was timed"))
    entry, cpu = machine.CPU_KINDS[kind], torch.device("cpu")
    for decoding, start in ((False, entry.train_bf16_from), (True, entry.decode_bf16_from)):
        for width in (32, 64, 128, 256, 384, 2048):
            bf16 = start is not None and width >= start
            assert machine.pick_dtype("auto", cpu, width, decoding) == (
                torch.bfloat16 if bf16 else torch.float32), (decoding, width)
        assert not (start is not None and not entry.native_bf16)   # never bf16 emulated


def test_threads_are_decided_once_recorded_and_kept_with_one_line_where_the_env_differs(monkeypatch):
    from engine.config import TrainConfig
    said, before = [], torch.get_num_threads()
    try:
        cfg = TrainConfig()
        assert machine.fix_threads(cfg, said.append, env={"OMP_NUM_THREADS": "1"}) == 1
        assert cfg.threads == 1 and torch.get_num_threads() == 1 and not said
        cfg = TrainConfig(threads=2)                 # a resumed run's recorded count
        assert machine.fix_threads(cfg, said.append, env={"OMP_NUM_THREADS": "1"}) == 2
        assert torch.get_num_threads() == 2 and len(said) == 1
        assert said[0].startswith("threads: 2, as the run's config records (train.threads)")
        assert machine.fix_threads(TrainConfig(threads=2), said.append, env={}) == 2 and len(said) == 1
        env = {}                                     # the frontier's: its train.py runs too
        assert machine.use_threads(1, env) == 1 and env == {"OMP_NUM_THREADS": "1"}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _code_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
            if "__pycache__" not in p.parts]


SHIPPED = ("common", "data", "model", "engine", "attnlab")


def test_the_machine_is_said_once():
    """The thread count, the busy threshold and the instruction-set settings are each
    defined in one place and used from there: torch's thread count is set through
    engine/machine.py (use_threads) and nowhere else in the shipped code; BUSY_CORES and
    the settings that hold torch to AVX2 are common/cpu.py's, since they must be known
    before torch loads, and every script and bench that holds torch to AVX2 takes them
    from there (MKL_ENABLE_INSTRUCTIONS is named only where the list is)."""
    shipped = _code_files(*SHIPPED) + [ROOT / "train.py", ROOT / "sample.py"]
    setters = {p.relative_to(ROOT).as_posix() for p in shipped if "set_num_threads(" in p.read_text()}
    assert setters == {"engine/machine.py"}, setters
    busy = {p.relative_to(ROOT).as_posix() for p in shipped + _code_files("bench")
            if "BUSY_CORES =" in p.read_text()}
    assert busy == {"common/cpu.py"}, busy
    from common import cpu
    from engine import device
    assert device.BUSY_CORES is cpu.BUSY_CORES and device.ISA_SETTINGS is cpu.ISA_SETTINGS
    listed = {p.relative_to(ROOT).as_posix() for p in shipped + _code_files("bench") + [ROOT / ".ci" / "run"]
              if "MKL_ENABLE_INSTRUCTIONS" in p.read_text()}
    assert listed == {"common/cpu.py"}, listed
    assert set(cpu.held_to_avx2()) < set(cpu.ISA_SETTINGS) and "DNNL_MAX_CPU_ISA" not in cpu.held_to_avx2()
    assert machine.held_below_avx512(cpu.held_to_avx2()) and not machine.held_below_avx512({})


def test_importing_the_packages_changes_no_environment_variable():
    code = ("import os, json; before = dict(os.environ)\n"
            "import model, data, engine, attnlab, engine.run, engine.machine, engine.loop\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {}


def test_each_cpu_capability_compiles_into_a_cache_of_its_own(tmp_path):
    """torch.compile's cache does not tell kernels built for AVX2 from AVX-512 ones: a
    compiled FlexAttention built under ATEN_CPU_CAPABILITY=avx2, loaded by a run without
    it, died of "double free or corruption". Each capability gets a folder of its own,
    set where the engine compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert machine.compile_cache_folder({}) == default_cache_dir() + "-aten-auto"
    assert machine.compile_cache_folder({"ATEN_CPU_CAPABILITY": "avx2"}) == default_cache_dir() + "-aten-avx2"
    given = str(tmp_path / "c")
    for env, expected in [({"TORCHINDUCTOR_CACHE_DIR": given}, given + "-aten-auto"),
                          ({"TORCHINDUCTOR_CACHE_DIR": given, "ATEN_CPU_CAPABILITY": "avx2"}, given + "-aten-avx2"),
                          # a run started from one held to AVX2 inherits its folder
                          ({"TORCHINDUCTOR_CACHE_DIR": given + "-aten-avx2"}, given + "-aten-auto"),
                          ({"TORCHINDUCTOR_CACHE_DIR": given + "-aten-avx2",
                            "ATEN_CPU_CAPABILITY": "avx512"}, given + "-aten-avx512")]:
        assert machine.compile_cache_folder(dict(env)) == expected, env


# --- same command, same numbers -----------------------------------------------------------------
def _train(out_dir, corpus, env, resume=False):
    args = [sys.executable, str(ROOT / "train.py"), *(
        ["--resume", str(out_dir / "run")] if resume else
        ["--config", "tiny", f"--data.path={corpus}", f"--data.cache_dir={out_dir / 'cache'}",
         f"--train.out_dir={out_dir}",
         "--train.run_name=run", "--train.max_iters=24", "--train.eval_interval=8"])]
    full = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", **env}
    for name_ in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        full.pop(name_, None)
    return subprocess.Popen(args, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], key): r[key] for r in lines for key in ("loss", "val_loss") if key in r}


def _device_line(stdout):
    return next(line for line in stdout.splitlines() if line.startswith("device: "))


def _killed_then_resumed(out_dir, corpus, env_first, env_resume):
    """A run killed with -9 once a step past its first checkpoint is logged, then resumed
    to its end: (device lines, stderr of the resume)."""
    proc = _train(out_dir, corpus, env_first)
    metrics = out_dir / "run" / "metrics.jsonl"
    while proc.poll() is None:
        logged = metrics.read_text() if metrics.exists() else ""
        if '"step": 11,' in logged:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed mid-run"
    proc.send_signal(signal.SIGKILL)
    first_out, _ = proc.communicate()
    resumed = _train(out_dir, corpus, env_resume, resume=True)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    return [_device_line(first_out), _device_line(out)], out + err


@pytest.fixture(scope="module")
def straight_run(corpus, tmp_path_factory):
    """The tiny run on two threads, straight through, on the machine as it is."""
    out_dir = tmp_path_factory.mktemp("straight")
    proc = _train(out_dir, corpus, {"OMP_NUM_THREADS": "2"})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return _losses(out_dir / "run"), _device_line(out)


def test_a_run_under_load_killed_and_resumed_logs_the_losses_of_a_quiet_straight_run(
        straight_run, corpus, tmp_path):
    """Two busy loops hold both cores for the whole second run, which is killed with -9
    and resumed: its threads, precision and kernel are those of the first, so every
    logged loss is the same number and the device line the same line."""
    losses, device_line = straight_run
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        lines, _ = _killed_then_resumed(tmp_path, corpus, {"OMP_NUM_THREADS": "2"},
                                        {"OMP_NUM_THREADS": "2"})
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert _losses(tmp_path / "run") == losses
    assert lines == [device_line, device_line]


def test_a_resume_under_another_thread_count_keeps_the_recorded_one_and_says_so(
        straight_run, corpus, tmp_path):
    losses, device_line = straight_run
    lines, said = _killed_then_resumed(tmp_path, corpus, {"OMP_NUM_THREADS": "2"},
                                       {"OMP_NUM_THREADS": "1"})
    said = [line for line in said.splitlines() if line.startswith("threads: 2, as the run's")]
    assert len(said) == 1 and "OMP_NUM_THREADS asks for" in said[0]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["threads"] == 2
    assert _losses(tmp_path / "run") == losses
    assert lines == [device_line, device_line]


def test_each_cpu_kind_names_the_section_with_its_measurements():
    """A kind's `numbers` is how a reader finds why its thresholds are what they are."""
    from engine.machine import CPU_KINDS
    headings = {line.lstrip("#").strip() for line in
                (ROOT / "docs" / "benchmarks.md").read_text().splitlines() if line.startswith("#")}
    for name, kind in CPU_KINDS.items():
        assert kind.numbers in headings, (name, kind.numbers)


@pytest.mark.parametrize("kind", list(machine.CPU_KINDS))
def test_sampling_says_why_auto_runs_another_kernel_than_training(kind, monkeypatch):
    """A run's device line said attention eager and sample.py's header, on the same run
    and machine, attention sdpa with no reason: auto picks the kernel for the precision,
    and the weights sample in another one than training's autocast. The header says so
    where the two differ, naming both, and nothing where they agree or a kernel is named."""
    from engine import cli
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: kind)
    monkeypatch.setattr(machine, "native_bf16", lambda: machine.CPU_KINDS[kind].native_bf16)
    cpu = torch.device("cpu")
    cfg = cli.build("cpu", ["--train.device=cpu"])             # 128 wide
    trained = machine.pick_dtype(cfg.train.dtype, cpu, cfg.model.n_embd)
    sampled = machine.pick_dtype(cfg.sample.dtype, cpu, cfg.model.n_embd, decoding=True)
    there, here = (machine.attention_backend(cfg.model, cpu, d) for d in (trained, sampled))
    why = machine.sampling_kernel_why(cfg.model, cfg.train, cpu, sampled)
    if here == there:
        assert why == ""
    else:
        name = {d: str(d).removeprefix("torch.") for d in (trained, sampled)}
        assert why == (f" (model.attention=auto picks the kernel for the precision: {here} for "
                       f"these {name[sampled]} weights; training's {name[trained]} autocast "
                       f"runs {there} here)")
    assert (kind == "amx") <= (why != "")            # AMX: bf16 to train, fp32 to sample at 128
    cfg.model.attention = "sdpa"
    assert machine.sampling_kernel_why(cfg.model, cfg.train, cpu, sampled) == ""
