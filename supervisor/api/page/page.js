// onebitd's status page.  It reads /onebit/status (what `onebitctl status --json` prints) and the
// feed /onebit/events (server-sent events: route lines, child and model transitions), with the API
// key this tab was given, if the daemon asks for one (an admin key, else an API key).  The feed is read with fetch() rather than
// EventSource, which cannot send the key in a header (and a key in the URL would land in logs).
// Every value is written with textContent or an SVG attribute: nothing the daemon sends is parsed
// as markup.  No prompt or reply text is ever in what it reads.
"use strict";

const KEY = "onebit-key"; // sessionStorage: this tab only
const MAX_LINES = 500; // rows kept and shown (the daemon's hello brings its last 200)
const POLL_MS = 1000; // /onebit/status, for what has no event (idle time, memory, slots, store)
const RETRY_MS = 1000; // after the feed ends: the daemon restarted, or dropped a slow tab
const WINDOW_MS = 5 * 60 * 1000; // the time plots' span
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#9a6700", "#bf3989", "#57606a"];

const page = { status: null, lines: [], stopped: false, statusTimer: null, feedAbort: null, routes: [] };

function $(id) { return document.getElementById(id); }

function key() { return sessionStorage.getItem(KEY); }

function authHeaders() {
  const given = key();
  return given ? { Authorization: "Bearer " + given } : {};
}

// -- the key prompt ------------------------------------------------------------------------------

function askForKey(wrong) {
  page.stopped = true;
  if (page.feedAbort) page.feedAbort.abort();
  clearTimeout(page.statusTimer);
  $("main").hidden = true;
  $("key").hidden = false;
  $("key-error").textContent = wrong ? "that key was refused" : "";
  $("daemon").textContent = "a key is needed";
  setFeed(false);
}

function onKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value);
  $("key-input").value = "";
  start();
}

// Whether a refusal asks for a key (a missing or wrong one): 401 for an API key, 403
// admin_key_required for an admin key.  The prompt is shown then.
async function asksForKey(reply) {
  if (reply.status === 401) return true;
  if (reply.status !== 403) return false;
  try {
    return (await reply.json()).error.code === "admin_key_required";
  } catch (error) {
    return false;
  }
}

// -- status ----------------------------------------------------------------------------------------

async function pollStatus() {
  clearTimeout(page.statusTimer);
  if (page.stopped) return;
  try {
    const reply = await fetch("/onebit/status", { headers: authHeaders(), cache: "no-store" });
    if (await asksForKey(reply)) { askForKey(key() !== null); return; }
    if (reply.ok) {
      page.status = await reply.json();
      $("key").hidden = true;
      $("main").hidden = false;
      renderStatus();
      renderPlots(); // the time plots' window moves on
    } else {
      $("daemon").textContent = "status: HTTP " + reply.status;
    }
  } catch (error) {
    $("daemon").textContent = "onebitd is not answering";
  }
  if (!page.stopped) page.statusTimer = setTimeout(pollStatus, POLL_MS);
}

// -- the feed --------------------------------------------------------------------------------------

async function readFeed() {
  while (!page.stopped) {
    const abort = new AbortController();
    page.feedAbort = abort;
    try {
      const reply = await fetch("/onebit/events", { headers: authHeaders(), cache: "no-store", signal: abort.signal });
      if (await asksForKey(reply)) { askForKey(key() !== null); return; }
      if (reply.ok && reply.body) {
        setFeed(true);
        const reader = reply.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            onFrame(buffer.slice(0, end));
            buffer = buffer.slice(end + 2);
          }
        }
      }
    } catch (error) {
      // The daemon went away or cut the feed (a tab too slow to read it): read it again.
    }
    setFeed(false);
    if (!page.stopped) await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

function onFrame(frame) {
  const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
  if (!data) return; // a comment: the feed's heartbeat
  const event = JSON.parse(data);
  if (event.event === "hello") {
    page.lines = event.recent.slice(-MAX_LINES);
    renderLines();
  } else if (event.event === "line") {
    page.lines.push({ at: event.at, line: event.line });
    if (page.lines.length > MAX_LINES) page.lines.splice(0, page.lines.length - MAX_LINES);
    renderLines();
  } else if (event.event === "child" || event.event === "model") {
    applyTransition(event);
    pollStatus(); // the rest of what changed with it (pid, restarts, memory)
  } else if (event.event === "store") {
    pollStatus(); // the store's entries, bytes and counts, at once rather than at the next poll
  }
}

// A transition shows at once, before the status that follows it comes.
function applyTransition(event) {
  const status = page.status;
  if (!status) return;
  if (event.event === "child") {
    for (const child of status.children) if (child.name === event.child) child.state = event.to;
  } else if (status.models) {
    for (const model of status.models.models) if (model.name === event.model) model.state = event.to;
  }
  renderStatus();
}

function setFeed(up) {
  const badge = $("feed");
  badge.textContent = up ? "feed: live" : "feed: down";
  badge.className = "badge " + (up ? "up" : "down");
}

// -- tables ----------------------------------------------------------------------------------------

