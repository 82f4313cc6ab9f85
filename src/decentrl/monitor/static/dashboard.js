// decentrl dashboard: polls /dashboard/api/* every two seconds and redraws. No build step.
"use strict";

const TOKEN = readToken();
const POLL_MS = 2000;
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b"];
const charts = {};
let selected = null;

// The token arrives in the link's fragment (#token=...), which never leaves the browser; it is
// kept for this tab only and taken out of the address bar, so it is not bookmarked or shared.
function readToken() {
  const key = "decentrl-dashboard-token";
  const given = new URLSearchParams(location.hash.slice(1)).get("token");
  if (given) {
    sessionStorage.setItem(key, given);
    history.replaceState(null, "", location.pathname);
  }
  return given || sessionStorage.getItem(key) || "";
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: "Bearer " + TOKEN } });
  if (!response.ok) throw new Error(path + ": " + response.status + " " + (await response.text()));
  return response.json();
}

function text(value, digits = 3) {
  if (value === null || value === undefined) return "-";
  return typeof value === "number" && !Number.isInteger(value) ? value.toFixed(digits) : String(value);
}

function cell(row, value, cls) {
  const td = row.insertCell();
  td.textContent = value;
  if (cls) td.className = cls;
  return td;
}

function ago(now, ts) {
  return text(Math.max(0, now - ts), 0) + " s ago"; // never "-0 s ago"
}

function fill(tableId, items, render) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  for (const item of items) render(body.insertRow(), item);
}

// ------------------------------------------------------------------ charts

function tick(value) {
  if (value === 0) return "0";
  const size = Math.abs(value);
  return size >= 1e5 || size < 0.01 ? value.toExponential(1) : String(Number(value.toPrecision(4)));
}

function chart(id, labels, data, options = {}) {
  const el = document.getElementById(id);
  const key = labels.join("|");
  if (!labels.length) {
    el.textContent = "not reported by this run";
    el.className = "chart muted";
    delete charts[id];
    return;
  }
  if (charts[id] && charts[id].key === key) {
    charts[id].plot.setData(data);
    return;
  }
  el.replaceChildren();
  el.className = "chart";
  const series = [{ label: options.x || "version" }].concat(
    labels.map((label, i) => ({
      label,
      stroke: COLOURS[i % COLOURS.length],
      fill: options.bars ? COLOURS[i % COLOURS.length] + "88" : undefined,
      width: 1.5,
      spanGaps: true,
      points: { show: options.points ? options.points(label) : false },
      paths: options.bars ? uPlot.paths.bars({ size: [0.8, 40] }) : undefined,
    }))
  );
  // Bars sit on whole numbers: pad the x range by half a bar and tick integers only.
  const x = options.bars ? { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] } : { time: false };
  const plot = new uPlot(
    {
      width: el.clientWidth || 440,
      height: 200,
      series,
      scales: { x },
      axes: [
        { label: options.x || "version", incrs: options.bars ? [1, 2, 5, 10, 20, 50] : undefined },
        { size: 60, values: (u, ticks) => ticks.map(tick) },
      ],
      legend: { live: false },
    },
    data,
    el
  );
  charts[id] = { key, plot };
}

function curveChart(id, curves, pick, options) {
  const names = Object.keys(curves.series).filter(pick);
  chart(id, names, [curves.versions].concat(names.map((n) => curves.series[n])), options);
}

// ------------------------------------------------------------------ panels

function drawFleet(fleet) {
  fill("fleet", fleet, (row, w) => {
    cell(row, w.name);
    cell(row, w.engine);
    cell(row, text(w.version));
    cell(row, text(w.lag), w.lag > 2 ? "bad" : "");
    cell(row, text(w.tokens_per_second, 1));
    cell(row, text(w.accepted));
    cell(row, text(w.rejected), w.rejected ? "bad" : "");
    cell(row, text(w.held));
    cell(row, text(w.strikes), w.strikes ? "bad" : "");
    cell(row, w.quarantined || "-", w.quarantined ? "bad reason" : "reason");
    cell(row, w.serving_peers ? "yes (v" + w.peer_version + ")" : "no");
    cell(row, text(Math.max(0, w.seconds_since_seen), 0) + " s ago");
  });
}

function drawEventKinds(kinds, now) {
  fill("event-kinds", kinds, (row, k) => {
    cell(row, k.kind, k.kind === "quarantined" ? "bad" : "");
    cell(row, text(k.count));
    cell(row, text(k.workers));
    cell(row, ago(now, k.last_ts));
    cell(row, k.last_reason || "-", "reason");
  });
}

function drawEvents(events, now) {
  fill("events", events, (row, e) => {
    cell(row, ago(now, e.ts));
    cell(row, e.kind, e.kind === "quarantined" ? "bad" : "");
    cell(row, e.worker || "-");
    cell(row, e.reason, "reason");
  });
}

function drawStaleness(histogram) {
  const values = Object.keys(histogram).map(Number).sort((a, b) => a - b);
  chart("chart-staleness", values.length ? ["trained rollouts"] : [], [values, values.map((v) => histogram[v])], {
    bars: true,
    x: "staleness (versions)",
  });
}

function drawTraffic(traffic) {
  const mib = (b) => b / 1048576;
  chart(
    "chart-traffic",
    traffic.length ? ["payload MiB", "from coordinator MiB", "from peers MiB"] : [],
    [
      traffic.map((t) => t.version),
      traffic.map((t) => mib(t.payload_bytes)),
      traffic.map((t) => mib(t.coordinator_bytes)),
      traffic.map((t) => mib(t.peer_bytes)),
    ]
  );
}

