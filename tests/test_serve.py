"""python -m attnlab.serve: the API through Starlette's test client; streaming, taking
turns and Stop through a real uvicorn on 127.0.0.1 (the test client holds a response
until it is complete); then the page in a real headless Chromium (Debian's chromium and
chromium-driver, which .ci/run installs)."""
import json
from pathlib import Path
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

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
    with TestClient(create_app(Service(model, cfg, tokenizer, str(ckpt))),
                    base_url="http://127.0.0.1:8000") as c:     # a loopback Host, as a browser sends
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
    assert info["layers"] == 2 and info["heads"] == 2 and "mha mechanism, auto attention" in info["config"]
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
    response = client.post("/api/step", content=body, headers={"Content-Type": "application/json"})
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


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize("path,body,status,message", [
    ("/api/search", {"text": "x" * 20_000, "from": "x", "to": "x"}, 413, "at most 10,000"),
    ("/api/search", {"text": "the king and it " * 4, "from": "it", "to": "king"}, 413, "at most 32 (a"),
    ("/api/search", {"text": "the king and it", "from": "it" * 200, "to": "king"}, 413, "at most 200"),
    ("/api/search", {"text": "the king and it", "from": 5, "to": "king"}, 400, "non-empty string"),
    ("/api/search", {"text": ["the king"], "from": "it", "to": "king"}, 400, "non-empty string"),
    ("/api/step", {"ids": [True, False], "index": 1}, 400, "token ids"),
    ("/api/step", {"ids": [1, 2], "index": True}, 400, "index must point"),
    ("/api/step", {"ids": [], "index": 0}, 400, "at least one before it"),
    ("/api/step", {"ids": [1] * 60_000, "index": 1}, 400, "at most 50,000"),
    ("/api/step", {"ids": [1, 2], "index": 1, "settings": {"temperature": [1]}}, 400, "a number"),
    ("/api/step", {"ids": [1, 2], "index": 1, "settings": {"temperature": "1" * 100}}, 413, "over 40"),
])
def test_every_input_has_a_cap_and_a_type(client, path, body, status, message):
    response = client.post(path, json=body)
    assert response.status_code == status and message in response.json()["error"], response.text


@pytest.mark.parametrize("source, target, page, command", [
    ("it", "queen", 'give "from" and "to" words of the text', "give --from and --to words"),
    ("king", "it", 'so put "from" after "to"', "so put --from after --to"),
])
def test_a_search_refusal_names_the_page_s_fields_and_the_command_its_flags(client, source,
                                                                             target, page, command):
    import torch
    from attnlab.heads import search
    from common.errors import AttnlabError
    text = "the king and it"
    response = client.post("/api/search", json={"text": text, "from": source, "to": target})
    error = response.json()["error"]
    assert response.status_code == 400 and page in error and "--" not in error, error
    spans = [(i, i + 1) for i in range(len(text))]                 # one token per character
    with pytest.raises(AttnlabError, match=command):
        search([torch.zeros(1, len(text), len(text))], text, spans, source, target)


