"""What each model-card piece adds, read from one text, as numbers a learner can check:
a learned sink's share of each row (gpt-oss), each head's gate openness (Qwen3-Next), the
lightning indexer's chosen keys against full attention (DeepSeek-V3.2). `python -m
attnlab.heads sinks | gates | chosen` print them, the page shows them for the token
clicked, and `python -m attnlab.experts` prints each token's experts. Every number comes
from attnlab/capture.py's record of the forward pass (blocks.l.sink, .gate, .chosen,
.full_pattern, .experts). What a view cannot show of a piece, and why, is said in
docs/looking_inside.md."""
from __future__ import annotations

import textwrap

import torch

from attnlab.capture import check_context, pieces_of, run_with_cache
from attnlab.plotting import NUMBERING, draw_weights, label_tokens, pyplot, save_figure, weight_scale
from common.errors import AttnlabError

# view -> (the capture names it reads, what it is called, how to train a model that has it)
VIEWS = {
    "sinks": (("sink", "pattern"), "learned attention sinks",
              "--model.mechanism=sinks (or --config gpt-oss)"),
    "gates": (("gate",), "attention gates", "--model.mechanism=gated (or --config qwen3-next)"),
    "chosen": (("chosen", "full_pattern", "index"), "lightning indexer (sparse attention)",
               "--model.mechanism=sparse (or --config deepseek-v3.2)"),
}


def layers_with(model, view: str) -> list[int]:
    """The layers that have the piece `view` shows; refused in one line where none has."""
    first, what, train = VIEWS[view][0][0], VIEWS[view][1], VIEWS[view][2]
    found = [l for l in range(model.config.n_layer) if first in pieces_of(model, l)]
    if not found:
        raise AttnlabError(f"this model (model.mechanism={model.config.mechanism}) has no "
                           f"{what}; heads {view} looks at a model trained with {train}")
    return found


def read(model, tokenizer, text: str, view: str):
    """(token strings, {layer: {name: the text's activation, batch dropped}}) for the
    layers that have the piece `view` shows."""
    layers = layers_with(model, view)
    if not text:
        raise AttnlabError("give some text to look at with --text")
    ids = tokenizer.encode(text)
    check_context(model, len(ids))
    names = VIEWS[view][0]
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    _, cache = run_with_cache(model, idx, only=[f"blocks.{l}.{n}" for l in layers for n in names])
    as_read = lambda t: (t.float() if t.is_floating_point() else t).cpu()   # chosen stays bool
    return tokenizer.token_strings(ids), {l: {n: as_read(cache[f"blocks.{l}.{n}"][0]) for n in names}
                                          for l in layers}


def shown(token: str) -> str:
    return repr(token)[1:-1][:8]


def per_token(tokens, rows: torch.Tensor, fmt: str = "{:7.3f}") -> list[str]:
    """One line per token: its number in each head (rows: (T, H))."""
    H = rows.shape[1]
    lines = [f"{'t':>4} {'token':>8}  " + " ".join(f"{'head ' + str(h):>7}" for h in range(H))]
    for t, token in enumerate(tokens):
        lines.append(f"{t:>4} {shown(token):>8}  " + " ".join(fmt.format(v) for v in rows[t].tolist()))
    return lines


def sink_lines(tokens, reads, layer: int | None) -> list[str]:
    """Each head's sink share over the text's queries (mean, least, most) beside the weight
    its keys give the first token (the sink StreamingLLM found), then each token's share
    in `layer` (default: the layer whose sink takes most)."""
    lines = ["the sink's share of each query's row: the weight no key gets (1 - the row's sum); "
             "layers and heads from 0",
             f"{'layer':>5} {'head':>4} {'mean':>6} {'least':>6} {'most':>6} {'on token 0':>10}"]
    for l, r in reads.items():
        sink, pattern = r["sink"], r["pattern"]                      # (H, T), (H, T, T)
        first = pattern[:, 1:, 0].mean(-1) if pattern.shape[1] > 1 else pattern[:, 0, 0]
        for h in range(sink.shape[0]):
            lines.append(f"{l:>5} {h:>4} {sink[h].mean():6.3f} {sink[h].min():6.3f} "
                         f"{sink[h].max():6.3f} {first[h]:10.3f}")
    layer = pick_layer(reads, layer, lambda r: r["sink"].mean())
    lines += ["", f"each token's sink share, layer {layer} (--layer picks another):"]
    return lines + per_token(tokens, reads[layer]["sink"].T)


