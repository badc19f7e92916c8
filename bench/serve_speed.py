"""The local page's speed against sample.py's, on the same run, in one sitting.

    python bench/serve_speed.py --run runs/NAME [--screenshot docs/figures/serve.png]

Starts python -m attnlab.serve on a free loopback port and measures, over HTTP as the
page receives them: the time from sending the request to the first token's event
(five requests), and tokens per second over a 500-token stream. The peer is sample.py's
own generation loop (engine.inference.stream_text, the same weights, dtype, settings and
seed) timed in this process. With --screenshot it also opens the page in headless
Chromium, generates 60 tokens after "ROMEO:", clicks the 30th and saves the page.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = {"prompt": "ROMEO:", "temperature": "0.8", "top_k": "200", "top_p": "1.0", "seed": "1337"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(port: int, n: int) -> tuple[float, float, int]:
    """(seconds to the first token event, seconds for all, tokens) of one request."""
    query = urllib.parse.urlencode({**SETTINGS, "max_new_tokens": n})
    start = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/generate?{query}") as response:
        while chunk := response.read1(1 << 16):       # as it arrives, counted, not parsed
            tokens += chunk.count(b'"token": ')
            if tokens and first is None:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start, tokens


def sample_rate(run: str, n: int) -> float:
    import torch
    from engine.device import pick_device, pick_dtype
    from engine.inference import encode_prompt, load_run, stream_text
    torch.set_num_threads(os.cpu_count() or 1)
    device = pick_device("auto")
    model, cfg, tok, _ = load_run(run, "best", device)
    model = model.to(pick_dtype(cfg.sample.dtype, device, cfg.model.n_embd, decoding=True))
    ids = encode_prompt(tok, SETTINGS["prompt"])
    start = time.perf_counter()
    list(stream_text(model, tok, ids, n, 0.8, 200, 1.0, 1337))
    return n / (time.perf_counter() - start)


def screenshot(port: int, path: str) -> None:
    import shutil
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "attention" in d.find_element(By.ID, "config").text)
        driver.execute_script("const s = document.getElementById('max_new_tokens');"
                              "s.value = 60; s.dispatchEvent(new Event('input'));")
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "done" in d.find_element(By.ID, "status").text)
        driver.find_elements(By.CSS_SELECTOR, ".output .tok")[29].click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#grid canvas.head"))
        time.sleep(0.5)
        driver.save_screenshot(path)
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="", help="run directory (default: the latest run)")
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--screenshot", default="")
    args = parser.parse_args()
    from engine.checkpoint import latest_run
    run = args.run or str(latest_run())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", run, "--port", str(port),
                               "--device", "auto"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(100):
            try:
                json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info").read())
                break
            except OSError:
                time.sleep(0.2)
        stream(port, 5)                                           # warm-up
        firsts = sorted(stream(port, 1)[0] for _ in range(5))
        _, total, tokens = stream(port, args.tokens)
        served = tokens / total
        if args.screenshot:
            screenshot(port, args.screenshot)
    finally:
        server.terminate()
        server.wait()
    direct = sample_rate(run, args.tokens)
    print(f"run: {run}")
    print("| measure | attnlab.serve (HTTP, as the page gets it) | sample.py's loop | ratio |")
    print("|---|---|---|---|")
    print(f"| first token after the request (median of 5) | {firsts[2] * 1000:.0f} ms | - | - |")
    print(f"| tokens/s over {args.tokens} tokens | {served:,.0f} | {direct:,.0f} | {served / direct:.2f}x |")


if __name__ == "__main__":
    import urllib.parse  # noqa: F401  (stream() builds its query with it)
    main()
