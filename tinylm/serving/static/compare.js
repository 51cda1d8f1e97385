// The "Compare models" view: POST /v1/tinylm/score, every chosen model on the same text.
// A row per model (tokens shaded by their bits), a difference row (A minus B, per character span),
// the spans where each model wins most, and each model's top predictions at a chosen span.
// Uses app.js's helpers ($, api, escapeHtml, shown).
"use strict";

const versus = { data: null, segments: [], selected: null, documents: [] };

// ------------------------------------------------------------------------------ shading
// Bits of a token: white (0) to deep red (SURPRISE_BITS or more).
const SURPRISE_BITS = 14;
function surpriseShade(bits) {
  const v = Math.min(1, Math.max(0, bits / SURPRISE_BITS));
  return `rgba(209, 54, 58, ${(0.04 + 0.8 * v).toFixed(3)})`;
}

// A minus B in bits: blue where A spends fewer bits (A wins), orange where B does.
function differenceShade(diff, scale) {
  const v = Math.min(1, Math.abs(diff) / scale);
  return diff < 0 ? `rgba(37, 102, 201, ${(0.05 + 0.75 * v).toFixed(3)})` : `rgba(230, 120, 20, ${(0.05 + 0.75 * v).toFixed(3)})`;
}

const visible = (text) => (text === "" ? "\u2205" : shown(text));

// ------------------------------------------------------------------------------ documents of a file
// As `tinylm evaluate --data` reads a file: .jsonl one document per line ("text"), stories
// separated by <|endoftext|>, anything else one document.
function splitDocuments(name, text) {
  if (name.endsWith(".jsonl")) {
    return text.split("\n").filter((l) => l.trim()).map((l) => String(JSON.parse(l).text));
  }
  if (text.includes("<|endoftext|>")) return text.split("<|endoftext|>").map((d) => d.trim()).filter((d) => d);
  return [text];
}

async function pickFile() {
  const file = $("versus-file").files[0];
  if (!file) return;
  try {
    versus.documents = splitDocuments(file.name, await file.text());
  } catch (err) {
    $("versus-info").innerHTML = `<span class="error">${escapeHtml(file.name)}: ${escapeHtml(err.message)}</span>`;
    return;
  }
  $("versus-doc").innerHTML = versus.documents.map((d, i) =>
    `<option value="${i}">${i + 1}: ${escapeHtml(d.slice(0, 70).replace(/\s+/g, " "))}</option>`).join("");
  $("versus-doc").disabled = false;
  pickDocument();
}

function pickDocument() {
  const doc = versus.documents[Number($("versus-doc").value)];
  if (doc !== undefined) $("versus-text").value = doc;
}

// ------------------------------------------------------------------------------ the models to compare
function fillModelChoices(names) {
  $("versus-models").innerHTML = "<legend>Models</legend>" + names.map((n, i) =>
    `<label><input type="checkbox" value="${escapeHtml(n)}" ${i < 4 ? "checked" : ""}> ${escapeHtml(n)}</label>`).join("");
  const options = names.map((n) => `<option>${escapeHtml(n)}</option>`).join("");
  $("versus-a").innerHTML = options;
  $("versus-b").innerHTML = options;
  if (names.length > 1) $("versus-b").selectedIndex = 1;
}

function chosenModels() {
  return Array.from(document.querySelectorAll("#versus-models input:checked")).map((el) => el.value);
}

