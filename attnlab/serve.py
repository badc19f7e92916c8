"""A local web page to watch a model think: tokens appear as they are generated, and
for any token, what each head looked at and which candidates the sampler chose from.

    python -m attnlab.serve                       # the latest run, http://127.0.0.1:8000
    python -m attnlab.serve --run ./gpt2 --port 8080

Built on Starlette and uvicorn. Tokens stream as server-sent events from the same
generation code as sample.py (same seed and settings, same text), each sent as soon as
it is drawn; clients take turns on the model a token at a time, and one that leaves
(the page's Stop) ends its generation. Clicking a token asks what produced it: the
attention of the query before it, computed then on the eager path (so every backend can
show it), and the candidates before and after temperature / top-k / top-p, recomputed
with the generation's settings; the stream stays as fast as sample.py because it
carries nothing else.

The page has no login, so it guards its door as Jupyter does: it listens on 127.0.0.1
and answers only this machine's names (localhost, 127.0.0.1, [::1]) unless --host says
otherwise, and says so when it does; a request from another site's page is refused, a
POST must be JSON, and every input has a cap.

API (JSON errors are {"error": "..."} with status 400, 403, 413 or 415):
  GET  /api/info                     the model: config line, layers, heads, mask pattern
  GET  /api/generate?prompt=...&temperature=&top_k=&top_p=&max_new_tokens=&seed=
                                     text/event-stream: the prompt's ids, then for each
                                     token {"index", "id", "token"} and the text pieces;
                                     "event: done" at the end ("event: error" if it failed)
  POST /api/step {"ids": [...], "index": i, "settings": {temperature, top_k, top_p}}
                                     what produced token i: per layer and head, the
                                     weights its query gave each earlier token (null for a
                                     layer with none, and "no_attention" says why), the
                                     candidates [[token, p_before, p_after, id]], and per
                                     layer what its pieces did for that query ("pieces":
                                     sink, gate, chosen, full_on_chosen, experts; null for
                                     a layer with none: attnlab/pieces.py, at_query)
  POST /api/search {"text", "from", "to"}          attnlab.heads search, ranked
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import ipaddress
import json
import socket
import sys
import threading
import traceback
from pathlib import Path
from urllib.parse import urlsplit

import torch

from common.errors import AttnlabError, ConfigError
from attnlab.options import add_run_options, load
from engine.cli import Parser, errors_as_lines
from model import ModelError

WEB = Path(__file__).resolve().parent / "web"
MAX_NEW_TOKENS = 2000          # one request; the page's slider stops at 500
MAX_TEXT = 10_000              # characters of a prompt or a searched text
MAX_SEARCH_TOKENS = 512        # a search keeps every head's (T, T) map: T^2 memory and time
MAX_IDS = 50_000               # token ids sent back to /api/step (a long prompt + MAX_NEW_TOKENS)
MAX_WORD = 200                 # characters of search's "from" and "to"
PAGE_SEARCH_FIELDS = ('"from"', '"to"')   # a refusal names the page's fields, not --from/--to
MAX_BODY = 512 * 1024          # bytes of a POST body; MAX_IDS ids fit in about 350 KB
TOP = 8                        # candidates shown per step
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
USER_ERRORS = (AttnlabError, ModelError, ValueError)


class ServerStopping(AttnlabError):
    def __init__(self):
        super().__init__("the server was stopped (Ctrl-C); start it again to go on")


def layers(numbers) -> str:
    """'layer 2' or 'layers 0, 2'."""
    return f"layer{'s' * (len(numbers) > 1)} {', '.join(map(str, numbers))}"


class BadRequest(AttnlabError):
    """Input the page (or a hand-made request) sent that cannot be used."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ModelThread:
    """Every model call runs in this one thread, so only one OpenMP team of torch
    threads exists (a second one spinning beside it halved decoding speed on 2 cores)
    and the event loop never waits for the model. Work takes turns, round-robin: each
    live generation makes one token step per turn and a one-off call (a click's
    attention, a search) takes one turn, so a short request behind long ones finishes
    in a few of their steps instead of after them."""

    def __init__(self):
        self.turns: collections.deque = collections.deque()
        self.ready = threading.Condition()
        self.streams: set[Stream] = set()      # generations not yet finished or stopped
        self.closed = False
        threading.Thread(target=self._loop, name="model", daemon=True).start()

    def _add(self, turn) -> None:
        with self.ready:
            self.turns.append(turn)
            self.ready.notify()

    def _loop(self) -> None:
        while True:
            with self.ready:
                while not self.turns and not self.closed:
                    self.ready.wait()
                if self.closed:
                    return
                turn = self.turns.popleft()
            if turn():                         # it wants another turn: to the back
                self._add(turn)

    async def call(self, fn, *args):
        """fn(*args) in the model thread, awaited."""
        future = concurrent.futures.Future()

        def turn() -> bool:
            if future.set_running_or_notify_cancel():     # False: the caller left
                try:
                    future.set_result(fn(*args))
                except BaseException as err:              # the thread lives on: see survivable
                    future.set_exception(survivable(err))
            return False
        self._add(turn)
        return await asyncio.wrap_future(future)

    def stream(self, steps) -> "Stream":
        """Runs the generator `steps` one item per turn; its items arrive in the
        returned Stream's queue as they are made."""
        stream = Stream(self, steps, asyncio.get_running_loop())
        self.streams.add(stream)
        self._add(stream.turn)
        return stream

    def end_streams(self) -> None:
        """Ends every generation and its stream (the server is stopping): each client
        gets an error event saying so, and the server need not wait for them."""
        for stream in list(self.streams):
            stream.stop()
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ServerStopping())

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify()


