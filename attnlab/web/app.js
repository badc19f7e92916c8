// The page of python -m attnlab.serve: plain JavaScript, no libraries, no network but
// this server. Tokens arrive as server-sent events; a click asks for their attention.
"use strict";
const $ = (id) => document.getElementById(id);
let info = null;        // /api/info
let running = null;     // the AbortController of the generation in progress
let ids = [];           // every token id so far: prompt, then generated
let steps = {};         // index -> the generated token's event
let settings = {};      // the sampling settings of the generation shown
let promptTokens = [];  // the prompt's tokens, as text

function show(text) {                    // newlines as \n, a lone space as ␣
  return text === " " ? "␣" : JSON.stringify(text).slice(1, -1);
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function errorText(response) {
  try { return (await response.json()).error; } catch (e) { return response.statusText; }
}

async function loadInfo() {
  info = await (await fetch("/api/info")).json();
  $("config").textContent = info.config;
  for (const [key, value] of Object.entries(info.defaults)) {
    if ($(key)) $(key).value = value;
  }
  document.querySelectorAll(".controls input[type=range]").forEach((input) => {
    const out = input.nextElementSibling;
    const update = () => { out.textContent = input.value; };
    input.addEventListener("input", update);
    update();
  });
  drawMask();
}

function stop(message) {
  if (running) { running.abort(); running = null; }     // the server ends the generation
  $("generate").disabled = false;
  $("stop").disabled = true;
  if (message !== undefined) setStatus(message);
}

async function generate() {
  stop();
  const params = new URLSearchParams();
  for (const key of ["prompt", "temperature", "top_k", "top_p", "max_new_tokens", "seed"]) {
    params.set(key, $(key).value);
  }
  settings = { temperature: $("temperature").value, top_k: $("top_k").value, top_p: $("top_p").value };
  $("output").textContent = "";
  $("details").hidden = true;
  ids = []; steps = {};
  setStatus("generating…");
  const mine = new AbortController();
  running = mine;
  $("generate").disabled = true;
  $("stop").disabled = false;
  let count = 0;
  const onEvent = (kind, item) => {
    if (kind === "done") { stop(`${count} tokens, done`); return; }
    if (kind === "error") { stop(); setStatus(item.error, true); return; }
    for (const event of item) {
      if (event.prompt_ids) {
        ids = event.prompt_ids.slice();
        promptTokens = event.prompt_tokens;
        const span = document.createElement("span");
        span.className = "prompt";
        span.textContent = event.prompt_tokens.join("");
        $("output").appendChild(span);
      } else if (event.token !== undefined) {
        ids.push(event.id);
        steps[event.index] = event;
        const span = document.createElement("span");
        span.className = "tok";
        span.dataset.index = event.index;
        span.textContent = event.token;
        span.title = `token ${event.index}`;
        span.addEventListener("click", () => select(span));
        $("output").appendChild(span);
        count += 1;
      }
    }
    setStatus(`${count} tokens`);
  };
  try {
    const response = await fetch("/api/generate?" + params.toString(), { signal: mine.signal });
    if (!response.ok) {
      const why = await errorText(response);           // before stop(), which aborts the body
      stop(); setStatus(why, true); return;
    }
    await readEvents(response, onEvent);
    if (running === mine) stop("the stream ended");
  } catch (err) {
    if (running === mine) { stop(); setStatus(`the stream broke: ${err.message}`, true); }
  }
}

// Server-sent events read from a fetch (not EventSource, which cannot show why a request
// was refused and reconnects by itself): blocks separated by a blank line, "event:" and
// "data:" lines. onEvent(kind, data) gets each block's data messages of one write
// together, so a burst of tokens is drawn once.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const blocks = buffer.split("\n\n");
    buffer = blocks.pop();
    let burst = [];
    for (const block of blocks) {
      let kind = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (kind === "message") { burst.push(JSON.parse(data)); continue; }
      if (burst.length) { onEvent("message", burst); burst = []; }
      onEvent(kind, JSON.parse(data));
    }
    if (burst.length) onEvent("message", burst);
  }
}

