"""Streaming past the context: a model trained with full attention reads a text many
times longer than its context, three ways, scoring every token (teacher forcing through
GPT.generate's `forced`, the same decoding code sample.py runs).

The three ways:
  re-prefill  the default: when the context fills, drop the oldest half and re-read the
              rest in one pass (positions restart), so each token sees T/2 to T tokens;
  window      a rolling cache of the newest W tokens alone, renumbered as it rolls;
  sinks       the same window plus the first few tokens kept for ever as attention
              sinks (StreamingLLM, arXiv:2309.17453; sample.py --sample.sinks=N).

Perplexity against position (in bins) and tokens/s for each, a figure and a table.

    python bench/streaming.py --run runs/NAME --factor 16 --out docs/figures
    python bench/streaming.py --run path/to/gpt2-folder --factor 8
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def methods(block_size: int, sinks: int, window: int):
    """(label, generate keyword arguments)."""
    return [("re-prefill newest half", {}),
            (f"window {window}", {"sinks": 0, "stream_window": window}),
            (f"window {window} + {sinks} sinks", {"sinks": sinks, "stream_window": window})]


@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, float]:
    """Per-token negative log-likelihood of ids[1:] given everything before it (as the
    method keeps it), and tokens per second."""
    nll = []

    def score(logits, token):
        nll.append(-torch.log_softmax(logits.float(), -1)[0, token[0, 0]])
    start = time.perf_counter()
    for _ in model.generate(ids[:, :1], 0, forced=ids[:, 1:], on_step=score, **kw):
        pass
    seconds = time.perf_counter() - start
    return torch.stack(nll).cpu(), (ids.shape[1] - 1) / seconds


def main(argv=None) -> int:
    from engine.cli import errors_as_lines
    with errors_as_lines():
        return run(argv)


def run(argv=None) -> int:
    from attnlab.plotting import pyplot, save_figure
    from common.errors import ConfigError
    from common.files import writable_folder
    from engine.cli import Parser
    from engine.inference import load_run
    p = Parser("python bench/streaming.py", __doc__)
    p.add_argument("--run", required=True, help="run directory, checkpoint or transformers folder")
    p.add_argument("--factor", type=int, default=16, help="text length as a multiple of the "
                   "context, at least 3 (the table reports the text past 2x the context)")
    p.add_argument("--sinks", type=int, default=4, help="first tokens kept as sinks")
    p.add_argument("--window", type=int, default=None, help="rolling window, at least 1 "
                   "(default: (T - sinks) / 2)")
    p.add_argument("--bins", type=int, default=32, help="position bins in the figure")
    p.add_argument("--out", default="runs/streaming", help="folder for streaming.png and .md")
    args = p.parse_args(argv)
    if args.factor < 3 or args.bins < 1 or args.sinks < 0 or (args.window is not None and args.window < 1):
        raise ConfigError("--factor must be at least 3 (the table scores the text past 2x the "
                          "context), --bins and --window at least 1, --sinks not negative")
    # Checked before the scoring, so a bad --out cannot throw the measurements away.
    out = writable_folder(args.out)
    torch.set_num_threads(1)
    model, cfg, tokenizer, ckpt = load_run(args.run, "best")
    T = cfg.model.block_size
    if args.sinks + 2 > T:
        # No window is left beside them: the sinks alone must leave room for one.
        raise ConfigError(f"--sinks {args.sinks} leaves no room for a window in the context of "
                          f"{T}: give --sinks at most {T - 2}")
    window = (T - args.sinks) // 2 if args.window is None else args.window
    if args.sinks + 2 * window > T:
        # The rolling cache holds sinks + 2·window positions; more than T would ask the
        # model for positions (and distances) it was never trained on.
        raise ConfigError(f"--sinks {args.sinks} and --window {window} need sinks + 2·window "
                          f"between 2 and the context of {T}: give --window at most "
                          f"{max(1, (T - args.sinks) // 2)} (or fewer sinks)")
    from attnlab.recall_task import filler_text
    text = filler_text(60 * args.factor * T)[-40 * args.factor * T:]     # from late in the plays
    ids = torch.tensor([tokenizer.encode(text)[:args.factor * T + 1]])
    print(f"{ckpt}: context {T}, {cfg.model.position} positions; scoring {ids.shape[1] - 1} "
          f"tokens ({args.factor}x the context)")
    results = {}
    for label, kw in methods(T, args.sinks, window):
        nll, tok_s = stream_nll(model, ids, **kw)
        results[label] = (nll, tok_s)
        late = nll[2 * T:].mean().item()
        print(f"  {label:<26} perplexity {math.exp(nll.mean()):8.2f} overall, "
              f"{math.exp(late):8.2f} past 2x the context; {tok_s:7.0f} tokens/s")
    lines = [f"Streaming {ids.shape[1] - 1} tokens ({args.factor}x a context of {T}) through {ckpt}.",
             "", "| method | perplexity, first context | past 2x the context | tokens/s |",
             "|---|---|---|---|"]
    for label, (nll, tok_s) in results.items():
        lines.append(f"| {label} | {math.exp(nll[:T].mean()):.2f} | "
                     f"{math.exp(nll[2 * T:].mean()):.2f} | {tok_s:.0f} |")
    (out / "streaming.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    n = len(next(iter(results.values()))[0])
    edges = torch.linspace(0, n, args.bins + 1).long()
    for label, (nll, tok_s) in results.items():
        xs = [(a + b).item() / 2 for a, b in zip(edges[:-1], edges[1:])]
        ys = [math.exp(nll[a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]
        ax.plot(xs, ys, marker=".", label=f"{label} ({tok_s:.0f} tokens/s)")
    for k in range(1, args.factor):
        ax.axvline(k * T, color="grey", alpha=0.15)
    ax.set_yscale("log")
    ax.set_xlabel(f"position in the text (tokens; grey lines every context of {T})")
    ax.set_ylabel(f"perplexity (mean over bins of {n // args.bins} tokens)")
    ax.set_title("Decoding past the trained context: re-prefill, rolling window, window + sinks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    print(save_figure(fig, out / "streaming.png"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
