"""Loss, perplexity and bits per byte of a model over a whole text.

    python -m attnlab.evaluate --run runs/NAME --data notes.txt
    python -m attnlab.evaluate --run ./gpt2 --data notes.txt --stride 512
    python -m attnlab.evaluate --run runs/NAME --data notes.txt --compare exported/NAME

The text is read with a sliding window of the model's context (block_size tokens)
moved `--stride` tokens at a time (half the context by default). Each token is scored
once, in the first window where it is new, so every token after the first window is
predicted from at least block_size - stride tokens of context: a smaller stride is
closer to a model that could read the whole text at once, and slower. The first
token has nothing before it and is not scored.

`--compare DIR` scores the same tokens with the same windows through `transformers`
(a folder written by python -m attnlab.export), as an independent check.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from common.errors import AttnlabError
from common.shell import word
from attnlab.options import add_run_options, load
from engine.cli import Parser, errors_as_lines


def windows(n_tokens: int, context: int, stride: int):
    """(start, end, first) of each window: inputs ids[start:end-1] predict targets
    ids[start+1:end], and the targets at positions >= first are new in this window."""
    start, first = 0, 1
    while True:
        end = min(start + context + 1, n_tokens)
        yield start, end, first
        if end >= n_tokens:
            return
        start, first = start + stride, end


@torch.no_grad()
def sliding_loss(logits_fn, ids: list[int], context: int, stride: int, progress: bool = True):
    """(sum of -log p(token | what came before) in nats, tokens scored)."""
    total, count = 0.0, 0
    spans = list(windows(len(ids), context, stride))
    for start, end, first in tqdm(spans, desc="evaluate", unit="window", disable=not progress):
        x = torch.tensor([ids[start:end - 1]])
        y = torch.tensor(ids[start + 1:end])
        logp = torch.log_softmax(logits_fn(x)[0].double(), dim=-1)
        keep = slice(first - 1 - start, None)          # targets new in this window
        total -= logp[keep].gather(1, y[keep, None]).sum().item()
        count += len(y[keep])
    return total, count


def report(nats: float, tokens: int, n_bytes: int) -> dict:
    loss = nats / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)), "tokens": tokens,
            "bits_per_byte": nats / math.log(2) / max(n_bytes, 1)}


def load_for_comparison(folder: Path, tokenizer):
    """transformers' own model from a local folder, checked as attnlab reads one first
    (engine/hf_files.py), loaded from safetensors only."""
    from engine.checkpoint import CKPT_DIR
    from engine.interop import is_hf_folder, open_hf_folder
    if not folder.exists():
        raise AttnlabError(f"--compare {folder} does not exist; give a transformers folder "
                           "(python -m attnlab.export writes one)")
    if not is_hf_folder(folder):
        own = (folder / "state.json").is_file() or (folder / CKPT_DIR).is_dir()
        raise AttnlabError(f"--compare {folder} is not a transformers folder" + (
            f" but attnlab's own run or checkpoint: export it with python -m attnlab.export "
            f"--run {word(folder)} --out DIR, then compare with DIR" if own else
            " (it has no config.json of one); give a folder written by python -m attnlab.export"))
    checked = open_hf_folder(folder)
    if checked.cfg.vocab_size <= tokenizer.highest_id:
        raise AttnlabError(f"--compare {folder} has a vocabulary of {checked.cfg.vocab_size:,} "
                           f"tokens, fewer than the --run model's tokenizer uses: it is not "
                           "the same model's export")
    import transformers
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, use_safetensors=True).eval()
    except (OSError, ValueError) as err:
        raise AttnlabError(f"transformers cannot load --compare {folder} "
                           f"({str(err).splitlines()[0][:300]})") from None


# Bytes of text scored at most (after gunzip): a gzip that unpacks without end is refused.
MAX_TEXT_BYTES = 1 << 28


def read_text(path: Path) -> tuple[str, Path]:
    """The text of --data, gunzipped where it ends in .gz, as train.py reads a corpus file
    (data.sources.reading: plain files only, one error line for a damaged gzip)."""
    from data.sources import reading
    if not path.is_file():
        raise AttnlabError(f"--data {path} is not a file; give a UTF-8 text file (.gz allowed)")
    with reading(path) as f:
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise AttnlabError(f"--data {path} holds more than {MAX_TEXT_BYTES >> 20:,} MiB of text; "
                           "score a part of it")
    try:
        return data.decode("utf-8"), path
    except UnicodeDecodeError as err:
        raise AttnlabError(f"--data {path} is not UTF-8 text ({err})") from None


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.evaluate", __doc__)
    add_run_options(parser)
    parser.add_argument("--data", required=True, help="a UTF-8 text file to score (.gz "
                        "allowed, as train.py's data.path: data/shakespeare/plays.txt.gz)")
    parser.add_argument("--stride", type=int, default=0,
                        help="tokens the window moves each time (default: half the context)")
    parser.add_argument("--compare", default="", help="a transformers folder to score the same way")
    args = parser.parse_args(argv)
    from engine.device import pick_device
    text, path = read_text(Path(args.data))
    device = pick_device(args.device)
    model, cfg, tokenizer, ckpt = load(args)
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise AttnlabError(f"--data {path} holds fewer than two tokens; nothing to score")
    context = cfg.model.block_size
    stride = args.stride or max(1, context // 2)
    if not 0 < stride <= context:
        raise AttnlabError(f"--stride must be between 1 and the context ({context}), got {stride}")
    hf = load_for_comparison(Path(args.compare), tokenizer) if args.compare else None
    n_bytes = len(text.encode("utf-8"))
    ours = report(*sliding_loss(lambda x: model(x.to(device)).logits, ids, context, stride), n_bytes)
    print(f"{ckpt}: {ours['tokens']:,} tokens scored, windows of {context} moved by {stride}")
    rows = [("attnlab", ours)]
    if hf is not None:
        rows.append(("transformers", report(*sliding_loss(lambda x: hf(x).logits, ids, context,
                                                          stride), n_bytes)))
    print(f"{'model':<13} {'loss':>8} {'perplexity':>11} {'bits/byte':>10}")
    for name, r in rows:
        print(f"{name:<13} {r['loss']:8.4f} {r['perplexity']:11.3f} {r['bits_per_byte']:10.4f}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
