"""The exercises, in the article's order, then one after it and two from today's model
cards, and the checker that diagnoses them.

Each exercise has inputs (cases, float64, seeded), a reference (reference.py) and the
mistakes learners make, planted as variants of the reference. `run_check` calls the
learner's function on each case: equal to the reference on every case is a pass;
otherwise the variant it matches names the mistake, and failing that, a generic check
on what the output must satisfy (rows summing to 1, no weight on hidden keys, the past
not changed by the future) does."""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from attnlab.exercises import reference as ref

# float64 inputs; a learner who computes in float32 somewhere still passes, while every
# planted mistake differs from the reference by orders of magnitude more.
RTOL, ATOL = 1e-4, 1e-5


@dataclass
class Case:
    label: str            # the case in words, for messages
    args: tuple


@dataclass
class Exercise:
    number: int
    name: str             # what `check NAME` takes
    title: str
    function: str         # the function the learner writes
    section: str          # where `doc` explains it
    answer: str           # the project's own implementation, file:function
    cases: Callable[[], list[Case]]
    reference: Callable
    mistakes: dict        # name -> (planted variant, diagnosis)
    generic: Callable = lambda case, got, want, fn: None   # -> diagnosis | None
    as_mask: bool = False  # the function returns a bool mask, not numbers
    trains: str = ""      # the train.py option that runs it once it passes
    shape_hints: tuple = ()   # per output: what a wrong shape there usually means
    raised: Callable = lambda case, err, fn: None   # the learner's exception -> diagnosis | None
    # How the function (the learner's, or a planted variant) runs on a case's args: called
    # once, or (a recurrent step) driven token by token.
    call: Callable = lambda fn, args: fn(*args)
    # (name, name) -> a variant with both of those mistakes, so two at once are named too.
    pairs: dict = field(default_factory=dict)
    doc: str = "docs/walkthrough.md"     # the page that explains it
    preset: str = "exercise"             # the preset `trains` goes with

    @property
    def filename(self) -> str:
        return f"{self.number:02d}_{self.name}.py"


@dataclass
class Result:
    exercise: Exercise
    status: str   # "passed", "failed", "not started", "missing" (no file), "empty", "not a file"
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class Diagnosis(Exception):
    """A failed check, in the article's terms."""


# --- comparing outputs -------------------------------------------------------------

def _as_outputs(value, want: tuple, ex: Exercise, case: Case) -> tuple:
    """The learner's return value as a tuple of float64 tensors shaped like `want`."""
    got = value if isinstance(value, (tuple, list)) else (value,)
    if len(got) != len(want):
        raise Diagnosis(f"{ex.function} returned {len(got)} value(s), expected {len(want)} "
                        f"({_describe(want)}); see the docstring of {ex.function}")
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor):
            try:
                g = torch.as_tensor(g)
            except Exception:
                raise Diagnosis(f"{ex.function} returned a {type(g).__name__} where a tensor "
                                f"of shape {tuple(w.shape)} was expected") from None
        if ex.as_mask:
            if g.is_floating_point() and torch.isinf(g).any():
                raise Diagnosis("the mask is additive (0 and -inf); return a bool tensor, True "
                                "where the query may see the key")
            if g.dtype != torch.bool:
                # masked_fill refuses a mask that is not bool, and ~ on ints flips bits
                # (~1 is -2, still nonzero): a 0/1 int mask breaks the attention using it.
                raise Diagnosis(f"{ex.function} returned a {str(g.dtype).removeprefix('torch.')} "
                                "tensor; return a bool tensor (dtype=torch.bool), True where "
                                "the query may see the key")
        if tuple(g.shape) != tuple(w.shape):
            which = f"output {i + 1}" if len(want) > 1 else "the output"
            hint = ex.shape_hints[i] if i < len(ex.shape_hints) else ""
            raise Diagnosis(f"{which} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
                            f"{': ' + hint if hint else ''} ({case.label})")
        out.append(g if ex.as_mask else g.detach().to(torch.float64).cpu())
    return tuple(out)


def _describe(want: tuple) -> str:
    return ", ".join(str(tuple(w.shape)) for w in want)