function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "-" : String(value);
  if (typeof value === "number") td.classList.add("num");
  // A class made of a value the daemon sent (a state, an outcome): only word characters, so that no
  // value can throw (an empty token, a space) or name a class it was not meant to.
  if (cls) td.classList.add(...cls.split(" ").filter(Boolean).map((token) => token.replace(/[^\w-]/g, "_")));
  row.appendChild(td);
  return td;
}

function fill(tableId, rows, build) {
  const body = $(tableId).tBodies[0];
  const fresh = document.createElement("tbody");
  for (const item of rows) {
    const row = document.createElement("tr");
    build(row, item);
    fresh.appendChild(row);
  }
  body.replaceWith(fresh);
}

function round(value, digits) {
  return value === null || value === undefined ? null : Number(value.toFixed(digits));
}

function ago(wall) {
  if (!wall) return null;
  const s = Math.max(0, Date.now() / 1000 - wall);
  return s < 60 ? s.toFixed(0) + " s" : s < 3600 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h";
}

function renderStatus() {
  const status = page.status;
  const info = status.daemon;
  $("daemon").textContent = `${info.state} · pid ${info.pid} · version ${info.version} · up ${ago(info.started_at)}`;
  fill("children", status.children, (row, child) => {
    row.dataset.child = child.name;
    cell(row, child.name);
    cell(row, child.state, "state state-" + child.state);
    cell(row, child.pid, "pid");
    cell(row, child.restarts);
    cell(row, child.generation);
    cell(row, child.last_exit);
    cell(row, ago(child.state_since));
  });
  const models = status.models ? status.models.models : [];
  const providers = [];
  for (const model of models) for (const p of model.providers) providers.push([model.name, p]);
  fill("providers", providers, (row, [model, p]) => {
    cell(row, model);
    cell(row, p.name);
    cell(row, p.kind);
    cell(row, p.child ? p.child.state : p.ready ? "ready" : "not ready", "state state-" + (p.child ? p.child.state : ""));
    cell(row, p.engine);
    cell(row, p.device);
    cell(row, p.jobs);
    cell(row, p.failures);
    const verdict = p.refused ? "refused: " + p.refused : p.admitted ? "admitted: " + p.admitted : "admitted";
    cell(row, verdict, "wrap " + (p.refused ? "state-refused" : "state-admitted"));
  });
  fill("models", models, (row, m) => {
    row.dataset.model = m.name;
    cell(row, m.name + (m.default ? " (default)" : ""));
    cell(row, m.state, "state state-" + m.state);
    cell(row, idleLeft(m));
    cell(row, m.memory_mib);
    cell(row, m.estimate_mib);
    cell(row, m.pin ? "pinned" : "");
    cell(row, m.users);
    cell(row, m.loads);
    cell(row, m.restores);
  });
  fill("slots", models.filter((m) => m.slots), (row, m) => {
    const s = m.slots;
    cell(row, m.name);
    cell(row, s.total);
    cell(row, s.busy);
    cell(row, s.free);
    cell(row, `${s.queued} / ${s.queue_limit}`);
    cell(row, s.keep_waiting);
    cell(row, `${s.affinity_hits} / ${s.affinity_hits + s.affinity_misses}`);
    const each = (s.each || []).map((h) => `#${h.slot} ${h.state} ${h.tokens === null ? "?" : h.tokens}`);
    cell(row, each.join(" · "), "each");
  });
  fill("store", models.filter((m) => m.store), (row, m) => {
    const s = m.store;
    cell(row, m.name + (s.enabled ? "" : " (off)"));
    cell(row, s.entries);
    cell(row, mib(s.bytes));
    cell(row, s.max_bytes ? ((100 * s.bytes) / s.max_bytes).toFixed(1) + "% of " + mib(s.max_bytes) : "-");
    cell(row, s.hits);
    cell(row, s.misses);
    cell(row, s.restores);
    cell(row, s.evictions);
  });
  // The cost decision's estimates against what the route's prefill took (supervisor/observe/
  // routestats.py): a median far from 1, or few within 1.5x, says the model is wrong here.
  fill("estimates", status.estimates || [], (row, e) => {
    cell(row, e.route, "route");
    cell(row, e.engine);
    cell(row, e.n);
    cell(row, e.median_ratio);
    cell(row, (100 * e.within_1_5).toFixed(0) + "%");
  });
}

function mib(bytes) { return (bytes / 1048576).toFixed(1) + " MiB"; }

function idleLeft(m) {
  if (m.state !== "loaded" || m.pin || !m.ttl_s) return null;
  if (m.users > 0) return "in use";
  if (!m.last_used) return `${m.ttl_s} s`;
  const left = m.ttl_s - (Date.now() / 1000 - m.last_used);
  return Math.max(0, left).toFixed(0) + " s";
}

function decodeRate(line) {
  return line.decoded_n && line.decode_ms ? round((1000 * line.decoded_n) / line.decode_ms, 1) : null;
}