@pytest.mark.parametrize("path", ["/api/step", "/api/search"])
@pytest.mark.parametrize("body,status,message", [
    (b'{"text": "' + b"x" * 1_000_000 + b'"}', 413, "over 512 KB"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
    (b'{"ids": ' + b"[" * 500 + b"]" * 500 + b', "index": 1, "text": 1}', 400, ""),
], ids=["1 MB", "nested 100,000 deep", "nested 500 deep"])
def test_a_huge_or_deep_body_is_refused_not_a_500(client, path, body, status, message):
    response = client.post(path, content=body, headers=JSON)
    assert response.status_code == status and message in response.json()["error"], response.text


def test_a_long_prompt_is_refused(client):
    response = client.get("/api/generate", params={"prompt": "a" * 10_001})
    assert response.status_code == 413 and "prompt is over 10,000" in response.json()["error"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
@pytest.mark.parametrize("path", ["/", "/api/info", "/api/generate?prompt=KING&max_new_tokens=2"])
def test_only_this_machine_s_names_are_answered(client, host, path):
    """DNS rebinding: a site that points its own name at 127.0.0.1 gets nothing."""
    response = client.get(path, headers={"Host": host})
    assert response.status_code == 400 and "KING" not in response.text


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost"])
def test_loopback_names_are_answered(client, host):
    assert client.get("/api/info", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("headers", [
    {"Origin": "https://evil.example"}, {"Origin": "null"},
    {"Origin": "http://127.0.0.1:9999"},                    # another port is another site
    {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
])
def test_requests_from_another_site_s_page_are_refused(client, headers):
    search = {"text": "the king and it", "from": "it", "to": "king"}
    response = client.post("/api/search", json=search, headers=headers)
    assert response.status_code == 403 and "its own pages" in response.json()["error"]
    assert client.get("/api/generate", params={"prompt": "KING"}, headers=headers).status_code == 403
    assert client.get("/api/info", headers=headers).status_code == 403


def test_the_page_s_own_requests_pass(client):
    same = {"Origin": "http://127.0.0.1:8000", "Sec-Fetch-Site": "same-origin"}
    search = {"text": "the king and it", "from": "it", "to": "king"}
    assert client.post("/api/search", json=search, headers=same).status_code == 200
    assert client.get("/", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200  # a link to it


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", None])
def test_a_post_that_is_not_json_is_refused(client, kind):
    """The content types a foreign page may POST without asking first: 415."""
    headers = {"Content-Type": kind} if kind else {}
    body = json.dumps({"text": "the king and it", "from": "it", "to": "king"})
    response = client.post("/api/search", content=body, headers=headers)
    assert response.status_code == 415 and "application/json" in response.json()["error"]
    assert client.post("/api/search", content=body,
                       headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_no_absolute_path_is_shown(client, tiny_run):
    info = client.get("/api/info").text
    assert str(tiny_run) not in info and str(ROOT) not in info
    assert json.loads(info)["origin"].startswith("s/checkpoints/step_")      # run/checkpoints/step
    model, cfg, tokenizer, ckpt = load_run(tiny_run)
    message = Service(model, cfg, tokenizer, str(ckpt)).public(
        f"cannot read {ckpt / 'tokenizer.json'} (in {ckpt.parent})")
    assert str(tiny_run.parent) not in message and "s/checkpoints/" in message


def test_the_allowed_names_follow_host():
    from attnlab.serve import allowed_hosts
    assert allowed_hosts("127.0.0.1") == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts("myhost.lan")[-1] == "myhost.lan" and "localhost" in allowed_hosts("myhost.lan")
    assert allowed_hosts("fe80::1")[-1] == "[fe80::1]"
    assert allowed_hosts("0.0.0.0") == ["*"] and allowed_hosts("::") == ["*"]


@pytest.mark.parametrize("argv,message", [
    (["--port", "70000"], "port number (1-65535), not 70000"),
    (["--port", "-1"], "port number (1-65535), not -1"),
    (["--port", "http"], "not 'http'"),
    (["--host", "evil..name"], "--host 'evil..name' is not an address"),
])
def test_a_bad_host_or_port_is_one_error_line(capsys, argv, message):
    from attnlab.serve import main
    from engine.cli import errors_as_lines
    with pytest.raises(SystemExit) as exit, errors_as_lines():
        main(argv + ["--run", "nowhere"])               # refused before the model is looked for
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_port_in_use_is_one_error_line(capsys):
    from attnlab.serve import main
    from engine.cli import errors_as_lines
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit), errors_as_lines():
            main(["--port", str(taken.getsockname()[1]), "--run", "nowhere"])
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen") and "choose another --port" in err


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


def test_a_warning_beyond_this_machine_and_stopping_ends_the_streams(tiny_run):
    """--host 0.0.0.0 warns; stopping the server (SIGTERM, as Ctrl-C) ends a stream in
    progress with an error event instead of waiting for its 2,000 tokens, and prints
    no traceback."""
    import urllib.request
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", str(tiny_run),
                             "--host", "0.0.0.0", "--port", str(port)], cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(f"http://127.0.0.1:{port}/api/info")
        url = f"http://127.0.0.1:{port}/api/generate?prompt=KING&max_new_tokens=2000"
        with urllib.request.urlopen(url, timeout=60) as response:
            assert b'"token"' in response.readline() + response.readline() + response.readline()
            proc.terminate()
            rest = response.read().decode()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "event: error" in rest and "the server was stopped" in rest and "event: done" not in rest
    assert "warning: listening on 0.0.0.0, not only this machine" in err
    assert "Traceback" not in err and "train.py" not in err


# --- a real server: the test client holds a response until it is complete, so what
# arrives when can only be seen over a socket.

@pytest.fixture(scope="module")
def live(tiny_run):
    """(base URL, Service, event loop) of uvicorn serving the tiny run on 127.0.0.1, in
    this process so a test can watch the model's steps."""
    import uvicorn
    from attnlab.serve import listen
    model, cfg, tokenizer, ckpt = load_run(tiny_run)
    service = Service(model, cfg, tokenizer, str(ckpt))
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", service, server.servers[0].get_loop()
    server.should_exit = True
    thread.join(timeout=30)
    service.thread.close()


class Steps:
    """A forward pre-hook counting the model's passes (one per token drawn) and when
    each began; with `gated`, each pass waits for a permit from the test (at most
    `patience` seconds, after which it goes on and is counted as forced)."""

    def __init__(self, model, gated=False, patience=5.0):
        self.gated, self.patience, self.forced, self.starts = gated, patience, 0, []
        self.permits = threading.Semaphore(0)
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.gated and not self.permits.acquire(timeout=self.patience):
            self.forced += 1
        self.starts.append(time.perf_counter())

    def allow(self):
        self.permits.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def timed_events(url, **params):
    """Yields (arrival time, SSE event name, data) as each event arrives."""
    import httpx
    kind = "message"
    with httpx.stream("GET", url + "/api/generate", params=params, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                yield time.perf_counter(), kind, json.loads(line[6:])
                kind = "message"


def test_each_token_arrives_before_the_next_is_drawn(live):
    """Every token's event is timed as it arrives; the model may draw token k+1 only once
    token k has arrived. A server that generates before sending would hold every pass
    for `patience` (forced) and deliver the tokens together at the end."""
    url, service, _ = live
    n = 6
    # The patience only ends a broken server's wait; a busy machine must not reach it.
    with Steps(service.model, gated=True, patience=60.0) as steps:
        steps.allow()                                        # the prompt's pass
        tokens, done = [], []
        for arrived, kind, data in timed_events(url, prompt="KING", max_new_tokens=n, temperature=0):
            if "token" in data:
                tokens.append(arrived)
                steps.allow()                                # now the next one
            done += [arrived] if kind == "done" else []
    assert len(tokens) == n and len(done) == 1 and steps.forced == 0
    assert all(tokens[k] < steps.starts[k + 1] for k in range(n - 1))    # sent as drawn


def test_a_live_stream_carries_every_token_in_order(live, client, monkeypatch):
    """Over a socket the events come in many writes: none is lost or reordered, and the
    text is the test client's (sample.py's, by the first test). The first time, the event
    loop is held while the prompt's event and the first tokens are made, so they are all
    waiting together when the server picks up the first."""
    url, service, loop = live
    made = service.steps

    def held(sample):
        events, busy, release = made(sample), threading.Event(), threading.Event()
        loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(10)))
        busy.wait(10)
        yield next(events)                                   # the prompt's
        yield next(events)
        yield next(events)
        release.set()
        yield from events
    settings = {"prompt": "KING", "max_new_tokens": "60", "seed": "3"}
    text = "".join(e.get("text", "") for e in stream(client, **settings))
    for attempt in range(2):
        if attempt == 0:
            monkeypatch.setattr(service, "steps", held)
        events = [data for _, _, data in timed_events(url, **settings)]
        monkeypatch.undo()
        assert [e["index"] for e in events if "token" in e] == list(range(4, 64))
        assert "".join(e.get("text", "") for e in events) == text


def test_a_short_request_behind_long_ones_finishes_first(live):
    """Three clients ask for 2,000 tokens, then a fourth for 5: it is done while the
    three are still generating, since every live request takes one token step a turn."""
    url, service, _ = live
    first, finished, leave = [threading.Event() for _ in range(3)], [], threading.Event()

    def long(i):
        for _, kind, data in timed_events(url, prompt="KING", max_new_tokens=2000, seed=i):
            if "token" in data:
                first[i].set()
            if kind == "done":
                finished.append(i)
            if leave.is_set():
                return                                       # closes the connection
    with Steps(service.model) as steps:
        threads = [threading.Thread(target=long, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first)
        before = len(steps.starts)
        events = list(timed_events(url, prompt="KING", max_new_tokens=5))
        during = len(steps.starts) - before
        live_then, finished_then = len(service.thread.streams), list(finished)
        leave.set()
        for t in threads:
            t.join(timeout=60)
        assert sum("token" in data for _, _, data in events) == 5 and events[-1][1] == "done"
        assert finished_then == [] and live_then == 3
        assert during < 2000                     # it did not wait for a long one to end
        deadline = time.monotonic() + 30         # the three left: their generations end
        while service.thread.streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service.thread.streams and len(steps.starts) < 3 * 2000


def test_a_client_that_leaves_ends_its_generation(live):
    """Stop on the page closes the connection: the server stops drawing tokens."""
    url, service, _ = live
    with Steps(service.model) as steps:
        for i, (_, _, data) in enumerate(timed_events(url, prompt="KING", max_new_tokens=2000)):
            if i == 5:
                break
        deadline = time.monotonic() + 30
        while service.thread.streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service.thread.streams and len(steps.starts) < 1000


def d_enabled(driver, element_id) -> bool:
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, element_id).is_enabled()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif((not CHROMIUM or not DRIVER) and not os.environ.get("CI"),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_the_page_in_a_real_browser(tiny_run, tmp_path):
    """Headless Chromium: type a prompt, generate 20 tokens, click the 10th, and find the
    layer x head grid and the candidate table drawn; a prompt the tokenizer refuses is
    named on the page; saves a screenshot."""
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
        prompt.clear()
        prompt.send_keys("KING€")                              # refused: the page says why
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "'€'" in d.find_element(By.ID, "status").text)
        assert d_enabled(driver, "generate") and not d_enabled(driver, "stop")
        assert len(driver.find_elements(By.CSS_SELECTOR, ".output .tok")) == 0
        prompt.clear()
        prompt.send_keys("KING")
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "done" in d.find_element(By.ID, "status").text)
        driver.find_elements(By.CSS_SELECTOR, ".output .tok")[9].click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#grid canvas.head")) == 2 * 2)
        ends = ("const c = document.getElementById('scale'), x = c.getContext('2d');"
                "return [0, c.width - 1].map(i => Array.from(x.getImageData(i, 0, 1, 1).data.slice(0, 3)));")
        assert driver.execute_script(ends) == [[247, 251, 255], [47, 81, 165]]   # heat(0), heat(1)
        driver.find_element(By.ID, "tab-mask").click()       # the figure's colours, causal
        pixel = ("const c = document.getElementById('mask'), cell = c.width / info.mask.length;"
                 "return Array.from(c.getContext('2d').getImageData("
                 "(arguments[1] + 0.5) * cell, (arguments[0] + 0.5) * cell, 1, 1).data.slice(0, 3));")
        assert driver.execute_script(pixel, 1, 0) == [0x21, 0x71, 0xb5]      # query 1, key 0
        assert driver.execute_script(pixel, 0, 1) == [0xf7, 0xfb, 0xff]      # a later key
        driver.find_element(By.ID, "tab-generate").click()
        driver.save_screenshot(str(tmp_path / "serve.png"))
        if os.environ.get("ATTNLAB_SCREENSHOT"):
            shutil.copy(tmp_path / "serve.png", os.environ["ATTNLAB_SCREENSHOT"])
        assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


# -- what the model-card pieces did, on the page ------------------------------------------

# Every piece in one tiny model: a layer each of sinks, gated and sparse attention, experts in all.
EVERY_PIECE = ("--model.mechanism=sinks,gated,sparse", "--model.n_layer=3", "--model.sparse_top_k=4",
               "--model.mlp=moe", "--model.moe_experts=4", "--model.moe_top_k=2",
               "--model.moe_shared=1", "--train.optimizer=adamw", "--train.max_iters=10")


@pytest.fixture(scope="module")
def pieces_run(corpus, tmp_path_factory):
    return train_tiny(corpus, tmp_path_factory.mktemp("pieces"), "p", *EVERY_PIECE)


def test_a_step_shows_what_each_piece_did_for_its_query(pieces_run):
    """The step's pieces are the clicked query's, the last of its context: the sink's share
    is what that query's weights miss of 1, the indexer's keys are the only ones the sparse
    layer weighs, and the experts are the router's top k for the query's MLP input."""
    from attnlab.capture import run_with_cache
    model, cfg, tokenizer, ckpt = load_run(pieces_run)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(ckpt))),
                    base_url="http://127.0.0.1:8000") as c:
        events = stream(c, prompt="KING", max_new_tokens="12", temperature="0")
        ids = events[0]["prompt_ids"] + [e["id"] for e in events if "token" in e]
        step = c.post("/api/step", json={"ids": ids, "index": 12, "settings": {}}).json()
    sink, gate, sparse = step["pieces"]
    assert set(sink) == {"sink", "experts"} and set(gate) == {"gate", "experts"}
    assert set(sparse) == {"chosen", "full_on_chosen", "experts"}
    for h, share in enumerate(sink["sink"]):
        assert share == pytest.approx(1 - sum(step["weights"][0][h]), abs=1e-3)
    assert len(sparse["chosen"]) == 4
    for row in step["weights"][2]:
        assert all(w == 0 for k, w in enumerate(row) if k not in sparse["chosen"])
        assert sum(row[k] for k in sparse["chosen"]) == pytest.approx(1, abs=1e-3)
    context = torch.tensor([ids[:12]])
    _, cache = run_with_cache(model, context)
    assert gate["gate"] == pytest.approx(cache["blocks.1.gate"][0, -1].tolist(), abs=1e-4)
    q, k = cache["blocks.2.q"][0, :, -1].double(), cache["blocks.2.k"][0].double()   # the last query sees all
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    full = torch.softmax(torch.einsum("hd,htd->ht", q, k) / q.shape[-1] ** 0.5, dim=-1)
    assert sparse["full_on_chosen"] == pytest.approx(full[:, sparse["chosen"]].sum(-1).tolist(), abs=1e-3)
    u = {}
    hooks = [b.mlp.register_forward_pre_hook(lambda m, a, l=l: u.__setitem__(l, a[0][0, -1:]))
             for l, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(context)
    for h in hooks:
        h.remove()
    for layer, piece in enumerate(step["pieces"]):
        moe = model.blocks[layer].mlp               # DeepSeek-V3's router: the bias picks, s weighs
        s = torch.sigmoid(moe.router(u[layer]).double()[0])
        pick = (s + moe.balance_bias.double()).topk(2).indices
        weights = s[pick] / s[pick].sum()
        order = weights.argsort(descending=True)
        assert [e for e, _ in piece["experts"]] == pick[order].tolist()
        assert [w for _, w in piece["experts"]] == pytest.approx(weights[order].tolist(), abs=1e-3)


@pytest.mark.skipif((not CHROMIUM or not DRIVER) and not os.environ.get("CI"),
                    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")
def test_the_page_shows_what_each_piece_did_in_a_real_browser(pieces_run):
    """Headless Chromium on a model with every piece: a click on a token draws one line a
    layer with the numbers /api/step sends for it, and outlines the indexer's keys."""
    from urllib.request import Request, urlopen
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "attnlab.serve", "--run", str(pieces_run),
                               "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = None
    try:
        wait_for(f"http://127.0.0.1:{port}/api/info")
        driver = webdriver.Chrome(service=DriverService(DRIVER), options=options)
        driver.get(f"http://127.0.0.1:{port}/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "attention" in d.find_element(By.ID, "config").text)
        driver.execute_script("const s = document.getElementById('max_new_tokens');"
                              "s.value = 12; s.dispatchEvent(new Event('input'));")
        driver.find_element(By.ID, "generate").click()
        wait.until(lambda d: "done" in d.find_element(By.ID, "status").text)
        driver.find_elements(By.CSS_SELECTOR, ".output .tok")[-1].click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pieces .piece")) == 3)
        ids = driver.execute_script("return ids")
        request = Request(f"http://127.0.0.1:{port}/api/step", method="POST",
                          headers={"Content-Type": "application/json"},
                          data=json.dumps({"ids": ids, "index": len(ids) - 1,
                                           "settings": driver.execute_script("return settings")}).encode())
        step = json.loads(urlopen(request, timeout=60).read())
        lines = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#pieces .piece")]
        sink, gate, sparse = step["pieces"]
        assert lines[0].startswith("layer 0: the sink's share of each head's row")
        # The page's numbers, as it rounds them: a percent to 0.1, an openness to 0.001.
        shown = [float(x) for x in re.findall(r"\d+: ([\d.]+)%", lines[0].split(";")[0])]
        assert shown == pytest.approx([100 * v for v in sink["sink"]], abs=0.051)
        shown = [float(x) for x in re.findall(r"\d+: ([\d.]+)", lines[1].split(";")[0])]
        assert shown == pytest.approx(gate["gate"], abs=0.00051)
        assert f"the indexer chose {len(sparse['chosen'])} of {len(step['keys'])} keys" in lines[2]
        shown = [float(x) for x in re.findall(r"\d+: ([\d.]+)%", lines[2].split(";")[1])]
        assert shown == pytest.approx([100 * v for v in sparse["full_on_chosen"]], abs=0.051)
        for line, piece in zip(lines, step["pieces"]):
            shown = re.findall(r"(\d+) \(weight ([\d.]+)\)", line)
            assert [int(e) for e, _ in shown] == [e for e, _ in piece["experts"]]
            assert [float(w) for _, w in shown] == pytest.approx([w for _, w in piece["experts"]], abs=0.00051)
        driver.find_elements(By.CSS_SELECTOR, "#grid canvas.head")[-1].click()    # layer 2, the sparse one
        outlined = driver.find_elements(By.CSS_SELECTOR, "#enlarged span")
        assert [i for i, span in enumerate(outlined) if span.get_attribute("class") == "chosen-key"] \
            == sparse["chosen"]
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


def test_the_page_names_a_model_outside_the_working_folder_from_its_run(tmp_path, monkeypatch):
    """Never an absolute path, and never one that reads as relative to the root."""
    from attnlab.serve import public_base
    monkeypatch.chdir(tmp_path)
    elsewhere = Path("/tmp") / "attnlab-elsewhere" / "r"
    ckpt = elsewhere / "checkpoints" / "step_0000010"
    assert ckpt.relative_to(public_base(str(ckpt))) == Path("r/checkpoints/step_0000010")
    assert elsewhere.relative_to(public_base(str(elsewhere))) == Path("r")
    inside = tmp_path / "runs" / "r"
    assert inside.relative_to(public_base(str(inside))) == Path("runs/r")


def test_the_page_opens_the_articles_encoder_in_its_mask_and_search_tab(minilm):
    model, cfg, tokenizer, _ = load_run(minilm)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(minilm))),
                    base_url="http://127.0.0.1:8000") as c:
        info = c.get("/api/info").json()
        assert "bidirectional" in info["config"] and info["mask"][3][:6] == [1] * 6
        found = c.post("/api/search", json={"text": "The trophy didn't fit in the suitcase "
                                                    "because it was too big.",
                                            "from": "it", "to": "trophy"}).json()
        assert found["query"] == "it" and (found["ranking"][0]["layer"], found["ranking"][0]["head"]) == (3, 1)
        refused = c.get("/api/generate", params={"prompt": "the"})
        assert refused.status_code == 400 and "encoder" in refused.json()["error"]