def same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return False
        if x.dtype == torch.bool or y.dtype == torch.bool:
            if not torch.equal(x.bool(), y.bool()):
                return False
        elif not torch.allclose(x.to(torch.float64), y.to(torch.float64), rtol=RTOL, atol=ATOL,
                                equal_nan=True):
            return False
    return True


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _where_it_failed(err: BaseException, folder: Path | None) -> str:
    """'02_causal_mask.py line 14' for the deepest frame in the learner's folder."""
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if folder is not None and Path(f.filename).parent == folder]
    if not mine:
        return ""
    return f" ({Path(mine[-1].filename).name} line {mine[-1].lineno})"


def run_check(ex: Exercise, fn: Callable, folder: Path | None = None) -> Result:
    """Check one function against its exercise's reference, case by case."""
    for case in ex.cases():
        want = _tuple(ex.reference(*_clone(case.args)))
        try:
            value = ex.call(fn, _clone(case.args))
        except NotImplementedError:
            return Result(ex, "not started", f"{ex.function} still raises NotImplementedError")
        except Diagnosis as d:            # what the driver of a step saw it return
            return Result(ex, "failed", f"{d} ({case.label})")
        except Exception as err:
            try:
                known = ex.raised(case, err, fn)
            except Exception:             # a diagnosis that cannot judge this error
                known = None
            if known:
                return Result(ex, "failed", f"{known} ({case.label})")
            line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return Result(ex, "failed", f"your {ex.function} raised {type(err).__name__}"
                          f"{_where_it_failed(err, folder)}: {line} ({case.label})")
        try:
            got = _as_outputs(value, want, ex, case)
        except Diagnosis as d:
            return Result(ex, "failed", str(d))
        if same(got, want):
            continue
        diagnosis = which_mistake(ex, case, got, want)
        if diagnosis:
            return Result(ex, "failed", f"{diagnosis} ({case.label})")
        try:
            message = ex.generic(case, got, want, fn)
        except Exception:             # a generic check that cannot judge this output
            message = None
        if message:
            return Result(ex, "failed", f"{message} ({case.label})")
        return Result(ex, "failed", f"differs from the reference ({case.label}): "
                      f"{_largest_difference(got, want)}")
    return Result(ex, "passed")


def which_mistake(ex: Exercise, case: Case, got: tuple, want: tuple) -> str | None:
    """The planted mistake the learner's output equals, else the pair of them it equals."""
    def made(variant) -> bool:
        try:
            planted = _tuple(ex.call(variant, _clone(case.args)))
        except RuntimeError:              # a mistake that cannot run on this case's shapes
            return False
        return not same(planted, want) and same(got, planted)

    for variant, diagnosis in ex.mistakes.values():
        if made(variant):
            return diagnosis
    for (first, second), variant in ex.pairs.items():
        if made(variant):
            return (f"two mistakes at once. First, {ex.mistakes[first][1]}. Second, "
                    f"{ex.mistakes[second][1]}")
    return None


def _largest_difference(got: tuple, want: tuple) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype == torch.bool:
            bad = (g != w).nonzero()
            if len(bad):
                return f"{len(bad)} entries differ, the first at index {tuple(bad[0].tolist())}"
            continue
        diff = (g - w).abs().nan_to_num(float("inf"))
        if diff.max() > ATOL:
            at = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape))
            which = f"output {i + 1} " if len(got) > 1 else ""
            return (f"{which}largest difference {diff.max().item():.3g} at index {at} "
                    f"(yours {g[at].item():.6g}, expected {w[at].item():.6g})")
    return "the outputs differ"


# --- the inputs ----------------------------------------------------------------------

def _rand(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rows_and_hidden(weights: torch.Tensor, visible) -> str | None:
    """Generic checks on attention weights: rows summing to 1, no weight where hidden."""
    if torch.isnan(weights).any():
        return ("the weights contain NaN: a row whose every score is -inf (a mask hiding "
                "every key), or an overflow in exp: subtract the row's max or use torch.softmax")
    if visible is not None and (weights.abs() * ~visible).max() > ATOL:
        return ("hidden keys get weight: fill their scores with -inf before the softmax, so "
                "exp(-inf) = 0 gives them exactly zero weight")
    if not torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-6):
        return ("the rows of the weights do not sum to 1: the softmax goes over the keys, the "
                "last axis, after the mask")
    return None


