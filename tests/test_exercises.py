"""attnlab/exercises: every stub is "not started", the project's own code and a plain
learner's correct code pass, every planted mistake (one changed line of a correct
answer) gets the diagnosis that names it, and train.py runs the learner's code."""
import json
import os
import re
from pathlib import Path
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from attnlab.exercises.checks import EXERCISES, BY_NAME, run_check
from attnlab.exercises import __main__ as tool
from attnlab.exercises.learner import SOLUTIONS, STUBS, ExerciseError, check, start
from conftest import ROOT, run_script

# A learner's correct answers, written plainly in torch (not the project's code), and
# per exercise the mistakes planted in them: (the line as written, the line with the
# mistake, words the diagnosis must contain).
CORRECT = {
    "attention": '''
import math, torch
def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ v, weights
''',
    "causal_mask": '''
import torch
def causal_mask(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
''',
    "multi_head": '''
import math, torch
def multi_head_attention(x, w_q, w_k, w_v, w_o, n_head):
    B, T, C = x.shape
    d = C // n_head
    q = (x @ w_q).view(B, T, n_head, d).transpose(1, 2)
    k = (x @ w_k).view(B, T, n_head, d).transpose(1, 2)
    v = (x @ w_v).view(B, T, n_head, d).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    out = out.transpose(1, 2).reshape(B, T, C)
    return out @ w_o
''',
    "sinusoidal": '''
import torch
def sinusoidal_positions(T, d, start=0):
    pos = torch.arange(start, start + T, dtype=torch.float64)
    i = torch.arange(0, d, 2, dtype=torch.float64)
    angle = pos[:, None] / 10000 ** (i / d)
    pe = torch.zeros(T, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe
''',
    "rope": '''
import torch
def apply_rope(q, k, positions, theta=10000.0):
    d = q.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    def turn(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return turn(q), turn(k)
''',
    "kv_cache": '''
import math, torch
def decode_step(q, k, v, cache_k, cache_v):
    keys = torch.cat([cache_k, k], dim=-2)
    values = torch.cat([cache_v, v], dim=-2)
    T_new, T_all = q.shape[-2], keys.shape[-2]
    visible = torch.ones(T_new, T_all, dtype=torch.bool).tril(diagonal=T_all - T_new)
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values, keys, values
''',
    "window": '''
import torch
def window_mask(T, window, n_global=0):
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    return (k <= q) & ((q - k < window) | (k < n_global))
''',
    "cross_attention": '''
import math, torch
def cross_attention(x, memory, key_padding, w_q, w_k, w_v, w_o):
    q, k, v = x @ w_q, memory @ w_k, memory @ w_v
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(key_padding[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights @ v) @ w_o, weights
''',
    "linear_rnn": '''
import torch
def linear_attention_step(q, k, v, S, z):
    phi_q = torch.nn.functional.elu(q) + 1
    phi_k = torch.nn.functional.elu(k) + 1
    S_new = S + phi_k[..., :, None] * v[..., None, :]
    z_new = z + phi_k
    numerator = (phi_q[..., None, :] @ S_new).squeeze(-2)
    normaliser = (phi_q * z_new).sum(-1, keepdim=True)
    return numerator / normaliser, S_new, z_new
''',
    "sinks": '''
import math, torch
def sink_attention(q, k, v, sinks, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1)
    e = torch.exp(scores)
    weights = e / (e.sum(-1, keepdim=True) + torch.exp(sink))
    return weights @ v, weights
''',
    "top_k_routing": '''
import torch
def moe_layer(x, logits, experts, shared, k):
    top = logits.topk(k, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (top.indices == e).nonzero(as_tuple=True)
        out = out.index_add(0, token, weights[token, slot, None] * expert(x[token]))
    for expert in shared:
        out = out + expert(x)
    return out
''',
    "gate": '''
import torch
def gated_output(x, y, w_gate, w_o):
    gate = torch.sigmoid(x @ w_gate)
    return (y * gate) @ w_o
''',
}

