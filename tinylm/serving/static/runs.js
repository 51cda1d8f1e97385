// The "Runs" view: the runs under `tinylm serve --runs DIR`, their loss and perplexity curves
// (polled every two seconds while the view is open, so a training run's curves grow in place),
// checkpoints (load one into the other views, or sample the run's prompts with it) and config.
// Uses app.js's helpers ($, api, state, escapeHtml, loadModels).
"use strict";

const POLL_MS = 2000;
const runs = { list: [], data: {}, main: "", overlay: "", timer: null, polling: false };
const RUN_COLORS = [["#2566c9", "#d1363a"], ["#7a3fb0", "#e08a00"]];  // [train, validation] per run

// ------------------------------------------------------------------------------ data
async function fetchRun(name) {
  const held = runs.data[name] || { rows: [], detail: null };
  const detail = await api(`/v1/tinylm/runs/detail?run=${encodeURIComponent(name)}&since=${held.rows.length}`);
  held.rows = detail.reset ? detail.metrics : held.rows.concat(detail.metrics);
  held.detail = detail;
  runs.data[name] = held;
  return held;
}

async function loadRunList() {
  try {
    const data = await api("/v1/tinylm/runs");
    runs.list = data.runs;
    const names = data.runs.map((r) => r.run);
    if (!names.length) { $("runs-info").textContent = `no run under ${data.root} yet (a run is a directory with metrics.csv)`; return; }
    if (!names.includes(runs.main)) {  // the most recently written run first: the one training, if any
      runs.main = [...data.runs].sort((a, b) => b.modified - a.modified)[0].run;
    }
    $("runs-list").innerHTML = names.map((n) => `<option${n === runs.main ? " selected" : ""}>${escapeHtml(n)}</option>`).join("");
    $("runs-overlay").innerHTML = '<option value="">none</option>' +
      names.map((n) => `<option${n === runs.overlay ? " selected" : ""}>${escapeHtml(n)}</option>`).join("");
    await pollRuns();
  } catch (err) {
    $("runs-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  }
}

async function pollRuns() {
  if (runs.polling || !runs.main) return;
  runs.polling = true;
  try {
    const names = [runs.main, runs.overlay].filter((n, i) => n && (i === 0 || n !== runs.main));
    for (const name of names) await fetchRun(name);
    drawRuns();
  } catch (err) {
    $("runs-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    runs.polling = false;
  }
}

function startPolling() {
  clearInterval(runs.timer);
  runs.timer = setInterval(() => {
    if ($("panel-runs").classList.contains("active") && !document.hidden) pollRuns();
  }, POLL_MS);
}

// ------------------------------------------------------------------------------ curves
function runSeries(name, k) {
  const rows = (runs.data[name] || { rows: [] }).rows;
  const [trainColor, validColor] = RUN_COLORS[k];
  const pick = (key, f = (v) => v) => rows.filter((r) => r[key] !== null && r[key] !== undefined && r.step !== null)
    .map((r) => [r.step, f(r[key])]);
  const dash = k ? [6, 4] : [];
  return {
    loss: [{ label: `${name} train`, color: trainColor, dash, points: pick("train_loss") },
      { label: `${name} validation`, color: validColor, dash, dots: true, points: pick("val_loss") }],
    ppl: [{ label: `${name} e^train`, color: trainColor, dash, points: pick("train_loss", Math.exp) },
      { label: `${name} validation`, color: validColor, dash, dots: true, points: pick("val_loss", Math.exp) }],
  };
}

function niceTicks(lo, hi, count) {
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / count || 1)));
  const mult = [1, 2, 5, 10].find((m) => (hi - lo) / (m * step) <= count) || 10;
  const ticks = [];
  for (let v = Math.ceil(lo / (mult * step)) * mult * step; v <= hi + 1e-9; v += mult * step) ticks.push(v);
  return ticks;
}

// Ticks of a log10 axis from lo to hi (in log10 units): 1, 2, 5 x 10^k, or only 10^k when those are many.
function logTicks(lo, hi) {
  const ticks = [];
  for (let k = Math.floor(lo); k <= Math.ceil(hi); k++) for (const m of [1, 2, 5]) ticks.push(m * Math.pow(10, k));
  const inside = ticks.filter((v) => Math.log10(v) >= lo && Math.log10(v) <= hi);
  return inside.length > 8 ? inside.filter((v) => Number.isInteger(Math.log10(v))) : inside;
}

