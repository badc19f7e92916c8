"""Open the exported bertviz head view in a real headless browser and check that it
draws: the page's DOM after its scripts ran must hold the SVG that bertviz builds,
with one text element per token on each side.

    python bench/bertviz_check.py [--run runs/NAME] [--text "..."]

Needs Debian's chromium (`apt-get install chromium`) and npm (to fetch d3, jQuery
and RequireJS once, so the page carries its own copies and opens offline).
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
OUT = Path(__file__).resolve().parent / "out"
LIBS = {"d3@5.7.0": ("package/dist/d3.min.js", "d3.min.js"),
        "jquery@2.2.4": ("package/dist/jquery.min.js", "jquery.min.js"),
        "requirejs@2.3.6": ("package/require.js", "require.js")}


def fetch_libs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for spec, (member, name) in LIBS.items():
        if (folder / name).is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["npm", "pack", spec, "--silent"], cwd=tmp, check=True,
                           capture_output=True)
            tarball = next(Path(tmp).glob("*.tgz"))
            with tarfile.open(tarball) as tar:
                (folder / name).write_bytes(tar.extractfile(member).read())
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="", help="a trained run (default: an untrained tiny model)")
    parser.add_argument("--text", default="The trophy did not fit because it was big",
                        help="the sentence whose head view is drawn")
    args = parser.parse_args()
    import torch
    from attnlab.capture import attention_maps
    from attnlab.heads import export_head_view
    if args.run:
        from engine.inference import load_run
        model, _, tokenizer, _ = load_run(args.run)
    else:
        from data.tokenizer import CharTokenizer
        from model import GPT, ModelConfig
        torch.manual_seed(0)
        tokenizer = CharTokenizer(set(args.text))
        model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4,
                                n_embd=32, block_size=64)).eval()
    tokens, maps = attention_maps(model, tokenizer, args.text)
    html = export_head_view(OUT / "head_view.html", tokens, maps, fetch_libs(OUT / "js"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not browser:
        raise SystemExit("no chromium found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
        dom = subprocess.run(flags + ["--dump-dom", html.as_uri()], capture_output=True,
                             text=True, timeout=120).stdout
        subprocess.run(flags + ["--window-size=900,900", f"--screenshot={OUT / 'head_view.png'}",
                                html.as_uri()], capture_output=True, timeout=120)
    svgs = len(re.findall(r"<svg", dom))
    texts = len(re.findall(r"<text", dom))
    print(f"{html}: {html.stat().st_size:,} bytes; after the scripts ran the page holds "
          f"{svgs} svg element(s) and {texts} text element(s) for {len(tokens)} tokens")
    ok = svgs >= 1 and texts >= 2 * len(tokens)
    print(f"screenshot: {OUT / 'head_view.png'}")
    print("PASS: the head view rendered in headless Chromium" if ok else "FAIL: nothing was drawn")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