def attention_cases():
    q, k, v = _rand(1, 2, 3, 4, 16), _rand(2, 2, 3, 6, 16), _rand(3, 2, 3, 6, 8)
    return [Case("4 queries over 6 keys, no mask", (q, k, v)),
            Case("4 queries over 6 keys with a mask", (q, k, v, ref.causal_mask(4, 6)))]


def attention_generic(case, got, want, fn=None):
    out, weights = got
    visible = case.args[3] if len(case.args) > 3 else None
    rows = _rows_and_hidden(weights, visible)
    if rows:
        return rows
    if not torch.allclose(out, weights @ case.args[2], rtol=RTOL, atol=ATOL):
        return "the output is not weights @ V: it is the weighted sum of the values"
    return None


def causal_cases():
    return [Case("a whole sequence of 5 tokens", (5, 5)),
            Case("3 queries after 4 cached keys", (3, 7)),
            Case("one decoded token after 5 cached keys", (1, 6))]


def mask_generic(case, got, want, fn=None):
    mask, = got
    expected, = want
    if (mask & ~expected & _ahead(mask.shape)).any():
        return "weight on future keys: a key ahead of its query is visible"
    if (~mask & expected).any():
        return "a key the query may see is hidden"
    return None


def _ahead(shape) -> torch.Tensor:
    """True where the key is ahead of the query (queries at the end of the keys)."""
    q_len, k_len = shape
    return torch.arange(k_len)[None, :] > (torch.arange(q_len) + k_len - q_len)[:, None]


def multi_head_cases():
    C = 12
    w = [_rand(10 + i, C, C) / math.sqrt(C) for i in range(4)]
    w8 = [_rand(20 + i, 8, 8) / math.sqrt(8) for i in range(4)]
    return [Case("B=2, T=5, d_model=12, 3 heads", (_rand(4, 2, 5, C), *w, 3)),
            Case("B=1, T=4, d_model=8, 2 heads", (_rand(5, 1, 4, 8), *w8, 2))]


def multi_head_generic(case, got, want, fn):
    # Change the last token only: with the causal mask, no earlier output may move.
    x, *rest = case.args
    later = x.clone()
    later[:, -1] += 1.0
    try:
        moved = _tuple(fn(later, *_clone(tuple(rest))))[0]
    except Exception:
        return None
    if not torch.allclose(torch.as_tensor(moved)[:, :-1].to(torch.float64), got[0][:, :-1],
                          rtol=RTOL, atol=ATOL):
        return ("future tokens are visible: changing the last token changed earlier outputs; "
                "each head needs the causal mask")
    return None


def sinusoidal_cases():
    return [Case("T=6, d=8 from position 0", (6, 8)),
            Case("T=5, d=10 from position 7", (5, 10, 7))]


def sinusoidal_generic(case, got, want, fn=None):
    pe, = got
    if pe.abs().max() > 1 + 1e-9:
        return "values outside [-1, 1]: every entry is a sin or a cos of an angle"
    return None


def rope_cases():
    q, k = _rand(6, 2, 3, 5, 8), _rand(7, 2, 3, 5, 8)
    return [Case("positions 0..4", (q, k, torch.arange(5))),
            Case("positions 7..11 (a chunk after a cache)", (q, k, torch.arange(7, 12))),
            Case("positions 7..11, theta=500", (q, k, torch.arange(7, 12), 500.0))]


def rope_generic(case, got, want, fn=None):
    q, k = case.args[0], case.args[1]
    for name, before, after in (("queries", q, got[0]), ("keys", k, got[1])):
        if not torch.allclose(before.norm(dim=-1), after.norm(dim=-1), rtol=RTOL, atol=ATOL):
            return (f"the {name} changed length: RoPE is a rotation of each pair, which keeps "
                    "every vector's length (cos² + sin² = 1)")
    return None