function renderLines() {
  $("count").textContent = `(last ${page.lines.length})`;
  const newest = page.lines.slice().reverse();
  fill("requests", newest, (row, { at, line }) => {
    row.dataset.req = line.req;
    cell(row, new Date(at * 1000).toLocaleTimeString());
    cell(row, line.req);
    cell(row, line.endpoint);
    cell(row, line.model);
    cell(row, line.route, "route");
    cell(row, line.status);
    cell(row, line.outcome, "outcome outcome-" + line.outcome);
    cell(row, line.fallback, "fallback");
    cell(row, line.prompt_tokens);
    cell(row, line.restored_tokens);
    cell(row, line.cached_tokens);
    cell(row, round(line.prefill_ms, 1));
    cell(row, round(line.restore_ms, 1));
    cell(row, round(line.first_byte_ms, 1));
    cell(row, round(line.total_ms, 1));
    cell(row, decodeRate(line));
    cell(row, line.error, "wrap error-text"); // redacted by onebitd: no quoted request text
  });
  renderPlots();
}

// -- plots: plain SVG ------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const W = 416, H = 208, PAD = { left: 44, right: 8, top: 8, bottom: 22 };

function color(route) {
  let i = page.routes.indexOf(route);
  if (i < 0) { page.routes.push(route); i = page.routes.length - 1; }
  return COLORS[i % COLORS.length];
}

function node(parent, name, attributes) {
  const element = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attributes)) element.setAttribute(k, String(v));
  parent.appendChild(element);
  return element;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  return Math.ceil(value / step) * step;
}

// A plot of series {route: [[x, y], ...]}: ``lines`` joins each series' points in x order.
function plot(id, series, xMin, xMax, lines, xLabel) {
  const svg = $(id);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  let yMax = 0;
  for (const points of Object.values(series)) for (const [, y] of points) yMax = Math.max(yMax, y);
  yMax = niceMax(yMax);
  const span = xMax > xMin ? xMax - xMin : 1;
  const sx = (x) => PAD.left + ((x - xMin) / span) * (W - PAD.left - PAD.right);
  const sy = (y) => H - PAD.bottom - (y / yMax) * (H - PAD.top - PAD.bottom);
  node(svg, "line", { class: "axis", x1: PAD.left, y1: H - PAD.bottom, x2: W - PAD.right, y2: H - PAD.bottom });
  node(svg, "line", { class: "axis", x1: PAD.left, y1: PAD.top, x2: PAD.left, y2: H - PAD.bottom });
  for (const y of [0, yMax / 2, yMax]) {
    node(svg, "text", { x: PAD.left - 4, y: sy(y) + 3, "text-anchor": "end" }).textContent = String(round(y, 1));
  }
  for (const x of [xMin, (xMin + xMax) / 2]) {
    node(svg, "text", { x: sx(x), y: H - 6, "text-anchor": "start" }).textContent = String(round(x, 0));
  }
  node(svg, "text", { x: W - PAD.right, y: H - 6, "text-anchor": "end" }).textContent = `${round(xMax, 0)} ${xLabel}`;
  for (const [route, points] of Object.entries(series)) {
    const stroke = color(route);
    if (lines && points.length > 1) {
      const sorted = points.slice().sort((a, b) => a[0] - b[0]);
      node(svg, "polyline", { stroke, points: sorted.map(([x, y]) => `${sx(x)},${sy(y)}`).join(" ") });
    }
    for (const [x, y] of points) node(svg, "circle", { cx: sx(x), cy: sy(y), r: 2.5, fill: stroke });
  }
}

function renderPlots() {
  const scatter = {}, ttft = {}, decode = {};
  const now = Date.now() / 1000;
  let maxTokens = 0;
  for (const { at, line } of page.lines) {
    if (line.outcome !== "ok" || line.first_byte_ms === null) continue;
    const route = line.route;
    if (line.prompt_tokens !== null) {
      (scatter[route] ||= []).push([line.prompt_tokens, line.first_byte_ms]);
      maxTokens = Math.max(maxTokens, line.prompt_tokens);
    }
    if (now - at <= WINDOW_MS / 1000) {
      (ttft[route] ||= []).push([at - now, line.first_byte_ms]);
      const rate = decodeRate(line);
      if (rate !== null) (decode[route] ||= []).push([at - now, rate]);
    }
  }
  plot("plot-scatter", scatter, 0, niceMax(maxTokens), false, "prompt tokens");
  plot("plot-ttft", ttft, -WINDOW_MS / 1000, 0, true, "seconds ago");
  plot("plot-decode", decode, -WINDOW_MS / 1000, 0, true, "seconds ago");
  const legend = $("legend");
  while (legend.firstChild) legend.removeChild(legend.firstChild);
  for (const route of page.routes) {
    const item = document.createElement("span");
    item.textContent = route;
    item.style.color = color(route);
    legend.appendChild(item);
  }
}

// -- start -----------------------------------------------------------------------------------------

async function start() {
  page.stopped = false;
  $("key").hidden = true;
  await pollStatus();
  if (!page.stopped) readFeed();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", onKey);
  start();
});