async function refresh() {
  const o = await api("/dashboard/api/overview");
  document.getElementById("latest-version").textContent = text(o.latest_version);
  document.getElementById("rollouts-accepted").textContent = text(o.rollouts_accepted);
  document.getElementById("workers-count").textContent = String(o.fleet.length);
  drawFleet(o.fleet);
  drawEventKinds(o.event_kinds, o.now);
  drawEvents(o.events, o.now);
  const c = o.curves;
  curveChart("chart-learning", c, (n) => n === "reward_mean" || n === "eval_accuracy" || n === "accuracy", {
    points: (n) => n === "eval_accuracy",
  });
  curveChart("chart-kl", c, (n) => (n.includes("kl") && !n.includes("mismatch")) || n.includes("entropy"));
  curveChart("chart-clip", c, (n) => n.includes("clip"));
  curveChart("chart-mismatch", c, (n) => n.includes("mismatch"));
  drawStaleness(o.staleness);
  drawTraffic(o.traffic);
  if (!selected) await listRollouts();
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// ------------------------------------------------------------------ inspector

async function listRollouts(taskId) {
  const rows = await api("/dashboard/api/rollouts" + (taskId ? "?task_id=" + encodeURIComponent(taskId) : ""));
  fill("rollouts", rows, (row, r) => {
    row.className = "rollout-row" + (r.rollout_id === selected ? " selected" : "");
    row.dataset.rolloutId = r.rollout_id;
    cell(row, r.rollout_id);
    cell(row, r.worker || "-");
    cell(row, text(r.reward));
    cell(row, text(r.staleness));
    cell(row, r.inspected ? "yes" : "");
    row.className += r.inspected ? " inspected" : "";
    row.onclick = () => openRollout(r.rollout_id);
  });
}

function colourOf(token, mode) {
  if (token.source !== "model") return "";
  if (mode === "mismatch") {
    if (token.trainer_logprob === undefined) return "#ddd";
    const gap = Math.min(1, Math.abs(token.logprob - token.trainer_logprob) / 0.5);
    return "hsl(0, 85%, " + (97 - 45 * gap) + "%)";
  }
  const p = Math.exp(token.logprob);
  return "hsl(" + 120 * p + ", 70%, 78%)";
}

let current = null;

function drawRollout() {
  const d = current;
  const mode = document.querySelector("input[name=colour]:checked").value;
  const box = document.getElementById("rollout-detail");
  box.className = "";
  box.replaceChildren();
  const head = document.createElement("div");
  head.id = "rollout-summary";
  head.textContent =
    d.rollout_id + " from " + d.worker + ": reward " + text(d.reward) + ", staleness " + text(d.staleness) +
    ", " + d.finish_reason + ", temperature " + d.temperature +
    (d.trainer_version === null ? " (no trainer log-probs for this rollout)" : ", trainer log-probs at v" + d.trainer_version);
  box.appendChild(head);
  const group = document.createElement("table");
  group.id = "group";
  group.innerHTML = "<thead><tr><th>slot</th><th>reward</th><th>advantage (GRPO form)</th></tr></thead>";
  const body = group.createTBody();
  for (const m of d.group) {
    const row = body.insertRow();
    row.className = "rollout-row" + (m.rollout_id === d.rollout_id ? " selected" : "");
    cell(row, m.slot);
    cell(row, text(m.reward));
    cell(row, text(m.advantage));
    row.onclick = () => openRollout(m.rollout_id);
  }
  box.appendChild(group);
  const legend = document.createElement("div");
  legend.className = "legend";
  legend.textContent =
    mode === "mismatch"
      ? "white: worker and trainer agree; red: |worker - trainer| log-prob >= 0.5; grey: not reported"
      : "red: unlikely sampled token; green: probability near 1; grey: prompt; yellow: environment";
  box.appendChild(legend);
  if (d.images && d.images.length) {
    // a visual task: the images the rollout's image tokens stand for, beside its tokens
    const images = document.createElement("div");
    images.id = "rollout-images";
    for (const image of d.images) {
      const figure = document.createElement(image.png ? "img" : "span");
      figure.className = "rollout-image";
      figure.title = image.source + " image, sha256 " + image.sha256;
      if (image.png) figure.src = image.png;
      else figure.textContent = "image " + image.sha256.slice(0, 12) + " (not drawn here)";
      images.appendChild(figure);
    }
    box.appendChild(images);
  }
  const tokens = document.createElement("div");
  tokens.id = "tokens";
  for (const t of d.tokens) {
    const span = document.createElement("span");
    span.className = "token " + t.source;
    span.textContent = t.text;
    span.style.background = colourOf(t, mode);
    span.title =
      "id " + t.id + (t.logprob !== undefined ? ", log-prob " + t.logprob.toFixed(4) + ", v" + t.version : "") +
      (t.trainer_logprob !== undefined ? ", trainer " + t.trainer_logprob.toFixed(4) : "");
    tokens.appendChild(span);
  }
  box.appendChild(tokens);
}

async function openRollout(rolloutId) {
  selected = rolloutId;
  current = await api("/dashboard/api/rollouts/" + encodeURIComponent(rolloutId));
  await listRollouts(current.task_id);
  drawRollout();
}

for (const radio of document.querySelectorAll("input[name=colour]")) {
  radio.onchange = () => current && drawRollout();
}

async function loop() {
  try {
    await refresh();
  } catch (error) {
    document.getElementById("updated").textContent = String(error);
  }
  setTimeout(loop, POLL_MS);
}
loop();