def decode_cases():
    def step(seed, T_past, T_new):
        return (_rand(seed, 2, 2, T_new, 8), _rand(seed + 1, 2, 2, T_new, 8),
                _rand(seed + 2, 2, 2, T_new, 8), _rand(seed + 3, 2, 2, T_past, 8),
                _rand(seed + 4, 2, 2, T_past, 8))
    return [Case("one new token after 4 cached", step(30, 4, 1)),
            Case("a chunk of 3 new tokens after 3 cached", step(40, 3, 3))]


def decode_generic(case, got, want, fn=None):
    if not torch.allclose(got[0], want[0], rtol=RTOL, atol=ATOL):
        return ("the step disagrees with the full forward pass at its positions: the new "
                "queries attend over the cache and themselves, causally, as attention over "
                "the whole sequence would")
    return "the returned cache differs: the old keys and values, then the new ones"


def window_cases():
    return [Case("T=8, window 3", (8, 3)),
            Case("T=10, window 3, 2 global tokens", (10, 3, 2)),
            Case("T=5, window 1 (each token sees itself only)", (5, 1))]


def cross_cases():
    C = 6
    w = [_rand(50 + i, C, C) / math.sqrt(C) for i in range(4)]
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    return [Case("4 decoder queries over 4 encoder positions, no padding",
                 (_rand(7, 2, 4, C), _rand(6, 2, 4, C), torch.zeros(2, 4, dtype=torch.bool), *w)),
            Case("3 decoder queries over 5 encoder positions, the second input padded after 3",
                 (_rand(8, 2, 3, C), _rand(9, 2, 5, C), padding, *w))]


def cross_square_case():
    """As many decoder queries as encoder positions, the second input padded after 2: a
    padding mask laid along the queries broadcasts here instead of raising."""
    C = 6
    w = [_rand(50 + i, C, C) / math.sqrt(C) for i in range(4)]
    padding = torch.tensor([[False] * 4, [False, False, True, True]])
    return Case("4 decoder queries over 4 encoder positions, the second padded after 2",
                (_rand(10, 2, 4, C), _rand(11, 2, 4, C), padding, *w))


def cross_raised(case, err, fn):
    """A padding mask on the wrong axis fails to broadcast when the decoder and encoder
    lengths differ; on the square case it runs, and matching the planted variant there
    names the mistake."""
    if not isinstance(err, RuntimeError):
        return None
    square = cross_square_case()
    variant, diagnosis = ref.CROSS_MISTAKES["padding_queries"]
    want = _tuple(variant(*_clone(square.args)))
    got = _tuple(fn(*_clone(square.args)))
    got = tuple(torch.as_tensor(g).detach().to(torch.float64) for g in got)
    return diagnosis if same(got, want) else None


def cross_generic(case, got, want, fn=None):
    out, weights = got
    padding = case.args[2]
    if (weights.abs() * padding[:, None, :]).max() > ATOL:
        return "padding is visible to cross-attention: padded keys get weight"
    return _rows_and_hidden(weights, None)


def linear_cases():
    """q, k (B=2, H=2, T, d_k=8), v (d_v=6: S's two sides cannot be swapped unseen) and a
    starting state. The state four earlier tokens left comes first: from it, every
    planted mistake, the off-by-one's included, has a finite output to be matched by."""
    def tokens(seed, T):
        return _rand(seed, 2, 2, T, 8), _rand(seed + 1, 2, 2, T, 8), _rand(seed + 2, 2, 2, T, 6)
    empty = (torch.zeros(2, 2, 8, 6, dtype=torch.float64),          # S = 0
             torch.zeros(2, 2, 8, dtype=torch.float64))              # z = 0
    _, S, z = ref.linear_parallel(*tokens(60, 4), *empty)
    return [Case("5 tokens after the state 4 earlier tokens left", (*tokens(70, 5), S, z)),
            Case("6 tokens from the empty state (S = 0, z = 0)", (*tokens(80, 6), *empty))]


def linear_call(fn, args):
    """Drive the step over the case's tokens, as the model's recurrent form does, each
    call's return checked before the next token reads it."""
    return ref.over_tokens(_watched(fn), *args)


