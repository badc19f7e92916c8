"""The core a learner came for, kept readable: building the default model and one training
forward with its loss runs few lines of the project's code, in few files (nanoGPT's
model.py runs 83 of its lines for the same). `sys.settrace` records every line of a
project file that runs; a budget is each configuration's count when it was last made
smaller, so a line added to the default path is added on purpose (raise the budget here,
with the reason) and never by a stand-in module or a check that runs on every build.

What is traced is what train.py does with the model (engine/run.py): the config is
checked once when it is read (model/registry.py marks it), then the model is built, with
the backend the engine picked for this precision named in its config, and run."""
import collections
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from model import GPT, ModelConfig
from model.registry import check

# (fields over the cpu preset's model, backend, precision) -> (lines, files). Beside
# nanoGPT's 83 for the same build and pass, the default's 115 carry what nanoGPT has not:
# RoPE (its frequencies, and one turn per pass shared by every layer's q and k: 19), the
# one mask rule every backend and cache reads (mask_for and the mask's form for SDPA: 9),
# the check's record that the config is checked and plain (2), the KV cache, GQA, QK-norm
# and value-embedding branches of the shared prologue (5), the point where a tool reads q,
# k and v (1), the registries' lookups and return_attention's list.
BUDGETS = {
    "cpu preset, fp32 (sdpa)": ({}, "sdpa", torch.float32, 115, 4),
    # the formula and the rule as a matrix (Mask.dense) instead of SDPA's triangle
    "cpu preset, bf16 (the formula)": ({}, "eager", torch.bfloat16, 120, 4),
    "learned positions": ({"position": "learned"}, "sdpa", torch.float32, 107, 4),
    # its own maths (model/linear_attention.py, no kernel: auto stays auto) and the
    # config's head size
    "linear attention": ({"mechanism": "linear"}, "auto", torch.float32, 110, 6),
}
CPU_PRESET = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=65)


def traced(fields: dict, backend: str, dtype: torch.dtype, config=None) -> dict[str, set[int]]:
    """{project file: its line numbers that ran} for a build and one forward with a loss."""
    # The engine names the backend it chose in the config it builds from, and checks that
    # config there (engine/machine.py, built_for), so building the model checks nothing.
    if config is None:
        config = ModelConfig(**{**CPU_PRESET, **fields, "attention": backend})
        check(config)
    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 65, (2, 16), generator=g) for _ in range(2))
    lines: dict[str, set[int]] = collections.defaultdict(set)
    root = str(ROOT)

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(root) or "/tests/" in name:
            return None
        if event == "line":
            lines[name].add(frame.f_lineno)
        return tracer

    torch.manual_seed(0)
    sys.settrace(tracer)
    try:
        model = GPT(config)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            model(idx, targets)
    finally:
        sys.settrace(None)
    return lines


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_path_of_one_forward_stays_within_its_budget(name):
    fields, backend, dtype, most_lines, most_files = BUDGETS[name]
    lines = traced(fields, backend, dtype)
    count = sum(len(v) for v in lines.values())
    where = ", ".join(f"{k.removeprefix(str(ROOT) + '/')} {len(v)}" for k, v in sorted(lines.items()))
    assert len(lines) <= most_files, f"{name}: {len(lines)} files ({where})"
    assert count <= most_lines, f"{name}: {count} lines ({where})"


def code_lines(path) -> int:
    """Lines of code in a file: comments, docstrings and blank lines not counted (the
    why-comments are what a reader should find beside the code)."""
    import ast
    source = path.read_text(encoding="utf-8")
    docs = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_the_files_a_learner_reads_for_one_forward_hold_at_most_800_lines_of_code():
    """What a learner opens to follow the default forward pass from train.py: the files the
    trace runs in. nanoGPT's model.py is 330 lines, comments included."""
    files = traced({}, "eager", torch.bfloat16)
    total = sum(code_lines(Path(f)) for f in files)
    assert total <= 800, {Path(f).name: code_lines(Path(f)) for f in files}


def test_the_default_path_runs_no_stand_in_and_no_check():
    """No module that does nothing is built, and a checked config is not checked again."""
    model = GPT(ModelConfig(**CPU_PRESET))
    names = {type(m).__name__ for m in model.modules()}
    assert not names & {"NoSkips", "NoTokenTypes", "NoValueEmbeddings", "SoftCap", "NoOutputLayer"}
    stand_ins = [n for n, m in model.named_modules() if type(m).__name__ == "Identity"]
    assert stand_ins == []
    assert {type(b).__name__ for b in model.blocks} == {"Block"}    # GPT-2's, no variant's checks
    files = traced({}, "sdpa", torch.float32)
    assert not any(f.endswith(("registry.py", "config.py", "readout.py", "mechanisms.py"))
                   for f in files)