def survivable(err: BaseException) -> Exception:
    """What the model thread hands its caller for `err`: an Exception as it is; anything
    else (a Rust library's panic arrives as pyo3's PanicException, a BaseException) as a
    RuntimeError naming it. Letting it through would end the model thread, and every
    request after it would wait for ever, Ctrl-C's included."""
    if isinstance(err, Exception):
        return err
    wrapped = RuntimeError(f"{type(err).__name__}: {err}")
    wrapped.__cause__ = err
    return wrapped


class Stream:
    """One generation on its way to its client: the model thread puts each step's events
    in `queue` as soon as they are made (a list, then END or the exception that ended
    it), and the event loop sends whatever has piled up since its last write, so a slow
    client never holds up the model and a fast one gets every token at once."""
    END = "end"

    def __init__(self, owner: ModelThread, steps, loop):
        self.owner, self.steps, self.loop = owner, steps, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped = False                   # set by the event loop when the client leaves

    def turn(self) -> bool:
        if self.stopped:
            self.steps.close()                 # ends generation where it is
            self.owner.streams.discard(self)
            return False
        more = True
        try:
            item = next(self.steps)
        except StopIteration:
            item, more = self.END, False
        except BaseException as err:           # the thread lives on: see survivable
            item, more = survivable(err), False
        if not more:
            self.owner.streams.discard(self)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:                   # the event loop is gone: the server stopped
            self.steps.close()
            self.owner.streams.discard(self)
            return False
        return more

    async def take(self) -> list:
        """Everything made since the last take, waiting for at least one item."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def stop(self) -> None:
        self.stopped = True


class Service:
    """The loaded model and the work the routes ask of it, all run in one ModelThread."""

    def __init__(self, model, cfg, tokenizer, origin: str):
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        base = public_base(origin)
        self.origin = str(Path(origin).resolve().relative_to(base))
        folders = {str(base): ".", str(Path.cwd().resolve()): ".", str(Path.home()): "~"}
        self.hidden = sorted(((f, n) for f, n in folders.items() if len(Path(f).parts) > 1),
                             key=lambda kv: -len(kv[0]))          # never the root folder itself
        self.thread = ModelThread()

    async def run(self, fn, *args):
        """fn(*args) in the model thread, awaited."""
        return await self.thread.call(fn, *args)

    def public(self, message: str) -> str:
        """A message as the page may show it: folders above the model's named relatively."""
        for folder, name in self.hidden:
            message = message.replace(folder + "/", "" if name == "." else name + "/")
            message = message.replace(folder, name)
        return message

    def info(self) -> dict:
        from attnlab.capture import other_paths
        from model.attention import visible
        c = self.cfg.model
        T = min(c.block_size, 32)
        pos = torch.arange(T)
        pattern = visible(pos, pos, c.sliding_window, c.n_global, c.causal).int().tolist()
        window = f"window {c.sliding_window}" + (f" + {c.n_global} global" if c.n_global else "") \
            if c.sliding_window else "full causal" if c.causal else "bidirectional (an encoder)"
        return {"origin": self.origin, "layers": c.n_layer, "heads": c.n_head,
                "config": f"{c.mechanism} mechanism, {c.attention} attention, {c.position} "
                          f"positions, {window}; "
                          f"{c.n_layer} layers x {c.n_head} heads, {c.n_embd} wide, context "
                          f"{c.block_size}, {self.model.num_params() / 1e6:.2f}M parameters"
                          + (f"; {other_paths(c)}" if other_paths(c) else ""),
                "mask": pattern, "defaults": _sample_defaults(self.cfg)}

    def settings(self, query: dict):
        """Sampling settings from the request, checked like sample.py's options."""
        from engine.config import RunConfig, apply_to
        self.model.check_generates()            # an encoder: the head search and mask tabs only
        unknown = set(query) - {"prompt", "temperature", "top_k", "top_p", "max_new_tokens", "seed"}
        if unknown:
            raise BadRequest(f"unknown parameter {_short(sorted(unknown)[0])!r}")
        for key, value in query.items():
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise BadRequest(f"{key} must be a number or a string, not {type(value).__name__}")
            if isinstance(value, str) and len(value) > (MAX_TEXT if key == "prompt" else 40):
                raise BadRequest(f"{key} is over {MAX_TEXT if key == 'prompt' else 40:,} characters",
                                 413)
        sample = RunConfig().sample
        sample.max_new_tokens = 100
        apply_to(sample, "sample", dict(query), "the request")
        RunConfig(sample=sample).validate()
        if sample.max_new_tokens > MAX_NEW_TOKENS:
            raise BadRequest(f"max_new_tokens={sample.max_new_tokens} is over this server's cap "
                             f"of {MAX_NEW_TOKENS}")
        if not sample.prompt:
            raise BadRequest("the prompt is empty: type some text to continue")
        return sample

    def steps(self, sample):
        """A generator with one list of events per step: the prompt's, then each token
        (index, id, text) as soon as it is drawn, with the text pieces exactly as
        sample.py writes them."""
        from engine.inference import encode_prompt, stream_text
        ids = encode_prompt(self.tokenizer, sample.prompt)       # TokenizerError names characters
        drawn: list[int] = []
        yield [{"prompt_ids": ids, "prompt_tokens": [self.tokenizer.decode([i]) for i in ids]}]
        pieces = stream_text(self.model, self.tokenizer, ids, sample.max_new_tokens,
                             sample.temperature, sample.top_k, sample.top_p, sample.seed,
                             on_step=lambda logits, token: drawn.append(int(token[0, 0])))
        sent = 0

        def tokens():
            nonlocal sent
            new = [{"index": len(ids) + i, "id": t, "token": self.tokenizer.decode([t])}
                   for i, t in enumerate(drawn[sent:], start=sent)]
            sent = len(drawn)
            return new
        for piece in pieces:      # a piece comes with the token that completed its characters
            yield tokens() + [{"text": piece}]
        if drawn[sent:]:
            yield tokens()

    @torch.no_grad()
    def step(self, ids: list[int], index: int, sample) -> dict:
        """What happened when token `index` was produced: the attention of the query
        before it (per layer, per head, over every token it could see, from the eager
        path, so every backend can show it) and the candidates it was drawn from, before
        and after temperature / top-k / top-p (recomputed: the same weights and
        settings as during generation). A layer whose mechanism keeps no weight per earlier
        token (DeltaNet, linear attention) reads null, and `no_attention` says why in one
        line; the candidates are there all the same."""
        from attnlab.capture import no_weights, pieces_of, run_with_cache, weightless_layers
        from attnlab.pieces import at_query
        from model.sampling import next_token_distribution
        V = self.cfg.model.vocab_size
        if not (isinstance(ids, list) and len(ids) <= MAX_IDS
                and all(type(i) is int and 0 <= i < V for i in ids)):     # bool is an int too
            raise BadRequest(f"ids must be a list of at most {MAX_IDS:,} token ids below {V}")
        if len(ids) < 2:
            raise BadRequest("ids must hold the token asked about and at least one before it")
        if not (type(index) is int and 1 <= index < len(ids)):
            raise BadRequest(f"index must point at a token after the first (1..{len(ids) - 1})")
        start = max(0, index - self.cfg.model.block_size)
        context = torch.tensor([ids[start:index]], device=next(self.model.parameters()).device)
        skipped = weightless_layers(self.cfg.model)
        L = self.cfg.model.n_layer
        # One pass reads the weights of the layers that have them and what each layer's
        # model-card pieces did (a sink's share, the gates, the indexer's keys, the experts).
        wanted = [f"blocks.{l}.pattern" for l in range(L) if l not in skipped]
        wanted += [f"blocks.{l}.{n}" for l in range(L) for n in pieces_of(self.model, l)]
        logits, cache = run_with_cache(self.model, context, only=wanted)
        maps = [cache.get(f"blocks.{l}.pattern") for l in range(L)]
        why = no_weights(self.cfg.model)
        if why and len(skipped) < self.cfg.model.n_layer:
            why = f"{layers(skipped)}: {why}"
        # Weights that overflowed are no picture (and NaN is no JSON): said, not drawn.
        broken = [l for l, m in enumerate(maps) if m is not None and not m[0, :, -1].isfinite().all()]
        if broken:
            maps = [None if l in broken else m for l, m in enumerate(maps)]
            why = "; ".join(filter(None, [why, f"{layers(broken)}: the weights overflowed to "
                                          "inf or NaN (the model's numbers are out of float range)"]))
        logits = logits[:, -1].float()
        before = next_token_distribution(logits, 1.0)[0]     # softmax, kept finite if logits overflowed
        after = next_token_distribution(logits, sample.temperature, sample.top_k, sample.top_p)[0]
        chosen = ids[index]
        top = torch.topk(before, min(TOP, before.numel())).indices.tolist()
        top += [chosen] if chosen not in top else []
        b, a = before.tolist(), after.tolist()
        return {"keys": list(range(start, index)), "chosen": chosen,
                "weights": [None if layer is None else
                            [[round(w, 5) for w in head.tolist()] for head in layer[0, :, -1].float()]
                            for layer in maps],
                "no_attention": why,
                "pieces": at_query(cache, self.model, -1, index - start),
                "candidates": [[self.tokenizer.decode([i]), round(b[i], 6), round(a[i], 6), i] for i in top]}

    def check_search(self, text, source, target) -> None:
        """Refuses, before any model work, a search the page could not have sent."""
        if not all(isinstance(s, str) for s in (text, source, target)) or not (text and source and target):
            raise BadRequest("search needs text, from and to, each a non-empty string")
        if len(text) > MAX_TEXT:
            raise BadRequest(f"the text is {len(text):,} characters; search reads at most {MAX_TEXT:,}", 413)
        if max(len(source), len(target)) > MAX_WORD:
            raise BadRequest(f"from and to are words of the text: at most {MAX_WORD} characters each", 413)

    @torch.no_grad()
    def search(self, text: str, source: str, target: str) -> dict:
        from attnlab.capture import attention_maps
        from attnlab.heads import search, token_spans
        self.check_search(text, source, target)
        limit = min(self.cfg.model.block_size, MAX_SEARCH_TOKENS)
        n = len(self.tokenizer.encode(text))
        if n > limit:
            raise BadRequest(f"the text is {n} tokens; this page searches at most {limit} (a "
                             "search keeps every head's attention over the whole text)", 413)
        # A hybrid's layers without weights are skipped, as heads search skips them.
        tokens, maps = attention_maps(self.model, self.tokenizer, text, per_layer=True)
        ranking, query, targets = search(maps, text, token_spans(self.tokenizer, text), source, target,
                                         fields=PAGE_SEARCH_FIELDS)
        return {"query": tokens[query], "targets": "".join(tokens[t] for t in targets),
                "ranking": [{"layer": l, "head": h, "weight": round(w, 4)} for w, l, h in ranking[:10]]}