def _watched(fn):
    def step(q, k, v, S, z):
        before = (S.clone(), z.clone())
        got = fn(q, k, v, S, z)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            n = len(got) if isinstance(got, (tuple, list)) else 1
            raise Diagnosis(f"linear_attention_step returned {n} value(s), expected 3: the "
                            "output (B, H, d_v), the new S (B, H, d_k, d_v), the new z (B, H, d_k)")
        B, H, d_k, d_v = S.shape
        shapes = ((B, H, d_v), (B, H, d_k, d_v), (B, H, d_k))
        for name, value, shape, hint in zip(("the output", "the new S", "the new z"), got,
                                            shapes, LINEAR_HINTS):
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                found = (tuple(value.shape) if isinstance(value, torch.Tensor)
                         else type(value).__name__)
                raise Diagnosis(f"{name} of one step is {found}, expected {shape}: {hint}")
        if not (torch.equal(S, before[0]) and torch.equal(z, before[1])):
            raise Diagnosis("the step changed the S or z passed in, in place (S += ... or "
                            "S.add_()): training backpropagates through every earlier state, "
                            "which an in-place change overwrites; write S = S + ... and return "
                            "the new tensor")
        return tuple(got)
    return step


LINEAR_HINTS = ("one token's output, a weighted average of the values",
                "S adds φ(k)vᵀ, the keys' features by the values' (phi_k[..., :, None] * "
                "v[..., None, :])",
                "z adds φ(k), one number per key feature")


def linear_raised(case, err, fn):
    """d_k and d_v mixed up raises on the cases (d_k = 8, d_v = 6) and runs where they are
    equal: then the two sides of S are what the learner swapped."""
    if not isinstance(err, RuntimeError):
        return None
    q, k = _rand(90, 2, 2, 3, 8), _rand(91, 2, 2, 3, 8)
    square = (q, k, _rand(92, 2, 2, 3, 8), torch.zeros(2, 2, 8, 8, dtype=torch.float64),
              torch.zeros(2, 2, 8, dtype=torch.float64))
    linear_call(fn, square)
    return ("your step runs only when d_k = d_v: " + LINEAR_HINTS[1] + ", so S is (B, H, d_k, "
            "d_v), and φ(q)ᵀS reads it (phi_q[..., None, :] @ S)")


def linear_generic(case, got, want, fn=None):
    y, S, z = got
    if torch.isnan(y).any():
        return ("the output has NaN: 0/0, a normaliser φ(q)·z of 0; with φ(x) = elu(x) + 1 it "
                "is positive, once the token's own φ(k) is in z")
    if torch.allclose(y, want[0], rtol=RTOL, atol=ATOL):
        return ("the outputs are right but the last state is not: S = S_0 + Σ φ(k_j)v_jᵀ and "
                "z = z_0 + Σ φ(k_j), every token added once")
    return None


def sink_cases():
    """q, k, v float64 and one sink logit per head. The first case has as many queries as
    heads, so sinks laid along the queries run there (and are named) instead of raising."""
    def qkv(seed, B, H, Tq, Tk):
        return _rand(seed, B, H, Tq, 8), _rand(seed + 1, B, H, Tk, 8), _rand(seed + 2, B, H, Tk, 6)
    window = ref.window_mask(6, 2)
    return [Case("3 heads, 3 queries over 3 keys, causal",
                 (*qkv(100, 2, 3, 3, 3), _rand(103, 3), ref.causal_mask(3, 3))),
            Case("2 heads, 4 queries after 2 cached keys, causal",
                 (*qkv(110, 2, 2, 4, 6), _rand(113, 2), ref.causal_mask(4, 6))),
            Case("2 heads, 6 queries, a sliding window of 2",
                 (*qkv(120, 1, 2, 6, 6), _rand(123, 2), window)),
            Case("2 heads, 4 queries over 5 keys, no mask", (*qkv(130, 2, 2, 4, 5), _rand(133, 2)))]