PLANTED = {
    "attention": [
        ("/ math.sqrt(q.shape[-1])", "", "divide Q·Kᵀ by √d_k"),
        ("dim=-1)", "dim=-2)", "softmax ran over the queries"),
        ('scores = scores.masked_fill(~mask, float("-inf"))', "pass",
         "hidden keys get weight"),
        ('weights = torch.softmax(scores, dim=-1)',
         'weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)\n'
         '    weights = weights if mask is None else weights * mask', "after the softmax"),
        ('float("-inf")', "0.0", "exp(0) = 1"),
        ("math.sqrt(q.shape[-1])", "math.sqrt(v.shape[-1])", "divided by √d_v"),
    ],
    "causal_mask": [
        (".tril(diagonal=k_len - q_len)", ".triu()", "the wrong triangle"),
        (".tril(diagonal=k_len - q_len)", ".tril()", "aligned top-left"),
        ("diagonal=k_len - q_len", "diagonal=k_len - q_len - 1", "the diagonal is hidden"),
        (".tril(diagonal=k_len - q_len)", ".tril(diagonal=k_len - q_len).int()",
         "returned a int32 tensor; return a bool tensor"),
    ],
    "multi_head": [
        ("q = (x @ w_q).view(B, T, n_head, d).transpose(1, 2)",
         "q = (x @ w_q).reshape(B, n_head, T, d)", "heads mixed when splitting"),
        ("out = out.transpose(1, 2).reshape(B, T, C)", "out = out.reshape(B, T, C)",
         "heads mixed when concatenating"),
        ("scores = scores.masked_fill(future, float(\"-inf\"))", "pass",
         "future tokens are visible"),
        ("/ math.sqrt(d)", "/ math.sqrt(C)", "√d_model"),
        ("return out @ w_o", "return out", "W_O is missing"),
    ],
    "sinusoidal": [
        ("pe[:, 0::2] = torch.sin(angle)\n    pe[:, 1::2] = torch.cos(angle)",
         "pe[:, 0::2] = torch.cos(angle)\n    pe[:, 1::2] = torch.sin(angle)",
         "sin and cos are swapped"),
        ("i = torch.arange(0, d, 2, dtype=torch.float64)",
         "i = torch.arange(0, d // 2, dtype=torch.float64)", "frequencies are wrong"),
        ("torch.arange(start, start + T,", "torch.arange(0, T,", "`start` is ignored"),
        ("10000 ** (i / d)", "10000 ** (2 * i / d)", "doubles the index twice"),
    ],
    "rope": [
        ("x1, x2 = x[..., : d // 2], x[..., d // 2:]", "x1, x2 = x[..., 0::2], x[..., 1::2]",
         "wrong pairs"),
        ("return turn(q), turn(k)", "return turn(q), k", "only the queries"),
        ("angle = positions.double()[:, None]",
         "angle = torch.arange(q.shape[-2]).double()[:, None]", "positions given are ignored"),
        ("x1 * cos - x2 * sin, x2 * cos + x1 * sin", "x1 * cos + x2 * sin, x2 * cos - x1 * sin",
         "wrong way"),
        ("torch.arange(0, d, 2, dtype=torch.float64) / d", "torch.arange(0, d, 2, dtype=torch."
         "float64) * 2 / d", "doubles the index twice"),
    ],
    "kv_cache": [
        ("scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
         "    scores = scores.masked_fill(~visible, float(\"-inf\"))\n"
         "    return torch.softmax(scores, dim=-1) @ values, keys, values",
         "scores = q @ cache_k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
         "    return torch.softmax(scores, dim=-1) @ cache_v, keys, values",
         "attended before appending"),
        ("visible = torch.ones(T_new, T_all, dtype=torch.bool).tril(diagonal=T_all - T_new)",
         "visible = torch.ones(T_new, T_all, dtype=torch.bool).tril()", "aligned top-left"),
        ("scores = scores.masked_fill(~visible, float(\"-inf\"))", "pass",
         "weight on future keys"),
        ("return torch.softmax(scores, dim=-1) @ values, keys, values",
         "return torch.softmax(scores, dim=-1) @ values, cache_k, cache_v",
         "the cache returned holds the T_past old keys"),
    ],
    "window": [
        ("q - k < window", "q - k <= window", "off by one: it sees W + 1"),
        ("(k <= q) & ((q - k < window) | (k < n_global))",
         "((k <= q) & (q - k < window)) | (k < n_global)",
         "global tokens are visible to queries before them"),
        (" | (k < n_global)", "", "global tokens are missing"),
        ("(k < n_global)", "(k <= n_global)", "one too many global tokens"),
    ],
    "cross_attention": [
        ("scores = scores.masked_fill(key_padding[:, None, :], float(\"-inf\"))", "pass",
         "padding is visible to cross-attention"),
        ("q, k, v = x @ w_q, memory @ w_k, memory @ w_v", "q, k, v = x @ w_q, x @ w_k, x @ w_v",
         "come from the encoder's output"),
        ("key_padding[:, None, :]", "~key_padding[:, None, :]", "the real input is hidden"),
        ("key_padding[:, None, :]", "key_padding[:, :, None]",
         "padding mask is shaped for the wrong axis"),
        ("return (weights @ v) @ w_o, weights", "return weights @ v, weights", "W_O is missing"),
    ],
    "linear_rnn": [
        ("return numerator / normaliser, S_new, z_new", "return numerator, S_new, z_new",
         "the output is not normalised"),
        ("elu(q) + 1\n    phi_k = torch.nn.functional.elu(k) + 1",
         "elu(q)\n    phi_k = torch.nn.functional.elu(k)", "φ goes negative"),
        ("phi_q = torch.nn.functional.elu(q) + 1\n    phi_k = torch.nn.functional.elu(k) + 1",
         "phi_q, phi_k = q, k", "no feature map"),
        ("@ S_new).squeeze(-2)\n    normaliser = (phi_q * z_new)",
         "@ S).squeeze(-2)\n    normaliser = (phi_q * z)", "off by one: the output read the state "
         "before this token"),
        ("return numerator / normaliser, S_new, z_new", "return numerator / normaliser, S, z",
         "the state returned is the one passed in"),
        ("S_new = S + phi_k[..., :, None] * v[..., None, :]",
         "S += phi_k[..., :, None] * v[..., None, :]\n    S_new = S", "in place"),
        ("phi_k[..., :, None] * v[..., None, :]", "v[..., :, None] * phi_k[..., None, :]",
         "S adds φ(k)vᵀ, the keys' features by the values'"),
        ("return numerator / normaliser, S_new, z_new",
         "return numerator / normaliser, (S_new, z_new)", "returned 2 value(s), expected 3"),
    ],
    "sinks": [
        ("weights = e / (e.sum(-1, keepdim=True) + torch.exp(sink))",
         "weights = e / e.sum(-1, keepdim=True)", "the sink is missing from the denominator"),
        ("weights = e / (e.sum(-1, keepdim=True) + torch.exp(sink))",
         "weights = (e + torch.exp(sink)) / (e.sum(-1, keepdim=True) + torch.exp(sink))",
         "the sink went into the numerator too"),
        ("+ torch.exp(sink))", "+ sink)", "the sink was added as it is"),
        ("sink = sinks.view(1, -1, 1, 1)", "sink = sinks.view(1, 1, -1, 1)",
         "the sinks are laid along the queries"),
        ("sink = sinks.view(1, -1, 1, 1)", "sink = sinks.view(1, -1, 1, 1) / math.sqrt(q.shape[-1])",
         "the sink was divided by √d_k"),
        ('scores = scores.masked_fill(~mask, float("-inf"))', "pass", "hidden keys get weight"),
        ("return weights @ v, weights",
         "return weights @ v, torch.cat([weights, 1 - weights.sum(-1, keepdim=True)], -1)",
         "the sink's column is dropped after the softmax"),
    ],
    "top_k_routing": [
        ("weights = torch.softmax(top.values, dim=-1)",
         "weights = torch.softmax(logits, dim=-1).gather(-1, top.indices)",
         "a softmax over all the experts, not renormalised"),
        ("top = logits.topk(k, dim=-1)", "top = logits.topk(logits.shape[-1], dim=-1)",
         "every expert runs for every token"),
        ("top = logits.topk(k, dim=-1)", "top = logits.topk(1, dim=-1)", "top-1"),
        ("top = logits.topk(k, dim=-1)", "top = logits.topk(2, dim=-1)",
         "2 experts whatever k is"),
        ("    for expert in shared:\n        out = out + expert(x)\n", "",
         "the shared experts are missing"),
        ("weights = torch.softmax(top.values, dim=-1)",
         "weights = torch.sigmoid(top.values) / torch.sigmoid(top.values).sum(-1, keepdim=True)",
         "DeepSeek-V3's rule"),
        ("weights = torch.softmax(top.values, dim=-1)", "weights = torch.sigmoid(top.values)",
         "sigmoid, not renormalised"),
        ("weights = torch.softmax(top.values, dim=-1)", "weights = top.values", "raw logits"),
    ],
    "gate": [
        ("torch.sigmoid(x @ w_gate)", "torch.sigmoid(y @ w_gate)",
         "computed from the attention's output"),
        ("return (y * gate) @ w_o", "return (y @ w_o) * gate", "applied after W_O"),
        ("torch.sigmoid(x @ w_gate)", "x @ w_gate", "the gate has no sigmoid"),
        ("torch.sigmoid(x @ w_gate)", "torch.nn.functional.silu(x @ w_gate)", "the gate is SiLU"),
        ("return (y * gate) @ w_o", "return (y + gate) @ w_o", "added to the heads' output"),
        ("torch.sigmoid(x @ w_gate)", "torch.sigmoid(x @ w_gate.T)", "W_G is transposed"),
        ("return (y * gate) @ w_o", "return y * gate", "W_O is missing"),
    ],
}

# Right answers written another way, which must pass too: the sink as one more column of
# the softmax (the project's way), and Qwen3's softmax over every expert renormalised over
# the chosen k, which gives the same weights as a softmax over the k chosen logits.
ALSO_CORRECT = {
    "sinks": CORRECT["sinks"].replace(
        "    e = torch.exp(scores)\n    weights = e / (e.sum(-1, keepdim=True) + torch.exp(sink))",
        "    B, H, T, _ = scores.shape\n    both = torch.cat([scores, sink.expand(B, H, T, 1)], -1)\n"
        "    weights = torch.softmax(both, dim=-1)[..., :-1]"),
    "top_k_routing": CORRECT["top_k_routing"].replace(
        "    weights = torch.softmax(top.values, dim=-1)",
        "    weights = torch.softmax(logits, dim=-1).gather(-1, top.indices)\n"
        "    weights = weights / weights.sum(-1, keepdim=True)"),
}


def write(folder, ex, source):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ex.filename).write_text(source)
    return folder


def test_every_exercise_has_a_correct_answer_and_at_least_two_planted_mistakes():
    assert set(CORRECT) == set(PLANTED) == set(BY_NAME)
    assert all(len(PLANTED[name]) >= 2 for name in PLANTED)
    assert [ex.number for ex in EXERCISES] == list(range(1, 13))


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_every_stub_is_not_started(ex):
    result = check(ex, STUBS)
    assert result.status == "not started", result.message
    text = (STUBS / ex.filename).read_text()
    assert "raise NotImplementedError" in text and ex.answer.split(":")[0] in text
    assert ex.doc in text and f"check {ex.name}" in text


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_the_projects_own_code_passes(ex):
    result = check(ex, SOLUTIONS)
    assert result.passed, result.message


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_a_learners_plain_correct_answer_passes(ex, tmp_path):
    result = check(ex, write(tmp_path, ex, CORRECT[ex.name]))
    assert result.passed, result.message


@pytest.mark.parametrize("name", ALSO_CORRECT)
def test_a_right_answer_written_another_way_passes(name, tmp_path):
    ex = BY_NAME[name]
    assert ALSO_CORRECT[name] != CORRECT[name]
    result = check(ex, write(tmp_path, ex, ALSO_CORRECT[name]))
    assert result.passed, result.message