def test_the_pages_first_prompt_is_a_speaker_as_the_bundled_plays_write_one():
    """The page opened on "ROMEO:", which the plays never write ("Romeo." on a line of
    its own starts a speech), so the first thing a learner generated began off the text."""
    import gzip
    import re
    page = (ROOT / "attnlab" / "web" / "index.html").read_text(encoding="utf-8")
    prompt = re.search(r'<textarea id="prompt"[^>]*>(.*?)</textarea>', page, re.S)[1]
    prompt = prompt.removeprefix("\n")      # HTML drops a newline right after <textarea>
    with gzip.open(ROOT / "data" / "shakespeare" / "plays.txt.gz", "rt", encoding="utf-8") as f:
        plays = f.read()
    assert prompt.endswith("\n") and plays.count("\n\n" + prompt) > 100


def test_a_tokenizer_that_panics_leaves_the_model_thread_serving(tiny_run):
    """The Rust tokenizer's panic (a BaseException) ended the model thread: every request
    after it waited for ever, and Ctrl-C did not stop the server. Now the prompt is
    refused in one line and the next request is answered. (The tokenizer is built in
    memory: a file with this normalizer is refused before it is built.)"""
    from tokenizers import Regex, normalizers
    from data.tokenizer import BPETokenizer
    model, cfg, tokenizer, ckpt = load_run(tiny_run)
    hostile = BPETokenizer.train(["First Citizen: speak, speak.\n" * 20], 300)
    hostile.hf.normalizer = normalizers.Replace(Regex(""), "x")
    answers = {}

    def ask():
        with TestClient(create_app(Service(model, cfg, hostile, str(ckpt))),
                        base_url="http://127.0.0.1:8000") as c:
            answers["generate"] = c.get("/api/generate", params={"prompt": "KING", "max_new_tokens": "3"})
            answers["step"] = c.post("/api/step", json={"ids": [1, 2, 3], "index": 2,
                                                        "settings": {"temperature": "0"}})
    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout=300)              # only a broken server waits this long
    assert "step" in answers, "the model thread stopped answering"
    assert answers["generate"].status_code == 400
    assert "tokenizers library" in answers["generate"].json()["error"]
    assert answers["step"].status_code == 200 and answers["step"].json()["candidates"]