def sink_raised(case, err, fn):
    """Sinks laid along the queries fail to broadcast when there are not as many queries
    as heads: on the first case they run, and matching the planted variant names it."""
    if not isinstance(err, RuntimeError):
        return None
    square = sink_cases()[0]
    variant, diagnosis = ref.SINK_MISTAKES["per_query"]
    want = _tuple(variant(*_clone(square.args)))
    got = _tuple(fn(*_clone(square.args)))
    got = tuple(torch.as_tensor(g).detach().to(torch.float64) for g in got)
    return diagnosis if same(got, want) else None


def sink_generic(case, got, want, fn=None):
    out, weights = got
    visible = case.args[4] if len(case.args) > 4 else None
    if torch.isnan(weights).any():
        return ("the weights contain NaN: an overflow in exp; put the sink's logit beside the "
                "scores as one more column and let torch.softmax take the row")
    if visible is not None and (weights.abs() * ~visible).max() > ATOL:
        return "hidden keys get weight: fill their scores with -inf before the softmax"
    if (weights.sum(-1) > 1 + 1e-6).any():
        return ("a row's weights over the keys sum to more than 1: exp(s_h) went above the "
                "line too (into the numerator); it belongs in the denominator only")
    if (weights.sum(-1) > 1 - 1e-9).any():
        return ("a row's weights over the keys sum to 1: the sink is missing from the "
                "denominator; it takes a share of every row, so the keys' weights sum to less")
    if not torch.allclose(out, weights @ case.args[2], rtol=RTOL, atol=ATOL):
        return "the output is not weights @ V: the weighted sum of the values (the sink has none)"
    return None


def _experts(seed, n, C, hidden=5):
    """n small expert functions, (N, C) -> (N, C), each its own tanh MLP in float64."""
    def expert(w_in, w_out):
        return lambda x: torch.tanh(x @ w_in) @ w_out
    return [expert(_rand(seed + 2 * i, C, hidden), _rand(seed + 2 * i + 1, hidden, C))
            for i in range(n)]


def moe_cases():
    """Tokens, router logits, routed and shared experts, and k. The last case routes to 3,
    so a layer that always takes 2 shows."""
    return [Case("7 tokens, 4 experts, top 2, 1 shared expert",
                 (_rand(140, 7, 6), _rand(141, 7, 4), _experts(150, 4, 6), _experts(160, 1, 6), 2)),
            Case("6 tokens, 5 experts, top 2, no shared expert",
                 (_rand(142, 6, 6), _rand(143, 6, 5), _experts(170, 5, 6), [], 2)),
            Case("5 tokens, 6 experts, top 3, 2 shared experts",
                 (_rand(144, 5, 6), _rand(145, 5, 6), _experts(180, 6, 6), _experts(195, 2, 6), 3))]


def gate_cases():
    """The layer's input, the heads' outputs, W_G and W_O (not symmetric, so a transposed
    matrix shows)."""
    def case(seed, B, T, C):
        return (_rand(seed, B, T, C), _rand(seed + 1, B, T, C), _rand(seed + 2, C, C) / math.sqrt(C),
                _rand(seed + 3, C, C) / math.sqrt(C))
    return [Case("B=2, T=4, d_model=6", case(200, 2, 4, 6)),
            Case("B=1, T=5, d_model=8", case(210, 1, 5, 8))]


CACHE_HINT = ("the cache returned holds the T_past old keys (or values) and then the "
              "T_new new ones, appended along the positions axis (dim=-2)")