def test_a_sink_added_to_every_score_is_named_as_no_sink_at_all(tmp_path):
    """s_h added to each score of a row cancels in its softmax: the mistake is the missing
    sink, and the diagnosis says why adding it there changes nothing."""
    ex, line = BY_NAME["sinks"], "torch.softmax(both, dim=-1)[..., :-1]"
    assert line in ALSO_CORRECT["sinks"]
    source = ALSO_CORRECT["sinks"].replace(line, "torch.softmax(scores + sink, dim=-1)")
    result = check(ex, write(tmp_path, ex, source))
    assert result.status == "failed" and "the sink is missing" in result.message
    assert "a softmax ignores a shift common to its row" in result.message


@pytest.mark.parametrize("name,planted", [(n, p) for n in PLANTED for p in PLANTED[n]],
                         ids=lambda x: x if isinstance(x, str) else x[2][:30])
def test_every_planted_mistake_gets_the_diagnosis_that_names_it(name, planted, tmp_path):
    line, wrong, words = planted
    assert line in CORRECT[name]
    ex = BY_NAME[name]
    result = check(ex, write(tmp_path, ex, CORRECT[name].replace(line, wrong)))
    assert result.status == "failed" and words in result.message, result.message


def test_two_mistakes_at_once_in_the_linear_step_are_both_named(tmp_path):
    """No normaliser and the state read before the token joins it gave only "differs
    from the reference"."""
    ex, source = BY_NAME["linear_rnn"], CORRECT["linear_rnn"]
    for line, wrong, _ in (PLANTED["linear_rnn"][0], PLANTED["linear_rnn"][3]):
        assert line in source
        source = source.replace(line, wrong)
    result = check(ex, write(tmp_path, ex, source))
    assert result.status == "failed" and result.message.startswith("two mistakes at once")
    assert "not normalised" in result.message and "off by one" in result.message


@pytest.mark.parametrize("pair", list(BY_NAME["linear_rnn"].pairs))
def test_each_pair_of_linear_mistakes_is_told_apart(pair):
    ex = BY_NAME["linear_rnn"]
    result = run_check(ex, ex.pairs[pair])
    assert result.status == "failed", result
    assert all(ex.mistakes[name][1] in result.message for name in pair), (pair, result.message)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.name)
def test_each_of_the_checkers_own_variants_is_told_apart(ex):
    # The variants are the checker's evidence: each must be caught by its own message,
    # not by an earlier variant's or by a shape complaint.
    for name, (variant, diagnosis) in ex.mistakes.items():
        result = run_check(ex, variant)
        assert result.status == "failed" and result.message.startswith(diagnosis), (name, result)


def test_errors_in_the_learners_code_are_one_line_naming_the_exercise(tmp_path):
    ex = BY_NAME["attention"]
    raising = CORRECT["attention"].replace("weights = torch.softmax", "weights = torch.softmaxx")
    result = check(ex, write(tmp_path / "a", ex, raising))
    assert result.status == "failed" and "\n" not in result.message
    assert "AttributeError (01_attention.py line 7)" in result.message
    broken = check(ex, write(tmp_path / "b", ex, "def scaled_dot_product_attention(:\n"))
    assert broken.status == "failed" and "01_attention.py line 1 does not import" in broken.message
    renamed = check(ex, write(tmp_path / "c", ex, "def attention(q, k, v):\n    pass\n"))
    assert "has no function scaled_dot_product_attention()" in renamed.message
    shaped = check(ex, write(tmp_path / "d", ex, "def scaled_dot_product_attention(q, k, v, "
                             "mask=None):\n    return q, q\n"))
    assert "output 1 has shape (2, 3, 4, 16), expected (2, 3, 4, 8)" in shaped.message


def test_a_missing_or_empty_exercise_file_is_named_as_such(tmp_path, capsys):
    mine = tmp_path / "mine"
    start(mine)
    (mine / "03_multi_head.py").unlink()
    (mine / "05_rope.py").write_text("\n")
    missing, empty = check(BY_NAME["multi_head"], mine), check(BY_NAME["rope"], mine)
    assert missing.status == "missing" and missing.message == (
        f"03_multi_head.py is missing from {mine}; python -m attnlab.exercises start {mine} "
        "restores its stub without touching the other files")
    assert empty.status == "empty" and "05_rope.py is empty" in empty.message
    assert tool.main(["check", str(mine)]) == 1
    out = capsys.readouterr().out
    assert "  3  multi_head       missing: 03_multi_head.py is missing" in out
    assert out.splitlines()[-1] == f"next: {missing.message}"
    copied, kept = start(mine)
    assert copied == ["03_multi_head.py"] and check(BY_NAME["multi_head"], mine).status == \
        "not started"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
def test_an_exercise_file_that_is_not_a_plain_file_is_refused_with_its_path(tmp_path, capsys):
    """A folder or a named pipe at an exercise's name was called missing, and `start`
    (which keeps whatever holds the name) sent the learner back to `check`: a circle."""
    mine = tmp_path / "mine"
    start(mine)
    names = ["attention", "causal_mask", "multi_head"]
    for name in names:
        (mine / BY_NAME[name].filename).unlink()
    (mine / BY_NAME["attention"].filename).mkdir()
    os.mkfifo(mine / BY_NAME["causal_mask"].filename)     # never opened: it would wait
    (mine / BY_NAME["multi_head"].filename).symlink_to(tmp_path / "nothing")
    for name, what in zip(names, ["a folder", "a named pipe", "a link to nothing"]):
        result = check(BY_NAME[name], mine)
        assert result.status == "not a file" and result.message == (
            f"{mine / BY_NAME[name].filename} is {what}, not an exercise file: move it away, "
            f"then python -m attnlab.exercises start {mine} puts the stub there")
    capsys.readouterr()
    assert tool.main(["start", str(mine)]) == 0              # start keeps them and says why
    assert capsys.readouterr().out.splitlines()[-1] == f"next: {check(BY_NAME['attention'], mine).message}"
    (mine / BY_NAME["attention"].filename).rmdir()
    start(mine)
    assert check(BY_NAME["attention"], mine).status == "not started"