def gate_lines(tokens, reads, layer: int | None) -> list[str]:
    """Each head's gate openness over the text (mean, least, most), then each token's in
    `layer` (default: the layer whose gates are most shut)."""
    lines = ["each head's gate openness: the mean of σ(x·W_G) over its channels (1: its output "
             "passes whole, 0: shut); layers and heads from 0",
             f"{'layer':>5} {'head':>4} {'mean':>6} {'least':>6} {'most':>6}"]
    for l, r in reads.items():
        gate = r["gate"]                                             # (T, H)
        for h in range(gate.shape[1]):
            lines.append(f"{l:>5} {h:>4} {gate[:, h].mean():6.3f} {gate[:, h].min():6.3f} "
                         f"{gate[:, h].max():6.3f}")
    layer = pick_layer(reads, layer, lambda r: -r["gate"].mean())
    lines += ["", f"each token's gate openness, layer {layer} (--layer picks another):"]
    return lines + per_token(tokens, reads[layer]["gate"])


def chosen_numbers(r) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one layer: full attention's weight on the chosen keys (H, T); how many of full
    attention's k heaviest keys were chosen (H, T); k, each query's count of chosen keys
    (T); and how many keys each query sees (T)."""
    chosen, full = r["chosen"], r["full_pattern"]                    # (T, T), (H, T, T)
    k, sees = chosen.sum(-1), r["index"].isfinite().sum(-1)          # hidden keys score -inf
    share = (full * chosen).sum(-1)
    ranked = full.argsort(dim=-1, descending=True, stable=True)
    heaviest = torch.arange(full.shape[-1]) < k[:, None]             # the first k of each row
    overlap = (chosen.expand_as(full).gather(-1, ranked) & heaviest).sum(-1)
    return share, overlap, k, sees


def chosen_lines(tokens, reads, layer: int | None, top_k: int) -> list[str]:
    """Per head, the share of full attention's weight on the keys the indexer chose and how
    many of full attention's k heaviest keys it chose, over the queries that see more than
    k keys (with fewer, every key is chosen); then each token in `layer` (default: the
    layer where the choice misses most)."""
    T = len(tokens)
    lines = [f"the indexer's k = {top_k} keys against full attention (the softmax over every "
             "visible key that the same q and k give); layers and heads from 0"]
    some = {l: chosen_numbers(r) for l, r in reads.items()}
    lines.append(f"{'layer':>5} {'head':>4} {'full attention on the chosen':>29} "
                 f"{'its k heaviest among them':>26}  (over the queries that see more than k keys)")
    for l, (share, overlap, k, sees) in some.items():
        picking = sees > k
        if not picking.any():
            lines.append(f"{l:>5}    - every query of this {T}-token text sees at most k = {top_k} "
                         "keys and reads all it sees: give a longer --text to watch the indexer choose")
            continue
        for h in range(share.shape[0]):
            lines.append(f"{l:>5} {h:>4} {share[h][picking].mean():29.3f} "
                         f"{(overlap[h][picking].float() / k[picking]).mean():25.1%}")
    layer = pick_layer(reads, layer, lambda r: -chosen_numbers(r)[0].mean())
    share, _, k, sees = some[layer]
    full = reads[layer]["full_pattern"].mean(0)                      # (T, T) over heads
    missed = (full * ~reads[layer]["chosen"]).max(-1)
    lines += ["", f"each token, layer {layer} (--layer picks another; means over the heads):",
              f"{'t':>4} {'token':>8} {'sees':>5} {'chosen':>6} {'full on chosen':>14}  heaviest key missed"]
    for t, token in enumerate(tokens):
        m = int(missed.indices[t])
        miss = f"{m} {shown(tokens[m])!r} {float(missed.values[t]):.3f}" if missed.values[t] > 0 else "-"
        lines.append(f"{t:>4} {shown(token):>8} {int(sees[t]):5d} {int(k[t]):6d} "
                     f"{share[:, t].mean():14.3f}  {miss}")
    return lines


def save_chosen(path, tokens, reads, layer: int):
    """Layer `layer`'s full attention, one panel a head, with a dot on each key the
    indexer chose for each query: where the dots miss the bright cells, the sparse layer
    reads keys full attention would not have weighed, and drops ones it would."""
    plt = pyplot()
    full, chosen = reads[layer]["full_pattern"], reads[layer]["chosen"]
    H = full.shape[0]
    fig, axes = plt.subplots(1, H, figsize=(4.2 * H + 1.2, 4.6), squeeze=False, layout="constrained")
    rows, cols = chosen.nonzero(as_tuple=True)
    for h, ax in enumerate(axes[0]):
        image = draw_weights(ax, full[h], f"layer {layer}, head {h}")
        ax.scatter(cols.numpy(), rows.numpy(), s=6, c="#d94801", marker="o", label="chosen by the indexer")
        label_tokens(ax, tokens, fontsize=6)
        if h:
            ax.tick_params(labelleft=False)
    fig.suptitle(textwrap.fill(f"full attention (the softmax over every visible key); dots: the "
                               f"keys the indexer chose, the only ones layer {layer} reads. "
                               f"{NUMBERING}", 45 * H), fontsize=9)
    fig.supxlabel("token looked at (key)")
    fig.supylabel("token looking (query)")
    weight_scale(fig, image, axes.ravel().tolist(), "full attention's weight")
    return save_figure(fig, path, dpi=100)


def pick_layer(reads, layer: int | None, score) -> int:
    """`layer` if it has the piece (refused in one line if not), else the layer `score`
    ranks first."""
    if layer is None:
        return max(reads, key=lambda l: float(score(reads[l])))
    if layer not in reads:
        raise AttnlabError(f"--layer {layer}: the layers with this piece are "
                           f"{', '.join(map(str, reads))}")
    return layer


def at_query(cache: dict, model, query: int, keys: int) -> list[dict | None]:
    """What each layer's pieces did for one query (the page's clicked token): per layer a
    dict with "sink" (each head's share), "gate" (each head's openness), "chosen" (the
    key slots chosen, among the last `keys`) and "full_on_chosen" (each head's full
    attention on them), "experts" ([expert, weight], heaviest first); None for a layer
    with no piece."""
    out = []
    for l in range(model.config.n_layer):
        p, has, got = f"blocks.{l}.", pieces_of(model, l), {}
        if "sink" in has and p + "sink" in cache:
            got["sink"] = [round(float(v), 4) for v in cache[p + "sink"][0, :, query]]
        if "gate" in has:
            got["gate"] = [round(float(v), 4) for v in cache[p + "gate"][0, query]]
        if "chosen" in has:
            chosen = cache[p + "chosen"][0, query, -keys:]
            got["chosen"] = chosen.nonzero()[:, 0].tolist()
            full = cache[p + "full_pattern"][0, :, query, -keys:]
            got["full_on_chosen"] = [round(float(v), 4) for v in (full * chosen).sum(-1)]
        if "experts" in has:
            got["experts"] = [[int(e), round(float(w), 4)] for e, w in
                              zip(cache[p + "experts"][0, query], cache[p + "expert_weights"][0, query])]
        out.append(got or None)
    return out