function drawChart(canvas, series, logY) {
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const all = series.flatMap((s) => s.points).filter(([, y]) => Number.isFinite(y) && (!logY || y > 0));
  ctx.fillStyle = "#1d232a";
  ctx.font = "12px sans-serif";
  if (!all.length) { ctx.fillText("no rows logged yet", 20, 30); return; }
  const fy = logY ? Math.log10 : (v) => v;
  const xs = all.map(([x]) => x), ys = all.map(([, y]) => fy(y));
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = 0.04 * (y1 - y0);
  [y0, y1] = [y0 - pad, y1 + pad];
  const L = 56, R = 14, T = 12, B = 34, W = canvas.width - L - R, H = canvas.height - T - B;
  const px = (x) => L + ((x - x0) / (x1 - x0)) * W;
  const py = (y) => T + ((y1 - fy(y)) / (y1 - y0)) * H;
  ctx.strokeStyle = "#e3e7ec";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of logY ? logTicks(y0, y1) : niceTicks(y0, y1, 6)) {
    const y = T + ((y1 - fy(v)) / (y1 - y0)) * H;
    if (y < T - 1 || y > T + H + 1) continue;
    ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(L + W, y); ctx.stroke();
    ctx.fillText(v >= 100 ? v.toFixed(0) : String(Number(v.toPrecision(3))), L - 4, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const t of niceTicks(x0, x1, 6)) {
    ctx.beginPath(); ctx.moveTo(px(t), T); ctx.lineTo(px(t), T + H); ctx.stroke();
    ctx.fillText(t.toLocaleString(), px(t), T + H + 4);
  }
  ctx.fillText("step", L + W / 2, T + H + 19);
  ctx.strokeStyle = "#888";
  ctx.setLineDash([]);
  ctx.strokeRect(L, T, W, H);
  for (const s of series) {
    const pts = s.points.filter(([, y]) => Number.isFinite(y) && (!logY || y > 0));
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = s.dots ? 1.5 : 1.2;
    ctx.setLineDash(s.dash);
    ctx.beginPath();
    pts.forEach(([x, y], i) => (i ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y))));
    ctx.stroke();
    if (s.dots) pts.forEach(([x, y]) => ctx.fillRect(px(x) - 2.5, py(y) - 2.5, 5, 5));
  }
  ctx.setLineDash([]);
  ctx.lineWidth = 1;
}

function lastOf(points) {
  return points.length ? points[points.length - 1] : null;
}

function describe(series, f) {
  return series.filter((s) => s.points.length).map((s) => {
    const [x, y] = lastOf(s.points);
    return `${s.label} ${f(y)} at step ${x}`;
  }).join("; ");
}

function drawRuns() {
  const names = [runs.main, runs.overlay].filter((n, i) => n && runs.data[n] && (i === 0 || n !== runs.main));
  const parts = names.map((n, k) => runSeries(n, k));
  const loss = parts.flatMap((p) => p.loss), ppl = parts.flatMap((p) => p.ppl);
  drawChart($("runs-loss"), loss, false);
  drawChart($("runs-ppl"), ppl, true);
  $("runs-loss").setAttribute("aria-label", "loss curves: " + (describe(loss, (y) => y.toFixed(3)) || "no rows yet"));
  $("runs-ppl").setAttribute("aria-label", "perplexity curves: " + (describe(ppl, (y) => y.toFixed(2)) || "no rows yet"));
  $("runs-legend").innerHTML = names.map((n, k) =>
    `<span class="swatch" style="background:${RUN_COLORS[k][0]}"></span>${escapeHtml(n)} train ` +
    `<span class="swatch" style="background:${RUN_COLORS[k][1]}"></span>validation${k ? " (dashed)" : ""}`).join(" &nbsp; ");
  const d = runs.data[runs.main].detail;
  const ago = Math.max(0, Math.round(Date.now() / 1000 - d.modified));
  $("runs-info").textContent = `${d.run}: step ${d.step ?? "-"}, ${d.total} rows` +
    (d.best_val_loss !== null ? `, best validation loss ${d.best_val_loss.toFixed(4)}` : "") +
    (d.live ? ` \u2014 training (last row ${ago} s ago)` : " \u2014 not training");
  showCheckpoints(d);
  if ($("runs-config").dataset.run !== d.run) {
    $("runs-config").textContent = d.config || "(no config.yaml)";
    $("runs-config").dataset.run = d.run;
    showEndSamples(d);
  }
  showEvalSamples(d);
}

