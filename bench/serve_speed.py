"""The local page's speed against sample.py's, on the same run, in one sitting.

    python bench/serve_speed.py --run runs/NAME [--screenshot docs/figures/serve.png]

Starts python -m attnlab.serve on a free loopback port and times, over HTTP, the
arrival of every token's event as the page receives it:
- time to first token: from sending the request to its first token's event (five
  requests, median);
- inter-token arrival over a 500-token stream: the median and 99th percentile gap
  between consecutive tokens' arrivals, and the longest; a server that generated before
  sending would show one long wait and then gaps of zero;
- tokens per second over that stream, against sample.py's own generation loop
  (engine.inference.stream_text, the same weights, dtype, settings and seed) timed in
  this process;
- taking turns: a 5-token request sent while three 2,000-token ones stream, its first
  token and its end (the three are then closed, which ends their generation).
With --screenshot it also opens the page in headless Chromium, generates 60 tokens
after "ROMEO:", clicks the 30th and saves the page.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = {"prompt": "ROMEO:", "temperature": "0.8", "top_k": "200", "top_p": "1.0", "seed": "1337"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arrivals(port: int, n: int, until=None) -> tuple[float, list[float]]:
    """(the moment the request was sent, each token event's arrival) of one request, on
    time.perf_counter's clock; events read in one chunk share its arrival. `until()`,
    if given, is asked after each chunk and closes the stream early when true."""
    query = urllib.parse.urlencode({**SETTINGS, "max_new_tokens": n})
    start, times, buffer = time.perf_counter(), [], b""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/generate?{query}") as response:
        while chunk := response.read1(1 << 16):
            now = time.perf_counter()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            times += [now for e in events if e.startswith(b"data: ") and b'"token": ' in e]
            if until is not None and until():
                break
    return start, times


def turns(port: int) -> tuple[float, float]:
    """(first token, last token) in seconds of a 5-token request sent while three
    2,000-token requests stream."""
    started, leave = threading.Barrier(4), threading.Event()

    def long() -> None:
        first = []

        def check() -> bool:
            if not first:
                first.append(1)
                started.wait()
            return leave.is_set()
        arrivals(port, 2000, until=check)
    threads = [threading.Thread(target=long) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    start, times = arrivals(port, 5)
    leave.set()
    for t in threads:
        t.join()
    return times[0] - start, times[-1] - start


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
    parser.add_argument("--tokens", type=int, default=500, help="tokens in the timed stream")
    parser.add_argument("--screenshot", default="", help="also save the page as this PNG")
    args = parser.parse_args()
    from engine.checkpoint import latest_run
    run = args.run or str(latest_run())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", run, "--port", str(port),
                               "--device", "auto"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(300):
            try:
                json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info").read())
                break
            except OSError:
                time.sleep(0.2)
        arrivals(port, 5)                                          # warm-up
        firsts = sorted(times[0] - start for start, times in (arrivals(port, 1) for _ in range(5)))
        start, times = arrivals(port, args.tokens)
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        served = len(times) / (times[-1] - start)
        short_first, short_done = turns(port)
        if args.screenshot:
            screenshot(port, args.screenshot)
    finally:
        server.terminate()
        server.wait()
    direct = sample_rate(run, args.tokens)
    ms = lambda seconds: f"{seconds * 1000:.1f} ms"                # noqa: E731
    print(f"run: {run}")
    print("| measure | attnlab.serve (HTTP, as the page gets it) | sample.py's loop | ratio |")
    print("|---|---|---|---|")
    print(f"| time to first token (median of 5) | {ms(firsts[2])} | - | - |")
    print(f"| first token of the {args.tokens}-token stream | {ms(times[0] - start)} | - | - |")
    print(f"| inter-token arrival, median / p99 / longest | {ms(statistics.median(gaps))} / "
          f"{ms(gaps[int(0.99 * (len(gaps) - 1))])} / {ms(gaps[-1])} | "
          f"{ms(1 / direct)} per token | - |")
    print(f"| tokens/s over {args.tokens} tokens | {served:,.0f} | {direct:,.0f} | {served / direct:.2f}x |")
    print(f"| 5 tokens behind three 2,000-token streams: first / last | {ms(short_first)} / "
          f"{ms(short_done)} | - | - |")


if __name__ == "__main__":
    main()