async function select(span) {
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
  span.classList.add("selected");
  const index = Number(span.dataset.index);
  const response = await fetch("/api/step", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ids: ids.slice(0, index + 1), index, settings }),
  });
  if (!response.ok) { setStatus(await errorText(response), true); return; }
  const att = await response.json();
  $("details").hidden = false;
  $("details-title").textContent = `token ${index}: "${show(steps[index].token)}"`;
  drawGrid(att);
  drawPieces(att);
  drawCandidates(att);
}

function heat(value) {                                   // 0 -> pale, 1 -> dark blue
  const v = Math.max(0, Math.min(1, value));
  return `rgb(${Math.round(247 - 200 * v)}, ${Math.round(251 - 170 * v)}, ${Math.round(255 - 90 * v)})`;
}

// The grid's colour scale, drawn once: each head's row is shaded against its own largest
// weight, so the scale runs from 0 to that, not to 1.
function drawScale() {
  const canvas = $("scale"), ctx = canvas.getContext("2d");
  for (let x = 0; x < canvas.width; x++) {
    ctx.fillStyle = heat(x / (canvas.width - 1));
    ctx.fillRect(x, 0, 1, canvas.height);
  }
}

// A layer whose mechanism keeps no weight per earlier token (DeltaNet, linear attention)
// comes as null, with the reason in no_attention; the candidates are drawn all the same.
function drawGrid(att) {
  const grid = $("grid"), note = $("no-attention");
  grid.innerHTML = "";
  $("enlarged").innerHTML = "";
  note.textContent = att.no_attention || "";
  note.hidden = !att.no_attention;
  const drawn = att.weights.flatMap((w, l) => (w ? [l] : []));
  if (!drawn.length) return;
  const layers = att.weights.length, heads = att.weights[drawn[0]].length;
  grid.style.gridTemplateColumns = `auto repeat(${heads}, auto)`;
  grid.appendChild(document.createElement("span"));
  for (let h = 0; h < heads; h++) {
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = `head ${h}`;
    grid.appendChild(label);
  }
  for (let l = 0; l < layers; l++) {
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = `layer ${l}`;
    grid.appendChild(label);
    if (!att.weights[l]) {
      const none = document.createElement("span");
      none.className = "label";
      none.style.gridColumn = `span ${heads}`;
      none.textContent = "no attention weights";
      grid.appendChild(none);
      continue;
    }
    for (let h = 0; h < heads; h++) {
      const row = att.weights[l][h];
      const canvas = document.createElement("canvas");
      canvas.className = "head";
      canvas.width = row.length;
      canvas.height = 1;
      canvas.style.width = "120px";
      canvas.style.height = "16px";
      const ctx = canvas.getContext("2d");
      const top = Math.max(...row) || 1;                // shaded relative to the head's maximum
      row.forEach((w, k) => { ctx.fillStyle = heat(w / top); ctx.fillRect(k, 0, 1, 1); });
      canvas.title = `layer ${l}, head ${h}`;
      canvas.addEventListener("click", () => enlarge(att, l, h));
      grid.appendChild(canvas);
    }
  }
  enlarge(att, drawn[drawn.length - 1], 0);
}

function enlarge(att, layer, head) {
  const box = $("enlarged");
  const chosen = new Set(((att.pieces || [])[layer] || {}).chosen || []);
  const outlined = chosen.size ? "; outlined: the keys the indexer chose, the only ones read" : "";
  box.innerHTML = `<div>layer ${layer}, head ${head}: weight on each earlier token (darkest = its largest; hover for the value${outlined})</div>`;
  const top = Math.max(...att.weights[layer][head]) || 1;
  att.weights[layer][head].forEach((w, k) => {
    const span = document.createElement("span");
    span.textContent = show(tokenAt(att.keys[k]));
    span.style.background = heat(w / top);
    span.title = `${(w * 100).toFixed(1)}%`;
    if (chosen.has(k)) span.className = "chosen-key";
    box.appendChild(span);
  });
}