// ------------------------------------------------------------------------------ checkpoints
function showCheckpoints(d) {
  const table = $("runs-checkpoints");
  const key = d.run + JSON.stringify(d.checkpoints);
  if (table.dataset.key === key) return;  // unchanged: keep the buttons (and the keyboard focus)
  table.dataset.key = key;
  if (!d.checkpoints.length) { table.innerHTML = "<tr><td>no checkpoint saved yet</td></tr>"; return; }
  const fmt = (v) => (v === null || v === undefined ? "-" : typeof v === "number" && !Number.isInteger(v) ? v.toFixed(4) : v);
  table.innerHTML = "<tr><th scope=\"col\">checkpoint</th><th scope=\"col\">step</th><th scope=\"col\">validation loss</th>" +
    "<th scope=\"col\">saved</th><th scope=\"col\">use it</th></tr>";
  for (const c of d.checkpoints) {
    const tr = table.insertRow();
    tr.dataset.checkpoint = c.name;
    tr.innerHTML = `<td>${escapeHtml(c.name)}</td><td>${fmt(c.step)}</td><td>${fmt(c.val_loss)}</td>` +
      `<td>${new Date(c.modified * 1000).toLocaleTimeString()}</td><td></td>`;
    const cell = tr.cells[4];
    for (const [label, action] of [["Load", loadCheckpoint], ["Samples", sampleCheckpoint]]) {
      const b = document.createElement("button");
      b.textContent = label;
      b.className = "small " + label.toLowerCase();
      b.setAttribute("aria-label", `${label} ${d.run} ${c.name}`);
      b.addEventListener("click", () => action(d.run, c.name, b));
      cell.appendChild(b);
    }
  }
}

async function loadCheckpoint(run, checkpoint, button) {
  button.disabled = true;
  $("runs-info").textContent = `loading ${run}/${checkpoint}...`;
  try {
    const data = await api("/v1/tinylm/runs/load", { run, checkpoint });
    await loadModels();
    $("model").value = data.model;
    state.model = data.model;
    $("runs-info").textContent = `${data.reloaded ? "reloaded" : "loaded"} ${run}/${checkpoint} (step ${data.step ?? "-"}) ` +
      `as model ${data.model}: selected in the model menu, for every view`;
  } catch (err) {
    $("runs-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    button.disabled = false;
  }
}

function samplesSection(title, samples) {
  const section = document.createElement("section");
  section.className = "samples";
  const h = document.createElement("h3");
  h.textContent = title;
  section.appendChild(h);
  const list = document.createElement("ol");
  for (const s of samples) {
    const li = document.createElement("li");
    const prompt = document.createElement("b");
    prompt.textContent = s.prompt;
    li.appendChild(prompt);
    li.appendChild(document.createTextNode(s.continuation));
    list.appendChild(li);
  }
  section.appendChild(list);
  return section;
}

async function sampleCheckpoint(run, checkpoint, button) {
  button.disabled = true;
  $("runs-info").textContent = `sampling ${run}/${checkpoint}...`;
  try {
    const data = await api("/v1/tinylm/runs/samples", { run, checkpoint, max_tokens: 48 });
    const c = runs.data[run].detail.checkpoints.find((x) => x.name === checkpoint) || {};
    const section = samplesSection(`${run} / ${checkpoint}${c.step !== undefined ? ` (step ${c.step})` : ""}`, data.samples);
    section.dataset.checkpoint = checkpoint;
    const old = [...$("runs-samples").children].find((el) => el.dataset.checkpoint === checkpoint);
    if (old) old.replaceWith(section); else $("runs-samples").prepend(section);
    $("runs-info").textContent = `sampled ${data.samples.length} prompts with ${run}/${checkpoint}`;
  } catch (err) {
    $("runs-info").innerHTML = `<span class="error">${escapeHtml(err.message)}</span>`;
  } finally {
    button.disabled = false;
  }
}

function showEndSamples(d) {
  $("runs-samples").innerHTML = "";
  if (d.samples.length) $("runs-samples").appendChild(samplesSection(`${d.run}: samples written at the end of the run`, d.samples));
}

// the samples written at each evaluation, newest first (the newest open, the others one click
// away), in a box of their own so that polling a live run leaves the on-demand samples alone
function showEvalSamples(d) {
  const box = $("runs-eval-samples");
  const evals = (d.eval_samples || []).slice().reverse();
  const key = `${d.run}:${evals.length ? evals[0].step : "-"}`;
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.innerHTML = "";
  evals.forEach((row, i) => {
    const details = document.createElement("details");
    details.className = "eval-samples";
    details.open = i === 0;
    const summary = document.createElement("summary");
    summary.textContent = `step ${row.step} (${Number(row.tokens).toLocaleString()} tokens): samples at this evaluation`;
    details.appendChild(summary);
    details.appendChild(samplesSection(`${d.run} at step ${row.step}`, row.samples));
    box.appendChild(details);
  });
}

// ------------------------------------------------------------------------------ wiring
$("tab-runs").addEventListener("click", () => { loadRunList(); startPolling(); });
$("runs-list").addEventListener("change", () => { runs.main = $("runs-list").value; pollRuns(); });
$("runs-overlay").addEventListener("change", () => { runs.overlay = $("runs-overlay").value; pollRuns(); });