def public_base(path: str) -> Path:
    """The folder a model's path is named from on the page: the working directory if
    the model is inside it, else the folder that holds its run (or its transformers
    folder), so the page shows `run/checkpoints/step` or `folder`. The page never shows
    an absolute path: whoever reaches it would learn the user's name and folders."""
    p, cwd = Path(path).resolve(), Path.cwd().resolve()
    if p.is_relative_to(cwd) and p != cwd:
        return cwd
    run = p.parent.parent if p.parent.name == "checkpoints" else p
    return run.parent if len(run.parts) > 1 else run


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _sample_defaults(cfg) -> dict:
    s = cfg.sample
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}


def create_app(service: Service, allowed_hosts=LOOPBACK_HOSTS):
    """The Starlette app. Like Jupyter and other local servers, it answers only requests
    whose Host is one of `allowed_hosts` (this machine's names unless --host says
    otherwise: a site that points its own name at 127.0.0.1 cannot read the page), refuses
    a request from a page of another site, and reads POST bodies only as JSON (a form or
    text/plain POST is what a foreign page can send without asking)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def index(request):
        return FileResponse(WEB / "index.html")

    return Starlette(routes=[
        Route("/", index), *_api_routes(service),
        Mount("/static", StaticFiles(directory=WEB)),
    ], middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
                   Middleware(SameOrigin)],
        exception_handlers={Exception: lambda request, err: JSONResponse(
            {"error": _internal_message(err)}, status_code=500)})


def _api_routes(service: Service) -> list:
    """/api/info, /api/generate, /api/step and /api/search. A user's mistake is a JSON
    error with its status; anything else is a 500 whose traceback stays in the terminal."""
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(err, status=None):
        status = status or getattr(err, "status", 400)
        return JSONResponse({"error": service.public(str(err))}, status_code=status)

    def internal(request, err):
        traceback.print_exception(err, file=sys.stderr)
        return JSONResponse({"error": _internal_message(err)}, status_code=500)

    async def info(request):
        return JSONResponse(service.info())

    async def generate(request):
        try:
            sample = service.settings(dict(request.query_params))
        except USER_ERRORS as err:
            return error(err)
        stream = service.thread.stream(service.steps(sample))
        try:
            first = await stream.queue.get()      # refusals (a prompt it cannot encode) come first
        except BaseException:
            stream.stop()
            raise
        if isinstance(first, Exception):
            return error(first) if isinstance(first, USER_ERRORS) else internal(request, first)
        return StreamingResponse(_event_stream(service, stream, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def step(request):
        try:
            data = await _json_body(request)
            settings = data.get("settings", {})
            if not isinstance(settings, dict):
                raise BadRequest("settings must be an object: {temperature, top_k, top_p}")
            sample = service.settings({**settings, "prompt": "-"})
            return JSONResponse(await service.run(service.step, data.get("ids"), data.get("index"), sample))
        except USER_ERRORS as err:
            return error(err)

    async def search(request):
        try:
            data = await _json_body(request)
            args = data.get("text"), data.get("from"), data.get("to")
            service.check_search(*args)                  # before waiting for the model's turn
            return JSONResponse(await service.run(service.search, *args))
        except USER_ERRORS as err:
            return error(err)

    return [Route("/api/info", info), Route("/api/generate", generate),
            Route("/api/step", step, methods=["POST"]),
            Route("/api/search", search, methods=["POST"])]


async def _json_body(request) -> dict:
    """The POST body as a JSON object; anything else (not JSON, too big, not an object)
    is refused, since a form or text/plain POST is what a foreign page can send."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise BadRequest("send the body as JSON, with Content-Type: application/json", 415)
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise BadRequest(f"the request body is over {MAX_BODY // 1024} KB", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise BadRequest(f"the request body is over {MAX_BODY // 1024} KB", 413)
    try:
        data = json.loads(body)
    except RecursionError:
        raise BadRequest("the request body nests too deeply") from None
    except ValueError:
        raise BadRequest("the request body is not JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


async def _event_stream(service: Service, stream, first):
    """/api/generate's server-sent events, starting with `first`, until the end, an
    error or the client leaving."""
    try:
        yield _sse(service, first)
        while True:
            items = await stream.take()
            # The first item that is not a list of events (the end, an error, the
            # server stopping) ends the stream; a step made meanwhile is dropped.
            last = next((i for i, item in enumerate(items) if not isinstance(item, list)), None)
            yield "".join(_sse(service, item) for item in (items if last is None else items[:last + 1]))
            if last is not None:
                return
    finally:                 # the client left (or the stream ended): stop generating
        stream.stop()


def _sse(service: Service, item) -> str:
    """One item of the generation as server-sent event text: a list of events, the end,
    or an error (a user's mistake in its own words, anything else named only)."""
    if isinstance(item, list):
        return "".join(f"data: {json.dumps(event)}\n\n" for event in item)
    if item is Stream.END:
        return "event: done\ndata: {}\n\n"
    if not isinstance(item, USER_ERRORS):
        traceback.print_exception(item, file=sys.stderr)
    message = str(item) if isinstance(item, USER_ERRORS) else _internal_message(item)
    return f"event: error\ndata: {json.dumps({'error': service.public(message)})}\n\n"


def _internal_message(err) -> str:
    return f"internal error ({type(err).__name__}); the server's terminal shows what happened"


class SameOrigin:
    """ASGI middleware: a request a browser sends from a page of another site (its
    Origin is not this server's own, or for the API its Sec-Fetch-Site says cross-site
    or same-site, as a page on another port of this machine is) gets 403, as Jupyter
    refuses cross-origin API requests. Scripts and curl send neither header and pass."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse
            headers = Headers(scope=scope)
            origin, site = headers.get("origin"), headers.get("sec-fetch-site", "")
            foreign = origin is not None and not same_origin(origin, headers.get("host", ""))
            if foreign or (scope["path"].startswith("/api/") and site in ("cross-site", "same-site")):
                response = JSONResponse({"error": "this page answers only its own pages: open it "
                                                  "at the address the server printed"}, 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def same_origin(origin: str, host: str) -> bool:
    """Whether an Origin header (scheme://host[:port]) names the server at `host`."""
    try:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower() != ""
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> list[str]:
    """The Host names the server answers: this machine's loopback names, and the name
    or address given with --host; any name when it listens on every interface (0.0.0.0
    or ::), since a visitor then reaches it by a name it cannot know."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return ["*"]
        literal = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        literal = host.lower()
    return LOOPBACK_HOSTS + ([literal] if literal not in LOOPBACK_HOSTS else [])


def port_number(text: str) -> int:
    """--port: a TCP port, 1-65535."""
    import argparse
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), not {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), not {port}")
    return port


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or one ConfigError line saying why not (a name that
    does not resolve, a port in use or reserved)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as err:         # gaierror is an OSError; "a..b" fails IDNA
        raise ConfigError(f"--host {host!r} is not an address or a name this machine can "
                          f"resolve ({err}); use 127.0.0.1 (this machine only) or 0.0.0.0 "
                          "(every interface)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        advice = {errno.EADDRINUSE: "something else uses it: choose another --port",
                  errno.EACCES: "ports below 1024 need root: choose another --port",
                  errno.EADDRNOTAVAIL: "that address is not this machine's: use 127.0.0.1 "
                                       "(this machine only) or 0.0.0.0 (every interface)"}
        raise ConfigError(f"cannot listen on {host} port {port} ({err.strerror or err}); "
                          + advice.get(err.errno, "choose another --host or --port")) from None
    return sock


def parser() -> Parser:
    p = Parser("python -m attnlab.serve", __doc__)
    add_run_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "this machine only); the page answers requests for this name and localhost")
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sock = listen(args.host, args.port)            # a bad --host or --port before the model loads
    from engine.device import pick_device, pick_dtype
    from engine.machine import DECODE_THREADS, use_threads
    device = pick_device(args.device)
    model, cfg, tokenizer, ckpt = load(args)
    model = model.to(pick_dtype(cfg.sample.dtype, device, cfg.model.n_embd, decoding=True))
    if device.type == "cpu":             # decoding gains nothing from more threads
        use_threads(DECODE_THREADS)
    if not is_loopback(args.host):
        print(f"warning: listening on {args.host}, not only this machine: anyone who can reach "
              "it can use the model, and the page has no login", file=sys.stderr)
    import uvicorn
    service = Service(model, cfg, tokenizer, str(ckpt))
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C ends the streams in progress: uvicorn waits for every response to
            # finish, which could be MAX_NEW_TOKENS more tokens away.
            service.thread.end_streams()
            super().handle_exit(sig, frame)
    config = uvicorn.Config(create_app(service, allowed_hosts(args.host)), host=args.host,
                            port=args.port, log_level="warning")
    print(f"serving {ckpt} at http://{args.host}:{args.port} (Ctrl-C to stop)", flush=True)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:              # uvicorn raises Ctrl-C again once it has stopped
        pass
    print("stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