def test_the_model_the_engine_builds_runs_the_same_path():
    """What engine/run.py builds: the config as read, checked, then the one built_for makes
    with the backend this machine runs; building from it checks nothing again."""
    from engine.machine import built_for
    read = ModelConfig(**CPU_PRESET)
    check(read)
    built = built_for(read, torch.device("cpu"), torch.float32)
    assert built is not read and built.attention != "auto"
    files = traced({}, built.attention, torch.float32, config=built)
    assert sorted(Path(f).name for f in files) == ["attention.py", "gpt.py", "layers.py",
                                                    "positions.py"]
    assert sum(map(len, files.values())) <= BUDGETS["cpu preset, fp32 (sdpa)"][3]


def test_the_tracer_sees_a_line_added_to_the_path(monkeypatch):
    """The count is real: a forward that also runs one more project function counts its lines."""
    before = sum(len(v) for v in traced({}, "sdpa", torch.float32).values())
    real = GPT.logits_and_loss

    def logits_and_loss(self, h, targets=None):
        self.num_params()                        # model/gpt.py lines not on the path
        return real(self, h, targets)
    monkeypatch.setattr(GPT, "logits_and_loss", logits_and_loss)
    after = sum(len(v) for v in traced({}, "sdpa", torch.float32).values())
    assert after > before


def test_an_attention_only_model_builds_no_mlp_and_its_tools_know():
    """model.mlp=none (the setting of the induction-head papers): no MLP and no norm in front
    of one is built, the pass is attention alone, the lens's cache has no mlp_out, and
    switching off an MLP that is not there is refused in one line."""
    from attnlab.capture import run_with_cache
    from attnlab.lens import ablate
    from common.errors import AttnlabError
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**CPU_PRESET, "n_layer": 2, "mlp": "none"}))
    assert all(b.mlp is None and b.norm_mlp is None for b in model.blocks)
    assert not any("mlp" in name for name, _ in model.named_parameters())
    x = torch.randint(0, 65, (1, 12))
    block = model.blocks[0]
    h = x_in = model.drop(model.wte(x))
    mask = model.mask_for(12, x.device, None, None)
    out, _ = block(x_in, model.positions, mask)
    assert torch.equal(out, h + block.attn(block.norm_attn(h), model.positions, mask)[0])
    logits, cache = run_with_cache(model, x)
    assert "blocks.0.attn_out" in cache and not any(k.endswith("mlp_out") for k in cache)
    with pytest.raises(AttnlabError, match="no MLP"):
        with ablate(model, mlps=[1]):
            pass


@pytest.mark.parametrize("module", ["gpt", "layers", "attention", "positions", "cache", "decode"])
def test_the_annotations_a_reader_meets_name_what_exists(module):
    """Every annotation of the core's functions resolves (typing.get_type_hints), so a name
    a reader looks up, such as generate's Iterator, is imported where it is used."""
    import importlib
    import inspect
    import typing
    mod = importlib.import_module(f"model.{module}")
    functions = [f for obj in vars(mod).values() if getattr(obj, "__module__", None) == mod.__name__
                 for f in ([obj] if inspect.isfunction(obj) else
                           [v for v in vars(obj).values() if inspect.isfunction(v)]
                           if inspect.isclass(obj) else [])]
    assert functions
    for f in functions:
        typing.get_type_hints(f)


@pytest.mark.parametrize("fields", [{"token_mix": 3}, {"mlp": "none"}, {"block": "postnorm"},
                                    {"value_embeds": True}, {"readout": "none", "tie_embeddings": False},
                                    {"mechanism": "linear,mha"}])
def test_a_checked_config_that_asks_for_a_variant_builds_it(fields):
    """The check records whether a config is plain; one that is not builds GPTWithVariants
    whether or not it was checked before, so no asked-for part is silently left out."""
    from model.gpt import GPTWithVariants
    for checked_first in (True, False):
        config = ModelConfig(**{**CPU_PRESET, **fields})
        if checked_first:
            check(config)
        assert type(GPT(config)) is GPTWithVariants, (fields, checked_first)
    plain = ModelConfig(**CPU_PRESET)
    check(plain)
    assert type(GPT(plain)) is GPT