async function runComparison() {
  const models = chosenModels();
  const text = $("versus-text").value;
  if (!models.length || !text) {
    $("versus-info").innerHTML = `<span class="error">choose at least one model and give a text</span>`;
    return;
  }
  $("versus-run").disabled = true;
  $("versus-info").textContent = "scoring...";
  try {
    versus.data = await api("/v1/tinylm/score", { models, text, top: 5 });
    versus.selected = null;
    drawComparison();
    $("versus-info").textContent = `${versus.data.chars} characters, ${versus.data.bytes} bytes; ` +
      versus.data.models.map((m) => `${m.model} ${m.bpb.toFixed(4)} bits/byte`).join(" \u00b7 ");
  } catch (err) {
    $("versus-rows").innerHTML = "";
    $("versus-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    $("versus-run").disabled = false;
  }
}

// ------------------------------------------------------------------------------ rows
function modelResult(name) {
  return versus.data.models.find((m) => m.model === name);
}

// A token as a button over its characters (a character shared with the token before it, part of a
// byte-level token, is drawn once).
function tokenRow(result, chars) {
  const row = document.createElement("div");
  row.className = "versus-text";
  let drawn = 0;
  result.tokens.forEach((t, i) => {
    const from = Math.max(t.char_start, drawn);
    const piece = chars.slice(from, t.char_end).join("");
    drawn = Math.max(drawn, t.char_end);
    if (!piece) return;
    const b = document.createElement("button");
    b.className = "versus-span";
    b.textContent = shown(piece);
    b.dataset.start = t.char_start;
    b.dataset.end = t.char_end;
    const bits = t.bits === null ? "not predicted (the first token)" : `${t.bits.toFixed(2)} bits`;
    b.style.background = t.bits === null ? "transparent" : surpriseShade(t.bits);
    b.title = `${JSON.stringify(t.text)}: ${bits}`;
    b.setAttribute("aria-label", `${result.model}, token ${i + 1} ${JSON.stringify(t.text)}: ${bits}`);
    b.addEventListener("click", () => selectSpan(t.char_start, Math.max(t.char_end, t.char_start + 1)));
    row.appendChild(b);
  });
  return row;
}

// The character spans of the difference row: every token boundary of A and of B.
function differenceSegments(a, b, chars) {
  const cuts = new Set([0, chars.length]);
  for (const m of [a, b]) for (const t of m.tokens) { cuts.add(t.char_start); cuts.add(t.char_end); }
  const sorted = Array.from(cuts).filter((c) => c >= 0 && c <= chars.length).sort((x, y) => x - y);
  const segments = [];
  for (let k = 0; k + 1 < sorted.length; k++) {
    const [start, end] = [sorted[k], sorted[k + 1]];
    let diff = 0;
    for (let c = start; c < end; c++) diff += a.char_bits[c] - b.char_bits[c];
    segments.push({ start, end, diff, text: chars.slice(start, end).join("") });
  }
  return segments;
}

function differenceRow(segments, a, b) {
  const row = document.createElement("div");
  row.className = "versus-text";
  const scale = Math.max(1, ...segments.map((s) => Math.abs(s.diff)));
  segments.forEach((s) => {
    const btn = document.createElement("button");
    btn.className = "versus-span";
    btn.textContent = shown(s.text);
    btn.dataset.start = s.start;
    btn.dataset.end = s.end;
    btn.style.background = differenceShade(s.diff, scale);
    const label = `${a.model} minus ${b.model}: ${s.diff >= 0 ? "+" : ""}${s.diff.toFixed(2)} bits`;
    btn.title = label;
    btn.setAttribute("aria-label", `${JSON.stringify(s.text)}: ${label}`);
    btn.addEventListener("click", () => selectSpan(s.start, s.end));
    row.appendChild(btn);
  });
  return row;
}

function rowBlock(title, stats, content) {
  const block = document.createElement("section");
  block.className = "versus-row";
  const h = document.createElement("h2");  // h1 is the page's, no h2 comes before: heading order
  h.className = "versus-title";
  h.textContent = title;
  const p = document.createElement("p");
  p.className = "stats";
  p.textContent = stats;
  block.append(h, p, content);
  return block;
}

function drawComparison() {
  const data = versus.data;
  const chars = Array.from(data.text);
  const box = $("versus-rows");
  box.innerHTML = "";
  for (const m of data.models) {
    const predicted = m.tokens.filter((t) => t.bits !== null).length;
    box.appendChild(rowBlock(m.model, `${m.tokenizer} tokenizer \u00b7 ${m.tokens.length} tokens \u00b7 ` +
      `${m.bits.toFixed(1)} bits in all \u00b7 ${m.bpb.toFixed(4)} bits per byte \u00b7 ` +
      `${(m.bits / Math.max(1, predicted)).toFixed(2)} bits per token`, tokenRow(m, chars)));
  }
  const a = modelResult($("versus-a").value), b = modelResult($("versus-b").value);
  $("versus-sort").options[0].textContent = `where ${$("versus-a").value} wins most`;
  $("versus-sort").options[1].textContent = `where ${$("versus-b").value} wins most`;
  versus.segments = [];
  if (a && b && a !== b) {
    versus.segments = differenceSegments(a, b, chars);
    const total = a.bits - b.bits;
    box.appendChild(rowBlock(`${a.model} minus ${b.model}`, `${total >= 0 ? "+" : ""}${total.toFixed(1)} bits in all ` +
      `(${((a.bpb - b.bpb)).toFixed(4)} bits per byte); blue: ${a.model} spends fewer bits, orange: ${b.model} does`,
      differenceRow(versus.segments, a, b)));
  }
  drawRanking();
}

// ------------------------------------------------------------------------------ ranking and details
function drawRanking() {
  const list = $("versus-ranking");
  list.innerHTML = "";
  const a = $("versus-a").value, b = $("versus-b").value;
  if (!versus.segments.length) {
    $("versus-ranking-title").textContent = "Where one model wins (choose two different models as A and B)";
    return;
  }
  const winner = $("versus-sort").value === "b" ? b : a;
  const sign = winner === a ? 1 : -1;  // A wins where A minus B is negative
  const ranked = versus.segments.filter((s) => /\S/.test(s.text) && sign * s.diff < 0)
    .sort((x, y) => sign * (x.diff - y.diff)).slice(0, 15);
  $("versus-ranking-title").textContent = `Where ${winner} wins most (bits saved over ${winner === a ? b : a})`;
  const chars = Array.from(versus.data.text);
  for (const s of ranked) {
    const li = document.createElement("li");
    const btn = document.createElement("button");
    btn.className = "versus-rank";
    const before = chars.slice(Math.max(0, s.start - 24), s.start).join("");
    const after = chars.slice(s.end, s.end + 12).join("");
    btn.innerHTML = `<span class="ctx">${escapeHtml(before.replace(/\s+/g, " "))}</span><b>${escapeHtml(s.text.replace(/\n/g, "\u21b5"))}</b>` +
      `<span class="ctx">${escapeHtml(after.replace(/\s+/g, " "))}</span> <span class="saved">${Math.abs(s.diff).toFixed(2)} bits</span>`;
    btn.addEventListener("click", () => selectSpan(s.start, s.end));
    li.appendChild(btn);
    list.appendChild(li);
  }
}

// Each model's prediction where the span starts: the token holding its first character.
function selectSpan(start, end) {
  versus.selected = [start, end];
  document.querySelectorAll("#versus-rows .versus-span").forEach((el) =>
    el.classList.toggle("selected", Number(el.dataset.start) < end && Number(el.dataset.end) > start));
  const chars = Array.from(versus.data.text);
  $("versus-where").textContent = `characters ${start}\u2013${end}: ${JSON.stringify(chars.slice(start, end).join(""))}`;
  const box = $("versus-detail");
  box.innerHTML = "";
  for (const m of versus.data.models) {
    const t = m.tokens.find((tok) => tok.char_start <= start && tok.char_end > start) || m.tokens[m.tokens.length - 1];
    const h = document.createElement("h4");
    const bits = t.bits === null ? "not predicted" : `${t.bits.toFixed(2)} bits`;
    h.className = "versus-model";
    h.textContent = `${m.model}: ${JSON.stringify(t.text)} (${bits})`;
    const ol = document.createElement("ol");
    for (const alt of t.top) {
      const li = document.createElement("li");
      li.innerHTML = `<span class="bar" style="width:${Math.max(2, 100 * alt.prob)}px"></span>`;
      li.appendChild(document.createTextNode(`${JSON.stringify(alt.text)}  ${(100 * alt.prob).toFixed(2)}%`));
      if (alt.id === t.id) li.classList.add("chosen");
      ol.appendChild(li);
    }
    box.append(h, ol);
  }
}

// ------------------------------------------------------------------------------ wiring
$("versus-run").addEventListener("click", runComparison);
$("versus-file").addEventListener("change", pickFile);
$("versus-doc").addEventListener("change", pickDocument);
for (const id of ["versus-a", "versus-b"]) $(id).addEventListener("change", () => versus.data && drawComparison());
$("versus-sort").addEventListener("change", drawRanking);
// the served models change with a checkpoint loaded from the Runs view, or an API key given
function refreshModelChoices() {
  api("/v1/models").then((data) => {
    const names = data.data.map((m) => m.id);
    if (names.join("\n") !== Array.from($("versus-a").options).map((o) => o.value).join("\n")) fillModelChoices(names);
  }).catch(() => {});
}
$("tab-versus").addEventListener("click", refreshModelChoices);
$("api-key").addEventListener("change", refreshModelChoices);
refreshModelChoices();
