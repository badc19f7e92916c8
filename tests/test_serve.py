"""python -m attnlab.serve: the API through Starlette's test client, then the page in a
real headless Chromium (Debian's chromium and chromium-driver, which .ci/run installs)."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, run_script, train_tiny

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from attnlab.serve import Service, create_app, is_loopback  # noqa: E402
from engine.inference import load_run  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory):
    return train_tiny(corpus, tmp_path_factory.mktemp("serve"), "s", "--train.max_iters=30",
                      "--train.lr=3e-3")


@pytest.fixture(scope="module")
def client(tiny_run):
    model, cfg, tokenizer, ckpt = load_run(tiny_run)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(ckpt)))) as c:
        yield c


def stream(client, **params):
    """The events of one generation, parsed."""
    events = []
    with client.stream("GET", "/api/generate", params=params) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_a_streamed_generation_is_sample_py_s_text(client, tiny_run):
    settings = {"prompt": "KING", "temperature": "0.9", "top_k": "20", "top_p": "0.95",
                "max_new_tokens": "40", "seed": "7"}
    events = stream(client, **settings)
    text = settings["prompt"] + "".join(e["text"] for e in events if "text" in e)
    sampled = run_script("sample.py", "--run", tiny_run, "--prompt", "KING", "--temperature", "0.9",
                         "--top_k", "20", "--top_p", "0.95", "--max_new_tokens", "40", "--seed", "7")
    assert text + "\n" == sampled.stdout
    tokens = [e for e in events if "token" in e]
    assert len(tokens) == 40 and tokens[0]["index"] == len(events[0]["prompt_ids"])
    ids = events[0]["prompt_ids"] + [e["id"] for e in tokens]
    sampling = {k: settings[k] for k in ("temperature", "top_k", "top_p")}
    for index in (tokens[0]["index"], tokens[20]["index"], tokens[-1]["index"]):
        step = client.post("/api/step", json={"ids": ids[:index + 1], "index": index,
                                              "settings": sampling}).json()
        after = [c[2] for c in step["candidates"]]
        assert sum(after) <= 1 + 1e-4 and step["chosen"] == ids[index]
        assert ids[index] in [c[3] for c in step["candidates"]]
        chosen_after = next(c[2] for c in step["candidates"] if c[3] == ids[index])
        assert chosen_after > 0                          # it was drawn from what was kept


def test_attention_of_a_token_and_the_info(client):
    info = client.get("/api/info").json()
    assert info["layers"] == 2 and info["heads"] == 2 and "auto attention" in info["config"]
    assert info["mask"][3][:5] == [1, 1, 1, 1, 0]                         # causal
    events = stream(client, prompt="KING", max_new_tokens="12", temperature="0")
    ids = events[0]["prompt_ids"] + [e["id"] for e in events if "token" in e]
    att = client.post("/api/step", json={"ids": ids, "index": 10, "settings": {"temperature": "0"}}).json()
    assert att["keys"] == list(range(10)) and len(att["weights"]) == 2
    assert att["candidates"][0][2] == 1.0 and att["candidates"][0][3] == ids[10]   # greedy
    for layer in att["weights"]:
        for head in layer:
            assert len(head) == 10 and abs(sum(head) - 1) < 1e-3
    found = client.post("/api/search", json={"text": "the king and it", "from": "it", "to": "king"})
    assert found.status_code == 200 and len(found.json()["ranking"]) == 4


@pytest.mark.parametrize("params,message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "KING€"}, "'€'"),
    ({"prompt": "a", "max_new_tokens": "100000"}, "cap of 2000"),
    ({"prompt": "a", "temperature": "warm"}, "temperature must be a number"),
    ({"prompt": "a", "top_p": "7"}, "top_p must be in"),
    ({"prompt": "a", "top_k": "-1"}, "top_k"),
    ({"prompt": "a", "seed": "1e99"}, "seed must be an integer"),
    ({"prompt": "a", "bogus": "1"}, "unknown parameter 'bogus'"),
])
def test_bad_input_gets_a_4xx_json_error_and_the_server_goes_on(client, params, message):
    response = client.get("/api/generate", params=params)
    assert 400 <= response.status_code < 500 and message in response.json()["error"]
    assert client.get("/api/info").status_code == 200


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", json.dumps({"ids": [1, 2], "index": 5}),
                                  json.dumps({"ids": [10 ** 9], "index": 0}), json.dumps({"ids": "x"}),
                                  json.dumps({"ids": [1, 2], "index": 1, "settings": {"top_p": "9"}}),
                                  json.dumps({"ids": [1, 2], "index": 1, "settings": [1]}),
                                  json.dumps({"ids": [1, 2], "index": 1, "settings": {"x": 1}})])
def test_bad_step_requests_are_refused(client, body):
    response = client.post("/api/step", content=body)
    assert response.status_code == 400 and response.json()["error"]


def test_a_client_that_leaves_mid_stream_does_not_stop_the_next(client):
    with client.stream("GET", "/api/generate", params={"prompt": "KING", "max_new_tokens": "500"}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break                                                   # leaves early
    assert len([e for e in stream(client, prompt="KING", max_new_tokens="5") if "token" in e]) == 5


def test_two_clients_at_once_each_get_their_own_stream(client):
    results = {}

    def one(seed):
        results[seed] = "".join(e.get("text", "") for e in stream(
            client, prompt="KING", max_new_tokens="30", seed=str(seed)))
    threads = [threading.Thread(target=one, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    alone = {seed: "".join(e.get("text", "") for e in stream(client, prompt="KING",
                                                                max_new_tokens="30", seed=str(seed)))
             for seed in (1, 2)}
    assert results == alone and results[1] != results[2]


def test_only_loopback_unless_asked():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    from attnlab.serve import parser
    assert parser().parse_args([]).host == "127.0.0.1"          # this machine only, by default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url, timeout=60):
    import urllib.request
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return urllib.request.urlopen(url, timeout=2).read()
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")


def test_a_warning_when_listening_beyond_this_machine(tiny_run):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", str(tiny_run),
                             "--host", "0.0.0.0", "--port", str(port)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(f"http://127.0.0.1:{port}/api/info")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "warning: listening on 0.0.0.0, not only this machine" in err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif((not CHROMIUM or not DRIVER) and not os.environ.get("CI"),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_the_page_in_a_real_browser(tiny_run, tmp_path):
    """Headless Chromium: type a prompt, generate 20 tokens, click the 10th, and find the
    layer x head grid and the candidate table drawn; saves a screenshot."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", str(tiny_run),
                               "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = None
    try:
        wait_for(f"http://127.0.0.1:{port}/api/info")
        driver = webdriver.Chrome(service=DriverService(DRIVER), options=options)
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "attention" in d.find_element(By.ID, "config").text)
        prompt = driver.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("KING")
        driver.execute_script("const s = document.getElementById('max_new_tokens');"
                              "s.value = 20; s.dispatchEvent(new Event('input'));")
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "done" in d.find_element(By.ID, "status").text)
        tokens = driver.find_elements(By.CSS_SELECTOR, ".output .tok")
        assert len(tokens) == 20
        tokens[9].click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid canvas.head")) == 2 * 2)
        rows = driver.find_elements(By.CSS_SELECTOR, "#candidates tbody tr")
        after = [float(r.get_attribute("data-after")) for r in rows]
        assert rows and 0 < sum(after) <= 1 + 1e-4
        assert len(driver.find_elements(By.CSS_SELECTOR, "#candidates tr.chosen")) == 1
        driver.save_screenshot(str(tmp_path / "serve.png"))
        if os.environ.get("ATTNLAB_SCREENSHOT"):
            shutil.copy(tmp_path / "serve.png", os.environ["ATTNLAB_SCREENSHOT"])
        assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


def test_the_page_opens_the_articles_encoder_in_its_mask_and_search_tab(minilm):
    model, cfg, tokenizer, _ = load_run(minilm)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(minilm)))) as c:
        info = c.get("/api/info").json()
        assert "bidirectional" in info["config"] and info["mask"][3][:6] == [1] * 6
        found = c.post("/api/search", json={"text": "The trophy didn't fit in the suitcase "
                                                    "because it was too big.",
                                            "from": "it", "to": "trophy"}).json()
        assert found["query"] == "it" and (found["ranking"][0]["layer"], found["ranking"][0]["head"]) == (3, 1)
        refused = c.get("/api/generate", params={"prompt": "the"})
        assert refused.status_code == 400 and "encoder" in refused.json()["error"]