// What each layer's model-card pieces did for this query, one line a layer: a learned
// sink's share of each head's row, each head's gate openness, how many keys the indexer
// chose and full attention's weight on them, the experts the token went to.
function drawPieces(att) {
  const box = $("pieces");
  box.querySelectorAll(".piece").forEach((p) => p.remove());
  const rows = (att.pieces || []).flatMap((p, l) => (p ? [[l, p]] : []));
  box.hidden = !rows.length;
  const perHead = (xs, fmt) => xs.map((x, h) => `head ${h}: ${fmt(x)}`).join(", ");
  const percent = (x) => `${(x * 100).toFixed(1)}%`;
  for (const [l, p] of rows) {
    const parts = [];
    if (p.sink) parts.push(`the sink's share of each head's row (${perHead(p.sink, percent)})`);
    if (p.gate) parts.push(`gate openness (${perHead(p.gate, (x) => x.toFixed(3))})`);
    if (p.chosen) parts.push(`the indexer chose ${p.chosen.length} of ${att.keys.length} keys; ` +
                             `full attention's weight on them (${perHead(p.full_on_chosen, percent)})`);
    if (p.experts) parts.push(`experts ${p.experts.map(([e, w]) => `${e} (weight ${w.toFixed(3)})`).join(", ")}`);
    const line = document.createElement("div");
    line.className = "piece";
    line.dataset.layer = l;
    line.textContent = `layer ${l}: ${parts.join("; ")}`;
    box.appendChild(line);
  }
}

function tokenAt(index) {
  return index < promptTokens.length ? promptTokens[index] : steps[index].token;
}

function drawCandidates(step) {
  const body = $("candidates").querySelector("tbody");
  body.innerHTML = "";
  step.candidates.forEach(([token, before, after, id]) => {
    const tr = document.createElement("tr");
    if (id === step.chosen) tr.className = "chosen";
    tr.innerHTML = `<td>${escapeHtml(show(token))}</td><td>${(before * 100).toFixed(1)}%</td><td>${(after * 100).toFixed(1)}%</td>`;
    tr.dataset.after = after;
    body.appendChild(tr);
  });
}

function escapeHtml(text) {
  return text.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// The colours of `python -m attnlab.figures masks`, so the page and the figure read alike.
const MAY_ATTEND = "#2171b5", HIDDEN = "#f7fbff";

function drawMask() {
  const canvas = $("mask"), m = info.mask, n = m.length;
  const ctx = canvas.getContext("2d"), cell = canvas.width / n;
  m.forEach((row, q) => row.forEach((ok, k) => {
    ctx.fillStyle = ok ? MAY_ATTEND : HIDDEN;
    ctx.fillRect(k * cell, q * cell, cell, cell);
  }));
}

async function search() {
  const response = await fetch("/api/search", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ text: $("search-text").value, from: $("search-from").value, to: $("search-to").value }),
  });
  const body = $("search-results").querySelector("tbody");
  body.innerHTML = "";
  if (!response.ok) { $("search-status").textContent = await errorText(response); return; }
  const result = await response.json();
  $("search-status").textContent = `"${show(result.query)}" looking at "${show(result.targets)}"`;
  result.ranking.forEach((r) => {
    const tr = document.createElement("tr");
    tr.innerHTML = `<td>${r.layer}</td><td>${r.head}</td><td>${r.weight.toFixed(3)}</td>`;
    body.appendChild(tr);
  });
}

function tab(name) {
  for (const other of ["generate", "mask"]) {
    $(`panel-${other}`).hidden = other !== name;
    $(`tab-${other}`).classList.toggle("active", other === name);
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => stop("stopped"));
$("search").addEventListener("click", search);
$("tab-generate").addEventListener("click", () => tab("generate"));
$("tab-mask").addEventListener("click", () => tab("mask"));
drawScale();
loadInfo();