def test_checking_a_folder_with_no_exercise_files_says_how_to_make_them(tmp_path):
    """`check --exercises /etc` called each of the nine missing and advised
    `start /etc`; a folder holding none of them is named as such, with the way to make them."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not an exercise")
    for args in (["check", "--exercises", str(tmp_path / "empty")], ["check", str(tmp_path / "other")],
                 ["check", "attention", "--exercises", str(tmp_path / "other")]):
        with pytest.raises(ExerciseError) as err:
            tool.main(args)
        folder = Path(args[-1])
        assert str(err.value) == (
            f"{folder} holds no exercise files (01_attention.py to {EXERCISES[-1].filename}); make them "
            "with python -m attnlab.exercises start DIR (a folder of your own, my_attention "
            "when left out), then check --exercises DIR")


def run_tool(*args, cwd):
    return subprocess.run([sys.executable, "-m", "attnlab.exercises", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_start_copies_the_stubs_and_never_overwrites_work(tmp_path, capsys):
    mine = tmp_path / "mine"
    write(mine, BY_NAME["attention"], CORRECT["attention"])
    copied, kept = start(mine)
    assert kept == ["01_attention.py"] and len(copied) == len(EXERCISES) - 1
    assert (mine / "01_attention.py").read_text() == CORRECT["attention"]
    assert tool.main(["start", str(mine)]) == 0
    out = capsys.readouterr().out
    assert "kept (already there, not overwritten): 01_attention.py, 02_causal_mask.py" in out
    assert "copied" not in out
    # Exercise 1 passes there already: the next step is exercise 2, not 1.
    last = out.splitlines()[-1]
    assert last.startswith(f"next: write causal_mask in {mine / '02_causal_mask.py'}")
    assert last.endswith(f"check causal_mask --exercises {mine}")
    proc = run_tool("start", cwd=tmp_path)                     # the default folder, from -m
    assert proc.returncode == 0 and (tmp_path / "my_attention" / "08_cross_attention.py").exists()


def test_check_prints_a_progress_table_and_what_to_try_next(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "my_attention"
    start(folder)
    write(folder, BY_NAME["attention"], CORRECT["attention"])
    write(folder, BY_NAME["causal_mask"], CORRECT["causal_mask"].replace(
        ".tril(diagonal=k_len - q_len)", ".triu()"))
    assert tool.main(["check"]) == 1
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].split() == ["1", "attention", "passed"]
    assert rows[3].startswith("  2  causal_mask") and "failed: the wrong triangle" in rows[3]
    assert rows[4].split() == ["3", "multi_head", "not", "started"]
    assert f"1 of {len(EXERCISES)} passed." in rows
    assert rows[-1].startswith("next: fix causal_mask in my_attention/02_causal_mask.py")
    assert tool.main(["check", "my_attention"]) == 1                 # a folder, as start takes it
    assert capsys.readouterr().out.splitlines()[:3] == rows[:3]
    for flag in ("--exercises", "--dir"):                    # train.py's name, and the alias
        assert tool.main(["check", flag, str(folder)]) == 1
        assert capsys.readouterr().out.splitlines()[0] == f"exercises in {folder}:"
    assert tool.main(["check", "1"]) == 0
    assert "train with yours: python train.py --config exercise --model.attention=yours" \
        in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="no exercises folder at nowhere; start with"):
        tool.main(["check", "--dir", "nowhere"])
    (tmp_path / "afile").write_text("")
    for args in (["check", "--exercises", "afile"], ["check", "afile"]):
        with pytest.raises(ExerciseError, match="afile is a file, not an exercises folder; give "
                                                "a folder"):
            tool.main(args)
    with pytest.raises(ExerciseError, match="no exercise 'nine'; the exercises are: 1 attention"):
        tool.main(["check", "nine"])


def test_every_text_gives_the_one_preset_to_train_the_learners_code(tmp_path, capsys):
    """The stubs, the checker's lines, its --help and the README all name the preset
    sized for the learner's code (a text still saying --config tiny fails), and that
    preset exists."""
    texts = {p.name: p.read_text() for p in sorted(STUBS.glob("*.py"))}
    texts["--help"] = tool.parser().format_help()
    texts["README.md"] = (ROOT / "README.md").read_text()
    texts["docs/exercises.md"] = (ROOT / "docs" / "exercises.md").read_text()
    folder = tmp_path / "mine"
    shutil.copytree(SOLUTIONS, folder)
    assert tool.main(["check", "1", "--exercises", str(folder)]) == 0
    texts["passed line"] = capsys.readouterr().out
    texts["all passed"] = tool.next_step([check(ex, folder) for ex in EXERCISES], folder)
    presets = {name: re.findall(r"train\.py --config (\S+)[^\n]*[=,]yours", text)
               for name, text in texts.items()}
    silent = [name for name, found in presets.items() if not found and "train.py" in texts[name]]
    assert not silent and presets["01_attention.py"] and presets["passed line"], presets
    # A card's piece trains in its card; every other exercise in the preset sized for it.
    cards = {ex.preset for ex in EXERCISES} - {"exercise"}
    assert {p for found in presets.values() for p in found} == {"exercise"} | cards, presets
    for ex in EXERCISES:
        assert set(presets[ex.filename]) <= {ex.preset}, (ex.filename, presets[ex.filename])
        assert (ROOT / "configs" / f"{ex.preset}.toml").is_file()


def test_exercise_1_alone_is_enough_to_train_with_your_attention(corpus, tmp_path):
    mine = tmp_path / "mine"
    start(mine)
    shutil.copy(SOLUTIONS / "01_attention.py", mine / "01_attention.py")
    out = run_script(*tiny(corpus, tmp_path, "one", "--model.attention=yours",
                           f"--exercises={mine}"))
    assert "attention: yours (scaled_dot_product_attention in" in out.stdout
    assert not (tmp_path / "runs" / "one" / "exercises.json").exists()   # a run names no code


def tiny(corpus, out, name, *extra):
    return ["train.py", "--config", "tiny", f"--data.path={corpus}",
            f"--data.cache_dir={out / 'cache'}", f"--train.out_dir={out / 'runs'}",
            f"--train.run_name={name}", "--train.max_iters=4", "--train.eval_interval=4",
            "--train.eval_iters=1", *extra]


def step_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if "loss" in json.loads(line)]


def test_training_with_the_learners_code_matches_eager_and_rope(corpus, tmp_path):
    # The project's solutions, copied in as the learner's: attention and positions both
    # run through the registries' `yours` entries in the real loop.
    mine = tmp_path / "mine"
    shutil.copytree(SOLUTIONS, mine)
    # Trained from tmp_path with a relative folder: the hint train.py prints names it
    # absolute, so sample.py, run elsewhere from that hint, finds it there.
    yours = run_script(ROOT / "train.py", *tiny(corpus, tmp_path, "yours",
                       "--model.attention=yours", "--model.position=yours",
                       "--exercises=mine")[1:], cwd=tmp_path)
    assert "attention: yours (scaled_dot_product_attention in mine/01_attention.py)" in yours.stdout
    assert "position: yours (apply_rope in mine/05_rope.py)" in yours.stdout
    run_script(*tiny(corpus, tmp_path, "eager", "--model.attention=eager", "--model.position=rope"))
    a, b = step_losses(tmp_path / "runs" / "yours"), step_losses(tmp_path / "runs" / "eager")
    assert len(a) == len(b) == 4 and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    hint = yours.stdout.split("sample with: python sample.py ")[1].split()
    assert hint == ["--run", str(tmp_path / "runs" / "yours"), "--exercises", str(mine.resolve())]
    sampled = run_script(ROOT / "sample.py", *hint, "--max_new_tokens=8", "--device=cpu",
                         "--prompt=ROMEO:", cwd=tmp_path / "runs")
    assert f"position: yours (apply_rope in {mine.resolve()}" in sampled.stderr
    assert sampled.stdout.startswith("ROMEO:")


def plugged(monkeypatch, registry: str, entry) -> None:
    """`yours` in one registry for this test only, written as plug_in writes it (the
    registry refuses a `yours` entry written any other way)."""
    from model import registry as model_registry
    monkeypatch.setitem(model_registry.REGISTRIES[registry], "yours", entry)
    monkeypatch.setitem(model_registry._plugged, (registry, "yours"), entry)


@pytest.mark.parametrize("n_kv_head", [0, 2])
def test_the_learners_rope_turns_queries_and_fewer_keys_as_the_projects_does(n_kv_head, monkeypatch):
    """The learner's apply_rope (here the answer key) in place of the project's RoPE gives
    the same logits, grouped key/value heads included (their keys are fewer than the
    queries, which once made the split of a layer's heads negative)."""
    import importlib
    from attnlab.exercises import plug
    from model import GPT, ModelConfig
    answer = importlib.import_module("attnlab.exercises.solutions.05_rope").apply_rope
    plugged(monkeypatch, "position",
            type("YourRoPE", (plug.YourRoPE,), {"learner": staticmethod(answer)}))
    torch.manual_seed(0)
    sizes = dict(vocab_size=20, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, block_size=16)
    project, learners = GPT(ModelConfig(position="rope", **sizes)), GPT(ModelConfig(position="yours", **sizes))
    learners.load_state_dict(project.state_dict())
    x = torch.randint(0, 20, (2, 10))
    torch.testing.assert_close(learners(x).logits, project(x).logits, atol=1e-5, rtol=0)


def test_a_run_trained_with_yours_needs_the_folder_on_the_command_line(tmp_path, monkeypatch):
    """A run names no code: exercises.json, which once recorded the learner's folder, is
    never read, and only --exercises (or, for a `yours` typed on train.py's command
    line, my_attention) says where the learner's code is."""
    from attnlab.exercises import plug
    from model import ModelConfig
    plugged(monkeypatch, "attention", plug.YOUR_BACKEND)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "exercises.json").write_text(json.dumps({"folder": str(tmp_path / "mine")}))
    assert plug.folder_for(ModelConfig(attention="eager"), None, run) is None
    assert plug.folder_for(ModelConfig(attention="yours"), "other", run) == plug.Path("other")
    with pytest.raises(ExerciseError, match="--exercises DIR"):
        plug.folder_for(ModelConfig(attention="yours"), None, run)


