// The "Logit lens" view: POST /v1/tinylm/lens, drawn as a table of layers x positions.
// Uses app.js's helpers ($, api, state, escapeHtml, shown).
"use strict";

const lens = { data: null };

// More probable = more saturated orange (the attention view is blue-green, the chips blue).
function lensShade(p) {
  return `rgba(230, 120, 20, ${(0.06 + 0.74 * p).toFixed(3)})`;
}

function lensLabel(text) {
  const t = shown(text).replace(/\n/g, "").replace(/ /g, "\u00b7");  // spaces made visible
  return t === "" ? "\u2205" : t;
}

async function showLens() {
  const typed = $("lens-text").value;
  const text = typed || (state.promptText + state.generatedText) || $("prompt").value;
  $("lens-info").textContent = "computing...";
  $("lens-run").disabled = true;
  try {
    lens.data = await api("/v1/tinylm/lens", { model: state.model, text, top: 5 });
    drawLens(lens.data);
    const n = lens.data.tokens.length;
    const last = lens.data.layers.length - 1;
    const hits = lens.data.top.map((row) => row.slice(0, n - 1).filter((cell, t) => cell[0].id === lens.data.tokens[t + 1].id).length);
    $("lens-info").textContent = `${lens.data.model}: ${lens.data.layers.length} rows x ${n} positions; the top token ` +
      `is the next one at ${hits[last]} of ${n - 1} positions after the last layer, ${hits[0]} from the embeddings alone` +
      (lens.data.warnings.length ? ` \u26a0 ${lens.data.warnings.join("; ")}` : "");
  } catch (err) {
    $("lens-grid").innerHTML = "";
    $("lens-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    $("lens-run").disabled = false;
  }
}

function drawLens(data) {
  const table = document.createElement("table");
  table.className = "lens";
  const caption = document.createElement("caption");
  caption.textContent = `Top next token after each layer of ${data.model}`;
  table.appendChild(caption);
  const head = table.createTHead().insertRow();
  head.appendChild(Object.assign(document.createElement("th"), { scope: "col", textContent: "input \u2192" }));
  data.tokens.forEach((t) => head.appendChild(Object.assign(document.createElement("th"), { scope: "col", textContent: lensLabel(t.text || t.piece) })));
  const body = table.createTBody();
  data.layers.forEach((name, l) => {
    const tr = body.insertRow();
    tr.appendChild(Object.assign(document.createElement("th"), { scope: "row", textContent: name }));
    data.top[l].forEach((cell, t) => {
      const td = tr.insertCell();
      const button = document.createElement("button");
      const best = cell[0];
      const next = data.tokens[t + 1];
      button.className = "lens-cell" + (next && best.id === next.id ? " hit" : "");
      button.textContent = lensLabel(best.text);
      button.style.background = lensShade(best.p);
      button.dataset.layer = l;
      button.dataset.position = t;
      button.setAttribute("aria-label", `${name}, after ${JSON.stringify(data.tokens[t].text)}: ` +
        `${JSON.stringify(best.text)} ${(100 * best.p).toFixed(1)}%`);
      button.tabIndex = l === 0 && t === 0 ? 0 : -1;  // one cell in the Tab order; arrows move inside the grid
      button.addEventListener("click", () => showLensCell(l, t));
      td.appendChild(button);
    });
  });
  const foot = table.createTFoot().insertRow();
  foot.appendChild(Object.assign(document.createElement("th"), { scope: "row", textContent: "next token" }));
  data.tokens.forEach((t, i) => {
    const next = data.tokens[i + 1];
    foot.insertCell().textContent = next ? lensLabel(next.text || next.piece) : "";
  });
  table.addEventListener("keydown", moveInLens);
  $("lens-grid").innerHTML = "";
  $("lens-grid").appendChild(table);
}

// Arrow keys, Home and End move the focus from cell to cell (the grid is one stop of the Tab order).
function moveInLens(event) {
  const cell = event.target.closest(".lens-cell");
  if (!cell) return;
  const rows = lens.data.layers.length, cols = lens.data.tokens.length;
  let l = Number(cell.dataset.layer), t = Number(cell.dataset.position);
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1], Home: [0, -cols], End: [0, cols] };
  if (!(event.key in moves)) return;
  event.preventDefault();
  l = Math.min(rows - 1, Math.max(0, l + moves[event.key][0]));
  t = Math.min(cols - 1, Math.max(0, t + moves[event.key][1]));
  focusLensCell(l, t);
}

function focusLensCell(l, t) {
  const target = document.querySelector(`#lens-grid .lens-cell[data-layer="${l}"][data-position="${t}"]`);
  document.querySelectorAll("#lens-grid .lens-cell").forEach((b) => { b.tabIndex = b === target ? 0 : -1; });
  target.focus();
}

function showLensCell(l, t) {
  const data = lens.data;
  focusLensCell(l, t);
  document.querySelectorAll("#lens-grid .lens-cell").forEach((b) =>
    b.classList.toggle("selected", Number(b.dataset.layer) === l && Number(b.dataset.position) === t));
  const next = data.tokens[t + 1];
  const p = data.next_p[l][t];
  $("lens-cell-where").textContent = `${data.layers[l]}, position ${t} (after ${JSON.stringify(data.tokens[t].text)})` +
    (next ? `: the next token ${JSON.stringify(next.text)} has p = ${(100 * p).toFixed(2)}%` : "");
  const list = $("lens-cell");
  list.innerHTML = "";
  for (const { id, text, p: prob } of data.top[l][t]) {
    const li = document.createElement("li");
    li.innerHTML = `<span class="bar" style="width:${Math.max(2, 120 * prob)}px"></span>`;
    li.appendChild(document.createTextNode(`${JSON.stringify(text)}  ${(100 * prob).toFixed(2)}%`));
    if (next && id === next.id) li.classList.add("chosen");
    list.appendChild(li);
  }
}

$("lens-run").addEventListener("click", showLens);
$("lens-text").addEventListener("keydown", (event) => { if (event.key === "Enter") showLens(); });
