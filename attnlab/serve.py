"""A local web page to watch a model think: tokens appear as they are generated, and
for any token, what each head looked at and which candidates the sampler chose from.

    python -m attnlab.serve                       # the latest run, http://127.0.0.1:8000
    python -m attnlab.serve --run ./gpt2 --port 8080

Built on Starlette and uvicorn. Tokens stream as server-sent events from the same
generation code as sample.py (same seed and settings, same text). Clicking a token asks
what produced it: the attention of the query before it, computed then on the eager
path (so every backend can show it), and the candidates before and after temperature /
top-k / top-p, recomputed with the generation's settings; the stream stays as fast as
sample.py because it carries nothing else. The server listens on 127.0.0.1 unless --host says
otherwise, and says so when it does: the page has no login.

API (JSON errors are {"error": "..."} with status 400 or 422):
  GET  /api/info                     the model: config line, layers, heads, mask pattern
  GET  /api/generate?prompt=...&temperature=&top_k=&top_p=&max_new_tokens=&seed=
                                     text/event-stream: the prompt's ids, then for each
                                     token {"index", "id", "token"} and the text pieces
  POST /api/step {"ids": [...], "index": i, "settings": {temperature, top_k, top_p}}
                                     what produced token i: per layer and head, the
                                     weights its query gave each earlier token, and the
                                     candidates [[token, p_before, p_after, id]]
  POST /api/search {"text", "from", "to"}          attnlab.heads search, ranked
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from common.errors import AttnlabError
from engine.cli import Parser, add_run_options, errors_as_lines

WEB = Path(__file__).resolve().parent / "web"
MAX_NEW_TOKENS = 2000          # one request; the page's slider stops at 500
TOP = 8                        # candidates shown per step
BATCH_S = 0.02                 # steps made within this are sent together (still ~50 per second)


class BadRequest(AttnlabError):
    """Input the page (or a hand-made request) sent that cannot be used."""


class Service:
    """The loaded model and the work the routes ask of it. Every model call runs in one
    dedicated thread, so generation never blocks the event loop, two clients' streams
    take turns step by step, and only one OpenMP team of torch threads exists (a second
    one spinning beside it halved decoding speed on 2 cores)."""

    def __init__(self, model, cfg, tokenizer, origin: str):
        self.model, self.cfg, self.tokenizer, self.origin = model, cfg, tokenizer, origin
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run(self, fn, *args):
        """fn(*args) in the model thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    def info(self) -> dict:
        from model.mask import visible
        c = self.cfg.model
        T = min(c.block_size, 32)
        pos = torch.arange(T)
        pattern = visible(pos, pos, c.sliding_window, c.n_global, c.causal).int().tolist()
        window = f"window {c.sliding_window}" + (f" + {c.n_global} global" if c.n_global else "") \
            if c.sliding_window else "full causal" if c.causal else "bidirectional (an encoder)"
        return {"origin": self.origin, "layers": c.n_layer, "heads": c.n_head,
                "config": f"{c.attention} attention, {c.position} positions, {window}; "
                          f"{c.n_layer} layers x {c.n_head} heads, {c.n_embd} wide, context "
                          f"{c.block_size}, {self.model.num_params() / 1e6:.2f}M parameters",
                "mask": pattern, "defaults": _sample_defaults(self.cfg)}

    def settings(self, query: dict):
        """Sampling settings from the request, checked like sample.py's options."""
        from engine.config import RunConfig, apply_to
        self.model.check_generates()            # an encoder: the head search and mask tabs only
        unknown = set(query) - {"prompt", "temperature", "top_k", "top_p", "max_new_tokens", "seed"}
        if unknown:
            raise BadRequest(f"unknown parameter {sorted(unknown)[0]!r}")
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
        """A generator of events: the prompt, then each token (id, text) and the text
        pieces exactly as sample.py writes them."""
        from engine.inference import encode_prompt, stream_text
        ids = encode_prompt(self.tokenizer, sample.prompt)       # TokenizerError names characters
        drawn: list[int] = []
        yield {"prompt_ids": ids, "prompt_tokens": [self.tokenizer.decode([i]) for i in ids]}
        pieces = stream_text(self.model, self.tokenizer, ids, sample.max_new_tokens,
                             sample.temperature, sample.top_k, sample.top_p, sample.seed,
                             on_step=lambda logits, token: drawn.append(int(token[0, 0])))
        sent = 0
        for piece in [*pieces, None]:            # None: after the last piece, any tokens left
            for token in drawn[sent:]:
                yield {"index": len(ids) + sent, "id": token, "token": self.tokenizer.decode([token])}
                sent += 1
            if piece is not None:
                yield {"text": piece}

    @torch.no_grad()
    def step(self, ids: list[int], index: int, sample) -> dict:
        """What happened when token `index` was produced: the attention of the query
        before it (per layer, per head, over every token it could see, from the eager
        path, so every backend can show it) and the candidates it was drawn from, before
        and after temperature / top-k / top-p (recomputed: the same weights and
        settings as during generation)."""
        from model.sampling import next_token_distribution
        V = self.cfg.model.vocab_size
        if not (isinstance(ids, list) and all(isinstance(i, int) and 0 <= i < V for i in ids)):
            raise BadRequest(f"ids must be a list of token ids below {V}")
        if not (isinstance(index, int) and 1 <= index < len(ids)):
            raise BadRequest(f"index must point at a token after the first (1..{len(ids) - 1})")
        start = max(0, index - self.cfg.model.block_size)
        context = torch.tensor([ids[start:index]], device=next(self.model.parameters()).device)
        out = self.model(context, return_attention=True)
        logits = out.logits[:, -1].float()
        before = torch.softmax(logits[0], -1)
        after = next_token_distribution(logits, sample.temperature, sample.top_k, sample.top_p)[0]
        chosen = ids[index]
        top = torch.topk(before, min(TOP, before.numel())).indices.tolist()
        top += [chosen] if chosen not in top else []
        b, a = before.tolist(), after.tolist()
        return {"keys": list(range(start, index)), "chosen": chosen,
                "weights": [[[round(w, 5) for w in head.tolist()] for head in layer[0, :, -1].float()]
                            for layer in out.attentions],
                "candidates": [[self.tokenizer.decode([i]), round(b[i], 6), round(a[i], 6), i] for i in top]}

    def search(self, text: str, source: str, target: str) -> dict:
        from attnlab.heads import attention_maps, search, token_spans
        if not (isinstance(text, str) and text and source and target):
            raise BadRequest("search needs text, from and to")
        tokens, maps = attention_maps(self.model, self.tokenizer, text)
        ranking, query, targets = search(maps, text, token_spans(self.tokenizer, text), source, target)
        return {"query": tokens[query], "targets": "".join(tokens[t] for t in targets),
                "ranking": [{"layer": l, "head": h, "weight": round(w, 4)} for w, l, h in ranking[:10]]}