def test_training_with_yours_is_refused_until_the_exercise_passes(corpus, tmp_path):
    mine = tmp_path / "mine"
    start(mine)
    proc = run_script(*tiny(corpus, tmp_path, "x", "--model.attention=yours",
                            f"--exercises={mine}"), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: exercise 1 (attention)") and "not started" in lines[0]
    assert not (tmp_path / "runs").exists()                    # refused before any work


def test_position_yours_is_your_sinusoidal_table_until_rope_passes(tmp_path, monkeypatch):
    # In this process, without train.py: the registries are patched for this test only.
    import torch
    from attnlab.exercises import plug
    from model import GPT, ModelConfig
    plugged(monkeypatch, "attention", plug.YOUR_BACKEND)
    plugged(monkeypatch, "position", plug.YourPositions)
    monkeypatch.setattr(plug, "_bound", {})
    mine = tmp_path / "mine"
    start(mine)
    for name in ("attention", "sinusoidal"):
        shutil.copy(SOLUTIONS / BY_NAME[name].filename, mine)
    config = ModelConfig(vocab_size=20, n_layer=1, n_head=2, n_embd=16, block_size=8,
                         attention="yours", position="yours")
    notes = plug.prepare(config, mine)
    assert notes[1] == f"position: yours (sinusoidal_positions in {mine / '04_sinusoidal.py'})"
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    yours = GPT(config).eval()
    torch.manual_seed(0)
    theirs = GPT(ModelConfig(**{**vars(config), "attention": "eager", "position": "sinusoidal"}))
    assert yours.positions.absolute and not yours.positions.rotary
    assert torch.allclose(yours(ids)[0], theirs.eval()(ids)[0], atol=1e-5)
    (mine / "04_sinusoidal.py").unlink()
    with pytest.raises(ExerciseError, match="model.position=yours needs exercise 5 .rope. or 4"):
        plug.prepare(config, mine)
    with pytest.raises(ExerciseError, match="position=alibi adds a bias to the scores"):
        plug.prepare(ModelConfig(**{**vars(config), "position": "alibi"}), mine)


def test_the_exercises_import_only_floors_below_them_and_never_the_tests():
    # tests/test_architecture.py reads each package's top level; this package's folders too.
    import ast
    allowed = {"attnlab", "engine", "model", "data", "common", "torch", "numpy"}
    for path in (ROOT / "attnlab" / "exercises").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in allowed or top in sys.stdlib_module_names, (path, name)


@pytest.mark.parametrize("where", ["in the function", "at import"])
def test_a_loop_in_the_learners_code_is_stopped_and_named(where, tmp_path, monkeypatch):
    """The check gave no output at all until killed. The loop here ends by itself after
    30 s (so the check before the fix ends too); the limit stops it long before."""
    from attnlab.exercises import learner
    monkeypatch.setattr(learner, "LIMIT_S", 2.0)
    ex = EXERCISES[0]
    loop = "import time\nend = time.time() + 30\nwhile time.time() < end:\n    pass\n"
    body = (f"def {ex.function}(*args):\n" + "".join("    " + l + "\n" for l in loop.splitlines())
            if where == "in the function" else loop + f"def {ex.function}(*args):\n    pass\n")
    result = check(ex, write(tmp_path, ex, body))
    assert result.status == "failed" and "did not finish within 2 s" in result.message
    assert "a loop that never ends" in result.message


def test_an_exit_or_a_crash_in_the_learners_code_is_a_failure_the_checker_reports(tmp_path):
    """sys.exit() or os._exit(0) in the learner's file ended the checker with status 0
    and no output, which a script reads as success."""
    ends = {"sys.exit()": "import sys\nsys.exit()\n",
            "os._exit(0)": "import os\nos._exit(0)\n",
            "SIGSEGV": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"}
    for ex, (name, end) in zip(EXERCISES, ends.items()):
        # The first exits from inside the function, the others at import.
        source = (f"def {ex.function}(*args):\n    " + end.replace("\n", "\n    ") if ex.number == 1
                  else end + f"def {ex.function}(*args):\n    pass\n")
        write(tmp_path, ex, source)
    proc = run_script("-m", "attnlab.exercises", "check", tmp_path, check=False, timeout=200)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    rows = {line.split()[1]: line for line in proc.stdout.splitlines() if line[:3].strip().isdigit()}
    assert "ended the process that checked it (exit code 0: sys.exit()" in rows[EXERCISES[0].name]
    assert "ended the process that checked it (exit code 0: sys.exit()" in rows[EXERCISES[1].name]
    assert "crashed the process that checked it (SIGSEGV)" in rows[EXERCISES[2].name]
    assert f"0 of {len(EXERCISES)} passed" in proc.stdout


HOSTILE_ENDS = {
    # A signal to its own group, to its parent (kill and terminate), an interrupt raised,
    # and a flood of prints: a second pass found each ending the checker, printing a
    # traceback, or relayed whole (582 MB held for 200 MB printed).
    "its group killed": ("call", "import os, signal\nos.killpg(0, signal.SIGKILL)\n"),
    "its parent killed": ("import", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"),
    "its parent ended": ("import", "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)\n"),
    "an interrupt": ("call", "raise KeyboardInterrupt\n"),
    "a flood": ("call", "print('x' * 3_000_000)\n"),
}


def test_a_signal_an_interrupt_or_a_flood_from_the_learners_code_leaves_the_checker_standing(tmp_path):
    for ex, (when, end) in zip(EXERCISES, HOSTILE_ENDS.values()):
        source = (f"def {ex.function}(*args):\n    " + end.replace("\n", "\n    ") if when == "call"
                  else end + f"def {ex.function}(*args):\n    pass\n")
        write(tmp_path, ex, source)
    # A session of its own, so that on code without the fix the group kill ends only it.
    proc = subprocess.run([sys.executable, "-m", "attnlab.exercises", "check", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=200,
                          capture_output=True, text=True, start_new_session=True)
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    rows = {line.split()[1]: line for line in proc.stdout.splitlines() if line[:3].strip().isdigit()}
    assert len(rows) == len(EXERCISES) and f"0 of {len(EXERCISES)} passed" in proc.stdout
    names = [ex.name for ex in EXERCISES]
    assert "crashed the process that checked it (SIGKILL)" in rows[names[0]]
    assert all("failed" in rows[name] for name in names[1:3])
    assert "raised KeyboardInterrupt, which stops a program" in rows[names[3]]
    assert "Traceback" not in proc.stderr
    assert len(proc.stdout) < 100_000 and "2,980,001 more characters printed" in proc.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's state in /proc")
def test_a_process_the_learners_code_leaves_running_ends_with_its_check(tmp_path):
    """A child the learner's file forks and leaves sleeping was left running after the
    check; it is in the learner's process group and is killed with it."""
    ex, pid_file = EXERCISES[0], tmp_path / "pid"
    body = (f"import os, time\nif os.fork() == 0:\n    open({str(pid_file) + '.tmp'!r}, 'w')"
            f".write(str(os.getpid()))\n    os.rename({str(pid_file) + '.tmp'!r}, {str(pid_file)!r})"
            f"\n    time.sleep(300)\n    os._exit(0)\nwhile not os.path.exists({str(pid_file)!r}):\n"
            f"    time.sleep(0.01)\ndef {ex.function}(*args):\n    pass\n")
    assert check(ex, write(tmp_path / "ex", ex, body)).status == "failed"
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")

    def ended():             # gone, or a zombie waiting for whoever adopted it to reap it
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True
    # A kill is delivered when the process next runs; on code without the fix it sleeps 300 s.
    for _ in range(200):
        if ended():
            break
        time.sleep(0.05)
    assert ended()


def test_an_interrupt_sent_to_the_group_of_the_learners_parent_leaves_the_checker_standing(tmp_path):
    """The watcher shared the checker's process group: the learner's code reaching for
    its parent's group interrupted the checker itself, which ended with a traceback."""
    ex = EXERCISES[0]
    write(tmp_path, ex, "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGINT)\n"
                        f"def {ex.function}(*args):\n    pass\n")
    # A session of its own, so that on code without the fix the interrupt ends only it.
    proc = subprocess.run([sys.executable, "-m", "attnlab.exercises", "check", ex.name,
                           "--exercises", str(tmp_path)], cwd=ROOT, timeout=200,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, start_new_session=True)
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.startswith(f"exercise 1 ({ex.name}, {ex.title}): failed")
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr


def _gone(pid: int) -> bool:
    """Whether the process `pid` has ended (gone, or a zombie no one has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's state in /proc")
@pytest.mark.parametrize("how", ["its child in a session of its own", "an orphan in a session of its own"])
def test_a_process_that_leaves_the_learners_session_ends_with_its_check(how):
    """A process the learner's code starts with os.setsid() is in neither its group nor
    its session, and outlived the check (sleeping here for 300 s); so did one whose parent
    ended first (a daemon's double fork). Each is killed when the check ends."""
    from attnlab.exercises import apart
    read_end, write_end = os.pipe()

    def task():
        if os.fork() == 0:
            if how.startswith("an orphan") and os.fork() != 0:
                os._exit(0)                              # the parent ends; its child lives on
            os.setsid()
            os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(300)
            os._exit(0)
        return {"started": int(os.read(read_end, 64).decode())}
    ended = apart.run_apart(task, 60)
    os.close(read_end), os.close(write_end)
    pid = ended.said["started"]
    try:
        assert _gone(pid)                  # killed before run_apart returned: no waiting here
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)               # on code without the fix


def test_the_learners_code_runs_with_its_memory_bounded():
    """An allocation far past the headroom fails in the learner's code, not in the
    machine; torch.empty touches no page, so without the bound it would succeed."""
    from attnlab.exercises import apart
    ended = apart.run_apart(lambda: {"bytes": torch.empty(
        2 * apart.MEMORY_HEADROOM, dtype=torch.uint8).numel()}, 60)
    assert ended.said == {"raised": "RuntimeError"}
    ended = apart.run_apart(lambda: {"bytes": torch.empty(1 << 20, dtype=torch.uint8).numel()}, 60)
    assert ended.said == {"bytes": 1 << 20} and ended.code == 0


# --- exercise 9: the learner's recurrent step inside linear attention ---------------

def learners_step(tmp_path):
    """The plain correct answer of exercise 9, loaded from a file as the learner's is."""
    from attnlab.exercises.learner import load
    ex = BY_NAME["linear_rnn"]
    return load(ex, write(tmp_path / "step", ex, CORRECT["linear_rnn"]))


def test_the_learners_step_makes_linear_attentions_sums_in_the_layer(tmp_path):
    """The layer whose sums the learner's step makes, token by token, against the project's
    chunked form with the same weights: the whole pass, decoding with the state, and the
    gradients (a step that changed S in place would fail the backward)."""
    from mechanism_checks import decode_error, inputs, layer, whole
    from attnlab.exercises import plug
    from model.linear_attention import LinearAttention
    yours_cls = type("Yours", (plug.YourLinearAttention,),
                     {"learner": staticmethod(learners_step(tmp_path))})
    project, yours = layer(LinearAttention, linear_chunk=4), layer(yours_cls, linear_chunk=4)
    x = inputs()
    assert (whole(yours, x) - whole(project, x)).abs().max() < 1e-6     # the paper's 1e-6 eps
    assert decode_error(yours, x) < 1e-6
    whole(yours, x).square().sum().backward()
    whole(project, x).square().sum().backward()
    for a, b in zip(yours.parameters(), project.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ExerciseError, match="model.mechanism=yours has not been prepared"):
        whole(layer(plug.YourLinearAttention), x)


def linear_entry():
    """linear's mechanism entry: model/mechanisms.py's where it has one, else a stand-in
    with the facts a GPT needs to build and train it."""
    from model.linear_attention import LinearAttention
    from model.mechanisms import MECHANISMS, Cache, Mechanism
    return MECHANISMS.get("linear") or Mechanism(
        LinearAttention, Cache("a fixed-size state S, z", lambda c: 0),
        follows_mask=False, takes_score_bias=False)


def test_mechanism_yours_is_linear_with_your_step_once_exercise_9_passes(tmp_path, monkeypatch):
    from attnlab.exercises import plug
    from model import GPT, ModelConfig
    from model.mechanisms import MECHANISMS
    monkeypatch.setitem(MECHANISMS, "linear", linear_entry())
    plug.install()
    assert plug.YourLinearAttention is MECHANISMS["yours"].layer
    assert MECHANISMS["yours"].cache is MECHANISMS["linear"].cache
    mine = tmp_path / "mine"
    start(mine)
    config = ModelConfig(vocab_size=20, n_layer=2, n_head=2, n_embd=16, block_size=8,
                         mechanism="yours,mha", linear_chunk=4)
    assert plug.chosen(config) == (False, False, True, False)
    with pytest.raises(ExerciseError, match=r"exercise 9 \(linear_rnn\) .*\(not started"):
        plug.prepare(config, mine)
    shutil.copy(SOLUTIONS / BY_NAME["linear_rnn"].filename, mine)
    assert plug.prepare(config, mine) == [
        f"mechanism: yours (linear_attention_step in {mine / '09_linear_rnn.py'})"]
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    yours = GPT(config)
    torch.manual_seed(0)
    theirs = GPT(ModelConfig(**{**vars(config), "mechanism": "linear,mha"}))
    assert type(yours.blocks[0].attn).learner is not None
    out, want = yours(ids, ids), theirs(ids, ids)
    assert torch.allclose(out.logits, want.logits, atol=1e-5)
    out.loss.backward()
    assert plug.folder_for(config, str(mine), tmp_path / "run") == mine


def test_training_with_your_linear_step_matches_linear(corpus, tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(SOLUTIONS, mine)
    yours = run_script(*tiny(corpus, tmp_path, "yours", "--model.mechanism=yours",
                             f"--exercises={mine}"))
    assert f"mechanism: yours (linear_attention_step in {mine / '09_linear_rnn.py'})" \
        in yours.stdout
    run_script(*tiny(corpus, tmp_path, "linear", "--model.mechanism=linear"))
    a, b = step_losses(tmp_path / "runs" / "yours"), step_losses(tmp_path / "runs" / "linear")
    assert len(a) == len(b) == 4 and a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_list_names_every_exercise_in_order_with_its_file(capsys):
    assert tool.main(["list"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l[:3].strip().isdigit()]
    assert [l.split()[1] for l in lines] == [ex.name for ex in EXERCISES]
    assert all(ex.filename in l and ex.section in l for ex, l in zip(EXERCISES, lines))


def test_an_exercise_file_too_large_to_be_one_is_refused_by_its_size_unread(tmp_path, monkeypatch):
    """The checker read the whole file to see whether it was blank: a 12 GB sparse file
    ended it with a MemoryError traceback. A file past FILE_LIMIT is refused by its size
    in one error line, before a byte is read (a sparse 64 MB file here: the same path)."""
    from attnlab.exercises import learner
    mine = tmp_path / "mine"
    start(mine)
    os.truncate(mine / "02_causal_mask.py", 64 << 20)                # sparse: no disk used
    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read.append(p.name) or real(p))
    with pytest.raises(learner.ExerciseError, match=r"02_causal_mask.py is 67,108,864 bytes, more "
                       r"than the 1,048,576 an exercise file may be; move it away"):
        check(BY_NAME["causal_mask"], mine)
    assert "02_causal_mask.py" not in read
    proc = run_script("-m", "attnlab.exercises", "check", mine, check=False, timeout=200)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
    assert "02_causal_mask.py is 67,108,864 bytes" in errors[0]


def test_an_exception_message_past_the_answer_pipes_size_is_a_failure_that_names_it(tmp_path):
    """A message over 64 KB made the child's JSON answer too long: cut at the limit it did
    not parse, and the check read it as sys.exit()/os._exit()."""
    ex = EXERCISES[0]
    result = check(ex, write(tmp_path, ex, f"def {ex.function}(*args):\n"
                                           "    raise ValueError('too big ' * 20_000)\n"))
    assert result.status == "failed" and "ValueError" in result.message
    assert "sys.exit()" not in result.message and len(result.message) <= 2000


def test_the_answer_of_a_check_too_long_to_send_is_said_not_read_as_an_exit():
    from attnlab.exercises import apart
    ended = apart.run_apart(lambda: {"message": "x" * (1 << 17)}, 60)
    assert ended.said == {"too_long": (1 << 17) + len('{"message": ""}')} and ended.code == 0


def test_an_exercise_that_stops_itself_is_named_not_called_a_loop(tmp_path, monkeypatch):
    """A process stopped by SIGSTOP neither ends nor runs: the checker waited out its time
    limit and called it a loop that never ends."""
    from attnlab.exercises import learner
    monkeypatch.setattr(learner, "LIMIT_S", 30.0)
    ex = EXERCISES[0]
    result = check(ex, write(tmp_path, ex, f"import os, signal\ndef {ex.function}(*args):\n"
                                           "    os.kill(os.getpid(), signal.SIGSTOP)\n"))
    assert result.status == "failed" and "stopped the process that checked it (SIGSTOP" in result.message
    assert "loop" not in result.message


def test_control_characters_the_learner_prints_reach_the_terminal_as_escapes(tmp_path):
    """An ANSI escape in the learner's print (or exception) reached the terminal raw: it
    could clear the screen or recolour and hide the checker's own lines."""
    ex = EXERCISES[0]
    write(tmp_path, ex, f"def {ex.function}(*args):\n"
                        "    print('\\x1b[2J\\x1b[31mred\\rback\\u202eflip\\tok')\n"
                        "    raise ValueError('\\x1b]0;title\\x07')\n")
    proc = run_script("-m", "attnlab.exercises", "check", ex.name, "--exercises", tmp_path,
                      check=False, timeout=200)
    assert "\\x1b[2J\\x1b[31mred\\x0dback\\u202eflip\tok" in proc.stdout
    assert "\\x1b]0;title\\x07" in proc.stdout
    assert not any(c in proc.stdout + proc.stderr for c in "\x1b\r\x07\u202e")


# --- exercises 10 and 11: the learner's sink and routing inside the gpt-oss card -----

def learners(tmp_path, name):
    """The plain correct answer of an exercise, loaded from a file as the learner's is."""
    from attnlab.exercises.learner import load
    ex = BY_NAME[name]
    return load(ex, write(tmp_path / name, ex, CORRECT[name]))


def test_the_learners_sink_attention_is_the_layers_with_windows_the_cache_and_gradients(tmp_path):
    """The layer whose weights the learner's sink_attention computes, against the project's
    SinkAttention with the same weights and learned sinks: the whole pass, in a sliding
    window, decoding from the cache, and the gradients, the sinks' included."""
    from mechanism_checks import config, decode_error, inputs, layer, whole
    from attnlab.exercises import plug
    from model.attention import Mask
    from model.positions import POSITION_ENCODINGS
    from model.sink_attention import SinkAttention
    yours_cls = type("Yours", (plug.YourSinkAttention,),
                     {"learner": staticmethod(learners(tmp_path, "sinks"))})
    project, yours = layer(SinkAttention), layer(yours_cls)
    assert yours.sinks.abs().min() > 0 and torch.equal(yours.sinks, project.sinks)
    x = inputs()
    assert (whole(yours, x) - whole(project, x)).abs().max() < 1e-12
    assert decode_error(yours, x) < 1e-12
    window = Mask.over(0, x.shape[1], x.shape[1], window=3)
    rope = POSITION_ENCODINGS["rope"](config())
    assert (yours(x, rope, window)[0] - project(x, rope, window)[0]).abs().max() < 1e-12
    whole(yours, x).square().sum().backward()
    whole(project, x).square().sum().backward()
    for a, b in zip(yours.parameters(), project.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    with pytest.raises(ExerciseError, match="model.mechanism=yours_sinks has not been prepared"):
        whole(layer(plug.YourSinkAttention), x)


def test_the_learners_routing_is_the_mixture_of_experts_layers(tmp_path):
    """gpt-oss's experts and router (with its bias) around the learner's moe_layer, against
    the project's layer: the output, the gradients and the load counted per expert."""
    from mechanism_checks import config
    from attnlab.exercises import plug
    from model.moe import MixtureOfExperts
    yours_cls = type("Yours", (plug.YourMixtureOfExperts,),
                     {"learner": staticmethod(learners(tmp_path, "top_k_routing"))})
    cfg = config(mlp="moe", moe_experts=4, moe_top_k=2, moe_shared=1, moe_router="softmax_topk",
                 moe_expert="gpt_oss", moe_bias_rate=0.0, bias=True)
    torch.manual_seed(0)
    project = MixtureOfExperts(cfg).double()
    with torch.no_grad():
        for p in project.parameters():
            p.normal_(0.0, 0.4)
    yours = yours_cls(cfg).double()
    yours.load_state_dict(project.state_dict())
    x = torch.randn(2, 9, cfg.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, want = yours(x), project(x)
    assert (out - want).abs().max() < 1e-12
    out.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip(yours.parameters(), project.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    yours.after_step()
    project.after_step()
    assert yours.load.sum().item() == pytest.approx(2) and torch.equal(yours.load, project.load)
    with pytest.raises(ExerciseError, match="model.mlp=yours has not been prepared"):
        plug.YourMixtureOfExperts(cfg)(x)


def test_the_card_pieces_are_refused_until_they_pass_and_where_they_cannot_run(tmp_path, monkeypatch):
    from attnlab.exercises import plug
    from model import ModelConfig
    plug.install()
    mine = tmp_path / "mine"
    start(mine)
    card = dict(vocab_size=20, n_layer=2, n_head=2, n_embd=16, block_size=8, mechanism="yours_sinks",
                mlp="yours", moe_experts=4, moe_shared=0, moe_router="softmax_topk", moe_bias_rate=0.0)
    config = ModelConfig(**card)
    assert plug.chosen(config) == (False, False, True, True)
    assert plug.typed(config, {"mechanism": "yours_sinks", "mlp": "yours"})
    assert not plug.typed(config, {"mechanism": "yours_sinks"})        # the MLP came from a file
    assert not plug.typed(config, {"mechanism": "yours", "mlp": "yours"})
    with pytest.raises(ExerciseError, match=r"exercise 10 \(sinks\) .*\(not started"):
        plug.prepare(config, mine)
    write(mine, BY_NAME["sinks"], CORRECT["sinks"])
    with pytest.raises(ExerciseError, match=r"exercise 11 \(top_k_routing\) .*\(not started"):
        plug.prepare(config, mine)
    write(mine, BY_NAME["top_k_routing"], CORRECT["top_k_routing"])
    assert plug.prepare(config, mine) == [
        f"mechanism: yours_sinks (sink_attention in {mine / '10_sinks.py'})",
        f"mlp: yours (moe_layer in {mine / '11_top_k_routing.py'})"]
    with pytest.raises(ExerciseError, match="model.moe_router=sigmoid weights them otherwise"):
        plug.prepare(ModelConfig(**{**card, "moe_router": "sigmoid", "moe_bias_rate": 1e-3}), mine)
    with pytest.raises(ExerciseError, match="your sink attention has no dropout"):
        plug.prepare(ModelConfig(**{**card, "dropout": 0.1}), mine)
    with pytest.raises(ExerciseError, match=r"asks for your own code \(model.mechanism=yours_sinks\)"):
        plug.folder_for(config, None, tmp_path / "run")


def test_training_the_gpt_oss_card_with_your_sink_and_routing_matches_the_card(corpus, tmp_path):
    """The documented command, at a tiny size: the learner's plain answers to exercises
    10 and 11 (not the project's code) train the gpt-oss card as its own pieces do."""
    mine = tmp_path / "mine"
    for name in ("sinks", "top_k_routing"):
        write(mine, BY_NAME[name], CORRECT[name])

    def card(name, *extra):
        return run_script("train.py", "--config", "gpt-oss", f"--data.path={corpus}",
                          f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={tmp_path / 'runs'}",
                          f"--train.run_name={name}", "--model.n_layer=2", "--model.n_embd=32",
                          "--model.n_head=2", "--model.n_kv_head=1", "--model.block_size=32",
                          "--model.sliding_window=8", "--model.moe_experts=4", "--train.device=cpu",
                          "--train.batch_size=4", "--train.max_iters=24", "--train.warmup_iters=2",
                          "--train.eval_interval=24", "--train.eval_iters=1", "--train.log_interval=1",
                          *extra)
    yours = card("yours", "--model.mechanism=yours_sinks", "--model.mlp=yours", f"--exercises={mine}")
    assert f"mechanism: yours_sinks (sink_attention in {mine / '10_sinks.py'})" in yours.stdout
    assert f"mlp: yours (moe_layer in {mine / '11_top_k_routing.py'})" in yours.stdout
    card("card")
    a, b = step_losses(tmp_path / "runs" / "yours"), step_losses(tmp_path / "runs" / "card")
    assert len(a) == len(b) == 24 and a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert a[-1] < a[0] - 0.3                                   # and it learns


def test_the_learners_gate_is_gated_attentions_with_the_cache_and_gradients(tmp_path):
    """The layer whose output gate and W_O the learner's gated_output applies, against the
    project's GatedAttention with the same weights: the whole pass, decoding from the
    cache, and the gradients (W_G's included)."""
    from mechanism_checks import decode_error, inputs, layer, whole
    from attnlab.exercises import plug
    from model.gated_attention import GatedAttention
    yours_cls = type("Yours", (plug.YourGatedAttention,),
                     {"learner": staticmethod(learners(tmp_path, "gate"))})
    project, yours = layer(GatedAttention), layer(yours_cls)
    x = inputs()
    assert (whole(yours, x) - whole(project, x)).abs().max() < 1e-12
    assert decode_error(yours, x) < 1e-12
    whole(yours, x).square().sum().backward()
    whole(project, x).square().sum().backward()
    for a, b in zip(yours.parameters(), project.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    with pytest.raises(ExerciseError, match="model.mechanism=yours_gated has not been prepared"):
        whole(layer(plug.YourGatedAttention), x)


def test_training_the_qwen3_next_card_with_your_gate_matches_the_card(corpus, tmp_path):
    """The documented command, at a tiny size: the learner's plain answer to exercise 12
    gates the card's softmax layers, and the run's losses are the card's own."""
    from attnlab.exercises import plug
    from model import ModelConfig
    mine = tmp_path / "mine"
    write(mine, BY_NAME["gate"], CORRECT["gate"])
    plug.install()
    with pytest.raises(ExerciseError, match="takes W_G and W_O without biases; set model.bias=false"):
        plug.prepare(ModelConfig(mechanism="yours_gated", bias=True), mine)

    def card(name, mechanism, *extra):
        return run_script("train.py", "--config", "qwen3-next", f"--data.path={corpus}",
                          f"--data.cache_dir={tmp_path / 'cache'}", f"--train.out_dir={tmp_path / 'runs'}",
                          f"--train.run_name={name}", "--model.n_layer=2", "--model.n_embd=32",
                          "--model.n_head=2", "--model.block_size=32", "--model.moe_experts=4",
                          f"--model.mechanism=gated_deltanet,{mechanism}", "--train.device=cpu",
                          "--train.batch_size=4", "--train.max_iters=24", "--train.warmup_iters=2",
                          "--train.eval_interval=24", "--train.eval_iters=1", "--train.log_interval=1",
                          *extra)
    yours = card("yours", "yours_gated", f"--exercises={mine}")
    assert f"mechanism: yours_gated (gated_output in {mine / '12_gate.py'})" in yours.stdout
    card("card", "gated")
    a, b = step_losses(tmp_path / "runs" / "yours"), step_losses(tmp_path / "runs" / "card")
    assert len(a) == len(b) == 24 and a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert a[-1] < a[0] - 0.3


def test_the_views_read_the_learners_gate_and_routing_as_the_cards_own(tmp_path):
    """heads gates, experts and lens pieces on a model whose gate (exercise 12) and routing
    (exercise 11) are the learner's: the same numbers as the project's layers with the same
    weights give, though the learner's code never calls w_gate or route itself."""
    from attnlab.capture import run_with_cache
    from attnlab.exercises import plug
    from attnlab.lens import piece_ablation
    from model import GPT, ModelConfig
    mine = tmp_path / "mine"
    write(mine, BY_NAME["gate"], CORRECT["gate"])
    write(mine, BY_NAME["top_k_routing"], CORRECT["top_k_routing"])
    plug.install()
    sizes = dict(vocab_size=20, n_layer=2, n_head=2, n_embd=16, block_size=16, mlp="moe",
                 moe_experts=4, moe_top_k=2, moe_shared=1, moe_router="softmax_topk",
                 moe_bias_rate=0.0)
    yours_cfg = ModelConfig(**sizes, mechanism="mha,yours_gated")
    plug.prepare(yours_cfg, mine)
    yours_cfg = ModelConfig(**{**vars(yours_cfg), "mlp": "yours"})
    plug.prepare(yours_cfg, mine)
    torch.manual_seed(0)
    project = GPT(ModelConfig(**sizes, mechanism="mha,gated")).double().eval()
    yours = GPT(yours_cfg).double().eval()
    yours.load_state_dict(project.state_dict())
    ids = torch.randint(0, 20, (1, 12), generator=torch.Generator().manual_seed(1))
    names = ["blocks.1.gate", "blocks.0.experts", "blocks.1.expert_weights"]
    _, want = run_with_cache(project, ids, only=names)
    _, got = run_with_cache(yours, ids, only=names)
    for name in names:
        assert torch.allclose(got[name].double(), want[name].double(), atol=1e-12), name
    assert 0 < want["blocks.1.gate"].min() and want["blocks.1.gate"].max() < 1
    base_y, changes_y, _, experts_y = piece_ablation(yours, ids)
    base_p, changes_p, _, experts_p = piece_ablation(project, ids)
    assert abs(changes_p[1, "gate"]) > 1e-6                   # holding it open moves the loss
    assert changes_y[1, "gate"] == pytest.approx(changes_p[1, "gate"], abs=1e-9)
    assert torch.allclose(experts_y, experts_p, atol=1e-9)


def test_a_row_scaled_up_by_its_sinks_share_is_named_as_the_numerator(tmp_path):
    """exp(s_h) above the line, written otherwise than the checker's own variant (each row
    scaled up by its sink's share, p: the keys' softmax times 1 + p): rows then sum to
    more than 1, which names the numerator, not a missing sink."""
    ex, line = BY_NAME["sinks"], "torch.softmax(both, dim=-1)[..., :-1]"
    full = "torch.softmax(both, dim=-1)"
    source = ALSO_CORRECT["sinks"].replace(
        line, f"({full}[..., :-1] / (1 - {full}[..., -1:]) * (1 + {full}[..., -1:]))")
    result = check(ex, write(tmp_path, ex, source))
    assert result.status == "failed" and "into the numerator" in result.message, result.message