def test_the_model_thread_outlives_any_base_exception():
    """Whatever a library raises that is not an Exception reaches its caller as a
    RuntimeError naming it, and the thread takes the next turn."""
    import asyncio
    from attnlab.serve import ModelThread

    class PanicException(BaseException):
        pass

    def panics():
        raise PanicException("index out of bounds")

    def steps():
        yield [1]
        raise PanicException("in a stream")

    async def main():
        thread = ModelThread()
        try:
            with pytest.raises(RuntimeError, match="PanicException: index out of bounds"):
                await asyncio.wait_for(thread.call(panics), 300)   # only a dead thread waits
            stream = thread.stream(steps())
            items = [await asyncio.wait_for(stream.queue.get(), 300) for _ in range(2)]
            assert items[0] == [1] and isinstance(items[1], RuntimeError)
            assert await asyncio.wait_for(thread.call(lambda: 42), 300) == 42
        finally:
            thread.close()
    asyncio.run(main())


@pytest.mark.parametrize("mechanism, drawn", [("deltanet", [False, False]), ("deltanet,mha", [False, True])])
def test_a_step_in_a_model_without_attention_weights_keeps_its_candidates(corpus, tmp_path,
                                                                            mechanism, drawn):
    """A click on a token of a DeltaNet model (or a hybrid with a DeltaNet layer) was a 400
    for the whole step, and the sampler's candidates vanished with the attention."""
    run = train_tiny(corpus, tmp_path, "r", f"--model.mechanism={mechanism}", "--train.max_iters=4")
    model, cfg, tokenizer, ckpt = load_run(run)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(ckpt))),
                    base_url="http://127.0.0.1:8000") as c:
        events = stream(c, prompt="KING", max_new_tokens="6", temperature="0.9", seed="3")
        ids = events[0]["prompt_ids"] + [e["id"] for e in events if "token" in e]
        response = c.post("/api/step", json={"ids": ids, "index": len(ids) - 1,
                                             "settings": {"temperature": "0.9"}})
        assert response.status_code == 200, response.json()
        step = response.json()
    assert [w is not None for w in step["weights"]] == drawn
    assert "deltanet has no attention weights to draw" in step["no_attention"]
    assert "\n" not in step["no_attention"] and ("layer 0:" in step["no_attention"]) == any(drawn)
    assert ids[-1] in [c[3] for c in step["candidates"]]
    assert sum(c[2] for c in step["candidates"]) <= 1 + 1e-4


def test_a_step_of_a_model_whose_logits_overflow_is_finite_json(tiny_run):
    """Finite weights scaled by 1e30 overflow to inf and NaN in the forward pass: the page's
    step said "internal error" (NaN is no JSON) and sampling was a multinomial traceback."""
    model, cfg, tokenizer, ckpt = load_run(tiny_run)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e30)
    with TestClient(create_app(Service(model, cfg, tokenizer, str(ckpt))),
                    base_url="http://127.0.0.1:8000") as c:
        events = stream(c, prompt="KING", max_new_tokens="5", top_p="0.9")
        ids = events[0]["prompt_ids"] + [e["id"] for e in events if "token" in e]
        assert len(ids) == len(events[0]["prompt_ids"]) + 5
        response = c.post("/api/step", json={"ids": ids, "index": len(ids) - 1, "settings": {}})
        assert response.status_code == 200, response.text
        assert all(0 <= b <= 1 and 0 <= a <= 1 for _, b, a, _ in response.json()["candidates"])