def _sample_defaults(cfg) -> dict:
    s = cfg.sample
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}


def create_app(service: Service):
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    def error(err, status=400):
        return JSONResponse({"error": str(err)}, status_code=status)

    async def body_of(request) -> dict:
        try:
            data = json.loads(await request.body())
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        return data

    async def index(request):
        return FileResponse(WEB / "index.html")

    async def info(request):
        return JSONResponse(service.info())

    async def generate(request):
        try:
            sample = service.settings(dict(request.query_params))
            steps = service.steps(sample)
            first = await service.run(next, steps, None)      # refusals come before streaming
        except (AttnlabError, ValueError) as err:
            return error(err)

        async def events():
            batch = [first]
            while batch:
                yield "".join(f"data: {json.dumps(item)}\n\n" for item in batch)
                if await request.is_disconnected():
                    steps.close()                    # the client left: stop generating
                    return
                batch = await service.run(_next_batch, steps)
            yield "event: done\ndata: {}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    async def step(request):
        try:
            data = await body_of(request)
            settings = data.get("settings", {})
            if not isinstance(settings, dict):
                raise BadRequest("settings must be an object: {temperature, top_k, top_p}")
            sample = service.settings({**settings, "prompt": "-"})
            return JSONResponse(await service.run(service.step, data.get("ids"), data.get("index"), sample))
        except (AttnlabError, ValueError) as err:
            return error(err)

    async def search(request):
        try:
            data = await body_of(request)
            return JSONResponse(await service.run(
                service.search, data.get("text"), data.get("from"), data.get("to")))
        except AttnlabError as err:
            return error(err)

    return Starlette(routes=[
        Route("/", index), Route("/api/info", info), Route("/api/generate", generate),
        Route("/api/step", step, methods=["POST"]),
        Route("/api/search", search, methods=["POST"]),
        Mount("/static", StaticFiles(directory=WEB)),
    ], exception_handlers={ValueError: lambda request, err: error(err)})


def _next_batch(steps, seconds: float = BATCH_S) -> list:
    """The steps a generation makes in the next `seconds` (at least one; empty at the
    end): one hop to the model thread and one write per batch instead of per token."""
    out, start = [], time.perf_counter()
    while not out or time.perf_counter() - start < seconds:
        item = next(steps, None)
        if item is None:
            break
        out.append(item)
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parser() -> Parser:
    p = Parser("python -m attnlab.serve", __doc__)
    add_run_options(p, "run directory, checkpoint or transformers folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from engine.checkpoint import latest_run
    from engine.device import pick_device, pick_dtype
    from engine.inference import load_run
    device = pick_device(args.device)
    model, cfg, tokenizer, ckpt = load_run(args.run or latest_run(), args.checkpoint, device)
    model = model.to(pick_dtype(cfg.sample.dtype, device, cfg.model.n_embd, decoding=True))
    # Decoding one token reads every weight once and does little arithmetic: one torch
    # thread decodes as fast as two here (255 and 257 tokens/s at 6 x 384, 45 and 45 at
    # 12 x 768, batch 1 on 2 cores), and leaves a core to the server.
    if device.type == "cpu":
        torch.set_num_threads(1)
    if not is_loopback(args.host):
        print(f"warning: listening on {args.host}, not only this machine: anyone who can reach "
              "it can use the model, and the page has no login", file=sys.stderr)
    import uvicorn
    print(f"serving {ckpt} at http://{args.host}:{args.port} (Ctrl-C to stop)", flush=True)
    uvicorn.run(create_app(Service(model, cfg, tokenizer, str(ckpt))), host=args.host,
                port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
