// tinylm playground: plain JavaScript, talking to the server's own API (no CDN, works offline).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, tokens: [], controller: null, promptText: "", generatedText: "" };

// ------------------------------------------------------------------------------ API helpers
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, body) {
  const opts = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const resp = await fetch(path, opts);
  const data = await resp.json();
  if (!resp.ok) throw new Error(data.error ? data.error.message : resp.statusText);
  return data;
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = "status" + (isError ? " error" : "");
}

// Server-sent events from a POST: call onChunk for every `data: {...}` until `data: [DONE]`.
async function streamCompletion(body, onChunk, signal) {
  const resp = await fetch("/v1/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!resp.ok) {
    const data = await resp.json();
    throw new Error(data.error ? data.error.message : resp.statusText);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk);
    }
  }
}

// ------------------------------------------------------------------------------ the knobs
function numberOrNull(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function knobs() {
  const body = {
    model: state.model,
    prompt: $("prompt").value,
    max_tokens: numberOrNull("max_tokens"),
    temperature: numberOrNull("temperature"),
    top_p: numberOrNull("top_p"),
    repetition_penalty: numberOrNull("repetition_penalty"),
    no_repeat_ngram_size: numberOrNull("no_repeat_ngram_size"),
    min_new_tokens: numberOrNull("min_new_tokens"),
    seed: numberOrNull("seed"),
    beam_width: numberOrNull("beam_width"),
    length_penalty: numberOrNull("length_penalty"),
    top_k: numberOrNull("top_k"),
    min_p: numberOrNull("min_p"),
  };
  const stop = $("stop").value;
  if (stop) body.stop = stop.split(",").map((s) => s.replace(/\\n/g, "\n")).filter((s) => s);
  for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
  return body;
}

// ------------------------------------------------------------------------------ token chips
const shown = (text) => text.replace(/\n/g, "\u21b5\n");

// A chip's background: more probable = more saturated blue.
function chip(text, logprob) {
  const span = document.createElement("span");
  span.className = "chip";
  span.textContent = shown(text);
  const p = logprob === null || logprob === undefined ? 0 : Math.exp(logprob);
  span.style.background = `rgba(37, 102, 201, ${(0.08 + 0.62 * p).toFixed(3)})`;
  span.title = logprob === null || logprob === undefined ? "" : `p = ${p.toFixed(4)}  (log p = ${logprob.toFixed(3)})`;
  return span;
}

// Click, or Enter / Space once focused: mouse and keyboard reach the same action.
function onActivate(el, action) {
  el.tabIndex = 0;
  if (!/^(BUTTON|A)$/.test(el.tagName)) el.setAttribute("role", "button");
  el.addEventListener("click", action);
  el.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" && event.key !== " ") return;
    event.preventDefault();
    action();
  });
}

function showAlternatives(index) {
  const t = state.tokens[index];
  document.querySelectorAll("#output .chip").forEach((el) => el.classList.toggle("selected", Number(el.dataset.index) === index));
  const list = $("alternatives");
  list.innerHTML = "";
  for (const { token: text, logprob } of t.top || []) {
    const li = document.createElement("li");
    const p = Math.exp(logprob);
    li.innerHTML = `<span class="bar" style="width:${Math.max(2, 120 * p)}px"></span>`;
    li.appendChild(document.createTextNode(`${JSON.stringify(text)}  ${(100 * p).toFixed(2)}%`));
    if (text === t.text) li.classList.add("chosen");  // the token that was picked
    list.appendChild(li);
  }
}