EXERCISES = [
    Exercise(1, "attention", "scaled dot-product attention", "scaled_dot_product_attention",
             "§2-4: scores, softmax, the weighted sum of values",
             "model/attention.py:eager_attention", attention_cases, ref.attention,
             ref.ATTENTION_MISTAKES, attention_generic, trains="--model.attention=yours"),
    Exercise(2, "causal_mask", "the causal mask", "causal_mask", "§5: the causal mask",
             "model/attention.py:rule", causal_cases, ref.causal_mask, ref.CAUSAL_MISTAKES,
             mask_generic, as_mask=True),
    Exercise(3, "multi_head", "multi-head attention", "multi_head_attention",
             "§6: multi-head attention and W_O",
             "model/attention.py:MultiHeadAttention.forward", multi_head_cases, ref.multi_head,
             ref.MULTI_HEAD_MISTAKES, multi_head_generic),
    Exercise(4, "sinusoidal", "sinusoidal positions", "sinusoidal_positions",
             "§7: positions", "model/positions.py:Sinusoidal", sinusoidal_cases,
             ref.sinusoidal, ref.SINUSOIDAL_MISTAKES, sinusoidal_generic,
             trains="--model.position=yours"),
    Exercise(5, "rope", "RoPE", "apply_rope", "§7: positions",
             "model/positions.py:RoPE.rotate", rope_cases, ref.rope, ref.ROPE_MISTAKES,
             rope_generic, trains="--model.position=yours"),
    Exercise(6, "kv_cache", "a KV-cache decode step", "decode_step",
             "§8: the KV cache", "model/cache.py:KVCache.update", decode_cases,
             ref.decode, ref.DECODE_MISTAKES, decode_generic,
             shape_hints=("", CACHE_HINT, CACHE_HINT)),
    Exercise(7, "window", "a sliding window with global tokens", "window_mask",
             "§8: a sliding window, local + global", "model/attention.py:rule",
             window_cases, ref.window_mask, ref.WINDOW_MISTAKES,
             mask_generic, as_mask=True),
    Exercise(8, "cross_attention", "cross-attention with a padding mask", "cross_attention",
             "§10: self, masked self and cross-attention",
             "model/attention.py:CrossAttention.forward", cross_cases, ref.cross,
             ref.CROSS_MISTAKES, cross_generic, raised=cross_raised,
             shape_hints=("the queries come from the decoder (x), one per decoder position",
                          "one weight per decoder query and encoder position: the keys and "
                          "values come from the encoder's output (memory)")),
    Exercise(9, "linear_rnn", "linear attention as an RNN", "linear_attention_step",
             "§8: the cost of attention, and what the field does about it",
             "model/linear_attention.py:recurrent", linear_cases, ref.linear_parallel,
             ref.LINEAR_MISTAKES, linear_generic, trains="--model.mechanism=yours",
             raised=linear_raised, call=linear_call, pairs=ref.LINEAR_PAIRS),
    Exercise(10, "sinks", "a learned attention sink (gpt-oss)", "sink_attention",
             "\"Sigmoid, gated and sink attention\"",
             "model/sink_attention.py:SinkAttention.attend",
             sink_cases, ref.sink_attention, ref.SINK_MISTAKES, sink_generic,
             trains="--model.mechanism=yours_sinks", raised=sink_raised,
             shape_hints=("", "one weight per key: the sink's column is dropped after the "
                              "softmax (it has no value to hand on)"),
             doc="docs/after_the_article.md", preset="gpt-oss"),
    Exercise(11, "top_k_routing", "top-k routing of a mixture of experts (gpt-oss)", "moe_layer",
             "\"Beyond attention: a mixture of experts in the MLP\"",
             "model/moe.py:MixtureOfExperts.forward", moe_cases, ref.moe, ref.MOE_MISTAKES,
             trains="--model.mlp=yours", shape_hints=("one row per token, (N, C)",),
             doc="docs/after_the_article.md", preset="gpt-oss"),
    Exercise(12, "gate", "the output gate of gated attention (Qwen3-Next)", "gated_output",
             "\"Sigmoid, gated and sink attention\"", "model/gated_attention.py:GatedAttention.output",
             gate_cases, ref.gated_output, ref.GATE_MISTAKES,
             trains="--model.mechanism=gated_deltanet,gated_deltanet,gated_deltanet,yours_gated",
             doc="docs/after_the_article.md", preset="qwen3-next"),
]

BY_NAME = {ex.name: ex for ex in EXERCISES}


def find(name: str) -> Exercise | None:
    """An exercise by name, number (3) or file name (03_multi_head.py)."""
    key = name.removesuffix(".py")
    if key.isdigit():
        return next((ex for ex in EXERCISES if ex.number == int(key)), None)
    return BY_NAME.get(key) or next((ex for ex in EXERCISES if ex.filename[:-3] == key), None)