// ------------------------------------------------------------------------------ generate
async function generate() {
  const body = knobs();
  const out = $("output");
  out.innerHTML = "";
  $("alternatives").innerHTML = "";
  $("warnings").textContent = "";
  state.tokens = [];
  state.promptText = body.prompt;
  state.generatedText = "";
  const head = document.createElement("span");
  head.className = "prompt-text";
  head.textContent = body.prompt;
  out.appendChild(head);
  $("generate").disabled = true;
  $("stop-generation").disabled = false;
  state.controller = new AbortController();
  const t0 = performance.now();
  let firstTokenMs = null;
  try {
    if (body.beam_width > 1) {  // beam search cannot stream: one response at the end
      const data = await api("/v1/completions", { ...body, logprobs: 10 });
      const c = data.choices[0];
      state.generatedText = c.text;
      c.logprobs.tokens.forEach((text, i) => addToken(text, c.logprobs.token_logprobs[i], c.logprobs.tinylm_top[i]));
      showWarnings(data.warnings);
    } else {
      await streamCompletion({ ...body, stream: true, logprobs: 10 }, (chunk) => {
        showWarnings(chunk.choices[0].warnings);
        state.generatedText += chunk.choices[0].text;  // the text pieces join to the continuation
        const lp = chunk.choices[0].logprobs;
        if (!lp) return;
        if (firstTokenMs === null) firstTokenMs = performance.now() - t0;
        lp.tokens.forEach((text, i) => addToken(text, lp.token_logprobs[i], lp.tinylm_top[i]));
      }, state.controller.signal);
    }
    const seconds = (performance.now() - t0) / 1000;
    $("gen-info").textContent = `${state.tokens.length} tokens in ${seconds.toFixed(2)} s` +
      (firstTokenMs !== null ? `, first token after ${firstTokenMs.toFixed(0)} ms` : "");
  } catch (err) {
    if (err.name !== "AbortError") $("gen-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    $("generate").disabled = false;
    $("stop-generation").disabled = true;
  }
}

function addToken(text, logprob, top) {
  const index = state.tokens.length;
  state.tokens.push({ text, logprob, top });
  const span = chip(text, logprob);
  span.dataset.index = index;
  onActivate(span, () => showAlternatives(index));
  $("output").appendChild(span);
}

function showWarnings(list) {
  if (list && list.length) $("warnings").textContent = "\u26a0 " + list.join("; ");
}

function escapeHtml(s) {
  return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// ------------------------------------------------------------------------------ attention
// viridis-like ramp from dark blue (0) to yellow (1)
function heat(v) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(1, Math.max(0, v)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
}

function drawMap(canvas, w, cell, labels) {
  const T = w.length;
  const margin = labels ? 90 : 0;
  canvas.width = margin + T * cell;
  canvas.height = margin + T * cell;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let q = 0; q < T; q++) {
    for (let k = 0; k < T; k++) {
      if (k > q) ctx.fillStyle = "#d9d9d9";  // the future: masked out
      else { const [r, g, b] = heat(w[q][k]); ctx.fillStyle = `rgb(${r},${g},${b})`; }
      ctx.fillRect(margin + k * cell, margin + q * cell, cell, cell);
    }
  }
  if (!labels) return;
  ctx.fillStyle = "#1d232a";
  ctx.font = `${Math.min(12, cell - 2)}px monospace`;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  labels.forEach((label, i) => ctx.fillText(label.slice(0, 10), margin - 4, margin + (i + 0.5) * cell));  // queries
  labels.forEach((label, i) => {  // keys, written upwards
    ctx.save();
    ctx.translate(margin + (i + 0.5) * cell, margin - 4);
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    ctx.fillText(label.slice(0, 10), 0, 0);
    ctx.restore();
  });
}

async function showAttention() {
  const typed = $("attention-text").value;
  const text = typed || (state.promptText + state.generatedText) || $("prompt").value;
  $("attention-info").textContent = "computing...";
  try {
    const data = await api("/v1/attention", { model: state.model, text });
    const grid = $("attention-grid");
    grid.innerHTML = "";
    grid.style.gridTemplateColumns = `auto repeat(${data.n_heads}, auto)`;
    const T = data.tokens.length;
    const cell = Math.max(2, Math.floor(96 / T));
    grid.appendChild(document.createElement("span"));
    for (let h = 0; h < data.n_heads; h++) {
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = `head ${h}`;
      grid.appendChild(label);
    }
    data.weights.forEach((layer, l) => {
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = `layer ${l}`;
      grid.appendChild(label);
      layer.forEach((w, h) => {
        const canvas = document.createElement("canvas");
        canvas.className = "attention-map";
        canvas.title = `layer ${l}, head ${h}`;
        canvas.setAttribute("aria-label", `attention of layer ${l}, head ${h}: enlarge`);
        drawMap(canvas, w, cell, null);
        onActivate(canvas, () => {
          const zoom = $("attention-zoom");
          zoom.style.display = "block";
          drawMap(zoom, w, Math.max(12, Math.min(28, Math.floor(640 / T))), data.tokens);
          $("attention-info").textContent = `layer ${l}, head ${h}: ${T} tokens`;
        });
        grid.appendChild(canvas);
      });
    });
    $("attention-info").textContent = `${data.n_layers} layers x ${data.n_heads} heads over ${T} tokens` +
      (data.warnings.length ? ` \u26a0 ${data.warnings.join("; ")}` : "");
  } catch (err) {
    $("attention-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  }
}

// ------------------------------------------------------------------------------ compare
async function compare() {
  const base = knobs();
  const settings = [
    ["greedy", { temperature: 0, beam_width: 1 }],
    ["sampling", { beam_width: 1, temperature: base.temperature || 0.8 }],
    ["beam search", { temperature: 0, beam_width: Math.max(2, base.beam_width || 4) }],
  ];
  const box = $("compare");
  box.innerHTML = "";
  $("compare-run").disabled = true;
  $("compare-info").textContent = "running (one after the other, so the timings do not share the CPU)...";
  try {
    for (const [name, extra] of settings) {
      const data = await api("/v1/completions", { ...base, ...extra, n: 1, logprobs: 1, stream: false });
      const c = data.choices[0];
      const lps = c.logprobs.token_logprobs;
      const mean = lps.length ? lps.reduce((a, b) => a + b, 0) / lps.length : 0;
      const col = document.createElement("div");
      col.className = "column";
      col.dataset.setting = name;
      col.innerHTML = `<h2>${name}${extra.beam_width > 1 ? ` (${extra.beam_width} beams)` : ""}</h2>` +
        `<div class="stats"><span class="tps">${c.tinylm.tokens_per_s ?? "-"} tokens/s</span> · ` +
        `${lps.length} tokens · mean log-prob per token <b class="mean-logprob">${mean.toFixed(3)}</b> · ` +
        `finish: ${c.finish_reason}</div>`;
      const text = document.createElement("div");
      text.className = "text";
      const head = document.createElement("span");
      head.className = "prompt-text";
      head.textContent = base.prompt;
      text.appendChild(head);
      c.logprobs.tokens.forEach((t, i) => text.appendChild(chip(t, lps[i])));
      col.appendChild(text);
      box.appendChild(col);
    }
    $("compare-info").textContent = "";
  } catch (err) {
    $("compare-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    $("compare-run").disabled = false;
  }
}

// ------------------------------------------------------------------------------ tokenizer
let tokenizeTimer = null;
async function tokenize() {
  try {
    const data = await api("/v1/tokenize", { model: state.model, text: $("tokenizer-text").value });
    const out = $("tokenizer-out");
    out.innerHTML = "";
    for (const t of data.tokens) {
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = shown(t.piece).replace(/ /g, "\u00b7");  // spaces made visible
      const id = document.createElement("sub");
      id.textContent = t.id;
      span.appendChild(id);
      out.appendChild(span);
    }
    const chars = $("tokenizer-text").value.length;
    $("tokenizer-info").textContent = `${data.count} tokens, ${chars} characters` +
      (data.count ? ` (${(chars / data.count).toFixed(2)} characters per token)` : "") +
      `; generation prepends the start id ${data.bos_id}; context ${data.context_length} tokens`;
  } catch (err) {
    $("tokenizer-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  }
}

// ------------------------------------------------------------------------------ model card
async function showCard() {
  const data = await api(`/v1/models/${encodeURIComponent(state.model)}`);
  const card = data.card;
  const rows = [["name", data.id], ["format", card.format], ["parameters", card.parameters.toLocaleString()],
    ["tokenizer", `${card.tokenizer.type}, ${card.tokenizer.vocab_size} pieces`]];
  for (const [k, v] of Object.entries(card.config)) rows.push([k, v]);
  if (card.checkpoint) for (const [k, v] of Object.entries(card.checkpoint)) rows.push(["checkpoint " + k, v]);
  const ev = card.run && card.run.eval;
  if (ev) {
    for (const [k, v] of Object.entries(ev)) {
      if (typeof v === "object" && v !== null) for (const [m, x] of Object.entries(v)) rows.push([`${k} ${m}`, x]);
      else rows.push(["training " + k, v]);
    }
  }
  const show = (v) => (typeof v === "number" && !Number.isInteger(v) ? v.toPrecision(5) : String(v));
  $("card").innerHTML = "<table>" + rows.map(([k, v]) => `<tr><th>${escapeHtml(String(k))}</th><td>${escapeHtml(show(v))}</td></tr>`).join("") + "</table>" +
    (card.run ? `<p class="hint">Training curves of run ${escapeHtml(card.run.dir)} (${card.run.steps} logged steps)</p>` :
      `<p class="hint">Not a tinylm run directory: no training curves.</p>`);
  drawCurves(card.run ? card.run.curves : []);
}

function drawCurves(rows) {
  const canvas = $("curves");
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const series = [["train_loss", "#2566c9"], ["val_loss", "#d1363a"]];
  const points = rows.filter((r) => r.step !== null);
  const values = points.flatMap((r) => series.map(([k]) => r[k]).filter((v) => v !== null));
  if (!values.length) { canvas.style.display = "none"; return; }
  canvas.style.display = "block";
  const [x0, x1] = [points[0].step, points[points.length - 1].step || 1];
  const [y0, y1] = [Math.min(...values), Math.max(...values)];
  const L = 50, R = 20, T = 20, B = 30, W = canvas.width - L - R, H = canvas.height - T - B;
  const px = (s) => L + (x1 > x0 ? (s - x0) / (x1 - x0) : 0) * W;
  const py = (v) => T + (y1 > y0 ? (y1 - v) / (y1 - y0) : 0.5) * H;
  ctx.strokeStyle = "#888";
  ctx.strokeRect(L, T, W, H);
  ctx.fillStyle = "#1d232a";
  ctx.font = "11px sans-serif";
  ctx.fillText(y1.toFixed(2), 6, T + 8);
  ctx.fillText(y0.toFixed(2), 6, T + H);
  ctx.fillText(`step ${x0}`, L, T + H + 16);
  ctx.fillText(`step ${x1}`, L + W - 50, T + H + 16);
  series.forEach(([key, color], n) => {
    const pts = points.filter((r) => r[key] !== null);
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.beginPath();
    pts.forEach((r, i) => (i ? ctx.lineTo(px(r.step), py(r[key])) : ctx.moveTo(px(r.step), py(r[key]))));
    ctx.stroke();
    pts.forEach((r) => ctx.fillRect(px(r.step) - 2, py(r[key]) - 2, 4, 4));
    ctx.fillText(key, L + W - 90, T + 14 + 14 * n);
  });
}

// ------------------------------------------------------------------------------ wiring
function showTab(name) {
  document.querySelectorAll("#tabs button").forEach((b) => {
    b.classList.toggle("active", b.dataset.tab === name);
    b.setAttribute("aria-selected", String(b.dataset.tab === name));
  });
  document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === "panel-" + name));
  $("controls").style.display = name === "generate" || name === "compare" ? "block" : "none";
  if (name === "tokenizer") tokenize();
  if (name === "card") showCard().catch((err) => { $("card").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`; });
}

// The tabs as ARIA tabs: screen readers announce the tab list, which tab is selected, and each panel's name.
function markTabs() {
  document.querySelectorAll("#tabs button").forEach((b) => {
    b.setAttribute("role", "tab");
    b.setAttribute("aria-selected", String(b.classList.contains("active")));
    b.setAttribute("aria-controls", "panel-" + b.dataset.tab);
    const panel = $("panel-" + b.dataset.tab);
    if (panel) { panel.setAttribute("role", "tabpanel"); panel.setAttribute("aria-label", b.textContent); }
  });
}

async function start() {
  markTabs();
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("generate").addEventListener("click", generate);
  $("stop-generation").addEventListener("click", () => state.controller && state.controller.abort());
  $("attention-run").addEventListener("click", showAttention);
  $("compare-run").addEventListener("click", compare);
  $("tokenizer-text").addEventListener("input", () => { clearTimeout(tokenizeTimer); tokenizeTimer = setTimeout(tokenize, 200); });
  $("model").addEventListener("change", () => { state.model = $("model").value; });
  $("api-key").value = localStorage.getItem("tinylm-api-key") || "";
  $("api-key").addEventListener("change", () => { localStorage.setItem("tinylm-api-key", $("api-key").value); loadModels(); });
  $("key-form").addEventListener("submit", (event) => event.preventDefault());  // Enter in the key field
  await loadModels();
}

async function loadModels() {
  try {
    const data = await api("/v1/models");
    $("model").innerHTML = data.data.map((m) => `<option>${escapeHtml(m.id)}</option>`).join("");
    if (!data.data.length) {  // `tinylm serve --runs DIR` alone: models come from the Runs view
      state.model = null;
      setStatus("no model served yet: load a checkpoint in the Runs view");
      return;
    }
    state.model = data.data[0].id;
    setStatus(`${data.data.length} model(s) served`);
  } catch (err) {
    setStatus(err.message, true);
  }
}

start();
