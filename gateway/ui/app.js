// Haru console: plain JavaScript, no build step, no dependency. It reads the gateway's server-sent
// events (/ui/events) with fetch() so that it can send the bearer token, and draws the fleet from
// each snapshot. Every string from the server goes into the page as text, never as HTML.
"use strict";

const state = {
  token: sessionStorage.getItem("haru.token") || "",
  fleets: {},            // fleet -> last snapshot
  fleet: localStorage.getItem("haru.fleet") || "",
  flows: { promotion: [], demotion: [] },
  meanings: {},
  skew: 0,               // server clock - browser clock, seconds
  lastOps: "",           // what the past operations were fetched for
  timelineModel: null,
  disconnectedAt: null,
};

// ------------------------------------------------------------------------------------- helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style") el.style.cssText = v;  // CSSOM, allowed by the page's CSP (style attributes are not)
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}
const $ = (id) => document.getElementById(id);
function fill(el, ...children) { el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false)); }
const GiB = 1024 ** 3;
function gib(n) { return n >= 100 * GiB ? (n / GiB).toFixed(0) + " GiB" : (n / GiB).toFixed(1) + " GiB"; }
function now() { return Date.now() / 1000 + state.skew; }
function ago(iso) {
  if (!iso) return "";
  return duration(now() - Date.parse(iso) / 1000);
}
function duration(s) {
  s = Math.max(0, s);
  if (s < 60) return Math.floor(s) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}
function ms(n) { return n === null || n === undefined ? "—" : n < 1000 ? n + " ms" : (n / 1000).toFixed(2) + " s"; }
function clock(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}
function authHeaders(extra) {
  const hd = Object.assign({}, extra || {});
  if (state.token) hd["Authorization"] = "Bearer " + state.token;
  return hd;
}

// ------------------------------------------------------------------------------ the event stream

let backoff = 500;
let controller = null;
let watchdog = null;

async function connect() {
  if (controller) controller.abort();
  controller = new AbortController();
  const mine = controller;
  setConn(state.disconnectedAt ? "reconnecting" : "connecting");
  try {
    const resp = await fetch("/ui/events", { headers: authHeaders({ Accept: "text/event-stream" }), signal: mine.signal, cache: "no-store" });
    if (resp.status === 401) { showLogin(state.token ? "That token was refused." : ""); setConn("disconnected"); return; }
    if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
    backoff = 500;
    state.disconnectedAt = null;
    setConn("live");
    kick();
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      kick();
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        onBlock(block);
      }
    }
    throw new Error("the stream ended");
  } catch (err) {
    if (mine !== controller) return;  // replaced by a newer connection
    if (!state.disconnectedAt) state.disconnectedAt = new Date();
    setConn("disconnected");
    clearTimeout(watchdog);
    const wait = backoff;
    backoff = Math.min(backoff * 2, 5000);
    setTimeout(connect, wait);
  }
}

function kick() {
  // The gateway sends a keepalive every 15 s: 40 s of silence is a dead connection.
  clearTimeout(watchdog);
  watchdog = setTimeout(() => { if (controller) controller.abort(); }, 40000);
}

function onBlock(block) {
  let event = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  const msg = JSON.parse(data);
  if (event === "hello") { state.flows = msg.flows; state.meanings = msg.meanings; return; }
  if (event === "empty") { render(); return; }
  if (event !== "fleet") return;
  state.skew = msg.server_time - Date.now() / 1000;
  if (msg.deleted) delete state.fleets[msg.fleet]; else state.fleets[msg.fleet] = msg;
  render();
}

function setConn(s) {
  const el = $("conn");
  el.dataset.state = s;
  if (s === "live") el.textContent = "live";
  else if (s === "connecting") el.textContent = "connecting…";
  else el.textContent = "disconnected" + (state.disconnectedAt ? " since " + state.disconnectedAt.toLocaleTimeString([], { hour12: false }) : "") + " — reconnecting";
}

// ----------------------------------------------------------------------------------------- login

function showLogin(error) {
  $("login").hidden = false;
  const e = $("login-error");
  e.hidden = !error; e.textContent = error || "";
  $("token").focus();
}
$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem("haru.token", state.token);
  $("login").hidden = true;
  connect();
});

// ---------------------------------------------------------------------------------------- render

function current() {
  const names = Object.keys(state.fleets).sort();
  if (!names.includes(state.fleet)) state.fleet = names[0] || "";
  return state.fleets[state.fleet];
}

function render() {
  const names = Object.keys(state.fleets).sort();
  const sel = $("fleet");
  if (sel.options.length !== names.length || [...sel.options].some((o, i) => o.value !== names[i])) {
    sel.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
  }
  const snap = current();
  sel.value = state.fleet;
  if (!snap) {
    $("route").textContent = "no fleet yet: haru apply <layout>";
    $("domains").replaceChildren();
    return;
  }
  const view = snap.view || { domains: {} };
  $("route").replaceChildren("route → ", h("b", {}, snap.active || "nowhere"), " · revision " + snap.revision);
  renderBanner(snap, view);
  $("domains").replaceChildren(...Object.values(view.domains || {}).map((d) => renderDomain(snap, view, d)));
  renderOperation(view);
  const opsKey = state.fleet + "|" + (view.operation ? view.operation.op_id + ":" + (view.operation.steps || []).length : "") +
    "|" + (view.last_operation ? view.last_operation.op_id + ":" + view.last_operation.state : "");
  if (opsKey !== state.lastOps) { state.lastOps = opsKey; loadOperations(); }
  if (state.fleet !== state.costFleet) { state.costFleet = state.fleet; loadCost(); }
  if (state.timelineModel && !$("timeline").hidden) refreshTimeline();
}

function renderBanner(snap, view) {
  const b = $("banner");
  const intent = snap.intent || {};
  let text = "", bad = false;
  if (!snap.active) { text = "No active domain: nothing is routed yet."; bad = true; }
  else if (intent.active && intent.active.degraded) {
    text = "Active domain " + intent.active.domain + " is degraded" + (intent.active.degraded_since ? " for " + ago(intent.active.degraded_since) : "") + ": " + (intent.active.why || "");
  }
  if (intent.protection === "unprotected") {
    text = (text ? text + " — " : "") + "Fleet unprotected: no standby could take over (" +
      (intent.standbys || []).map((r) => r.domain + ": " + r.why).join("; ") + ")";
    bad = true;
  }
  const wc = view.weights_change;
  if (wc && wc.reason === "canary_rolled_back" && !(view.weights || {})[wc.domain]) {
    text = (text ? text + " — " : "") + (wc.at ? ago(wc.at) + " ago: " : "") + wc.detail;
  }
  if (view.declined) {
    text = (text ? text + " — " : "") + "Failover declined" + (view.declined_at ? " " + ago(view.declined_at) + " ago" : "") + ": " + view.declined;
    bad = true;
  }
  b.hidden = !text;
  b.className = "banner" + (bad ? " bad" : "");
  b.textContent = text;
}

const HOLDING = new Set(["loading", "resident", "waking"]);

function heldOn(view, d, index) {
  const residual = (view.policy && view.policy.sleep_residual_bytes) || 0;
  let held = 0;
  for (const m of Object.values(d.models || {})) {
    if (m.gpu_index !== index || m.runtime === "external") continue;
    const s = (m.residency || {}).state;
    if (HOLDING.has(s)) held += m.vram_bytes;
    else if (s === "sleeping") held += m.runtime === "vllm" ? residual : m.vram_bytes;
  }
  for (const t of Object.values(d.training || {})) if (t.gpu_index === index && t.running) held += t.vram_bytes;
  return held;
}

function renderGpu(view, d, g) {
  const total = g.memory_bytes || g.memory_total_bytes || 1;
  const capacity = Math.max(0, (g.memory_bytes || total) - (g.reserve_bytes || 0));
  const used = g.memory_used_bytes || 0;
  const held = heldOn(view, d, g.index);
  // declared: what the layout puts on this card (admitted models; the planner's figures)
  const declared = Object.values(d.models || {}).filter((m) => m.gpu_index === g.index && m.admitted !== false)
    .reduce((n, m) => n + m.vram_bytes, 0);
  // Memory held by processes Haru did not start (a neighbour on a rented GPU), when the agent accounts
  // per process (GpuView.accounted, foreign: [{pid, used_bytes}]); drawn only then.
  const foreign = g.accounted && Array.isArray(g.foreign) ? g.foreign.reduce((n, p) => n + (p.used_bytes || 0), 0) : 0;
  const pct = (n) => Math.min(100, (100 * n) / total).toFixed(2) + "%";
  const detached = g.present === false;
  const bar = h("div", { class: "bar" + (detached ? " detached" : ""), title: detached ? "detached" : "" },
    detached ? null : h("div", { class: "used", style: "width:" + pct(used) }),
    detached ? null : h("div", { class: "held", style: "width:" + pct(held) }),
    foreign ? h("div", { class: "foreign", style: "left:" + pct(Math.max(0, used - foreign)) + ";width:" + pct(foreign) }) : null,
    h("div", { class: "reserve", style: "width:" + pct(g.reserve_bytes || 0) }),
    h("div", { class: "declared", style: "left:calc(" + pct(declared) + " - 1px)", title: "declared " + gib(declared) }));
  const presence = g.present === false ? h("span", { class: "badge bad" }, "detached")
    : g.present === null || g.present === undefined ? h("span", { class: "badge muted" }, "not observed") : null;
  return h("div", { class: "gpu", dataset: { testid: "gpu-" + d.name + "-" + g.index } },
    h("div", { class: "gpu-title" },
      h("span", {}, h("b", {}, "GPU " + g.index), " " + (g.name || ""), " ", presence),
      h("span", {}, "held " + gib(held) + " · used " + gib(used) + " · declared " + gib(declared) + " · capacity " + gib(capacity) + " of " + gib(total))),
    bar,
    h("div", { class: "legend" },
      h("span", {}, h("i", { style: "background:var(--ok)" }), "held by Haru"),
      h("span", {}, h("i", { style: "background:#2e5f8f" }), "used (observed)"),
      h("span", {}, h("i", { style: "background:#e3e8ee" }), "declared"),
      foreign ? h("span", { dataset: { testid: "foreign-" + d.name + "-" + g.index } }, h("i", { style: "background:#a3423b" }),
        "foreign " + gib(foreign) + " (" + g.foreign.length + " process" + (g.foreign.length === 1 ? "" : "es") + ")") : null,
      h("span", {}, h("i", { style: "background:#2a313a" }), "reserve " + gib(g.reserve_bytes || 0))));
}

function stateCell(m) {
  const r = m.residency || { state: "unknown" };
  let reason = "";
  if (r.state === "lost") reason = r.reason + (r.detail ? ": " + r.detail : "");
  else if (r.state === "failed") reason = r.runtime_said || "";
  else if (r.state === "not_admitted") reason = "short by " + gib(r.short_by_bytes || m.short_by_bytes || 0);
  else if (r.state === "resident" && r.warmup_ms) reason = "warm-up " + ms(r.warmup_ms);
  else if (r.state === "sleeping") reason = "level " + (r.level || 1);
  else if (r.state === "loading" && r.attempt > 1) reason = "attempt " + r.attempt;
  else if (r.state === "stopped") reason = r.detail || "";
  return [h("span", { class: "state s-" + r.state }, r.state.replace("_", " ")),
    reason ? h("div", { class: "reason" }, reason) : null];
}

function renderDomain(snap, view, d) {
  const active = snap.active === d.name;
  const intent = snap.intent || {};
  const target = active ? intent.active : intent.standby && intent.standby.domain === d.name ? intent.standby : null;
  // Standbys are ranked (the order a failover promotes them in); the badge says where and why.
  const ranked = (intent.standbys || []).find((r) => r.domain === d.name);
  const label = active ? "active" : ranked && (intent.standbys || []).length > 1 ? "standby #" + ranked.rank : "standby";
  const badges = [h("span", { class: "badge " + (active ? "active" : "standby"), title: ranked ? ranked.why : "",
    dataset: { testid: "role-" + d.name } }, label)];
  if (ranked && !ranked.fit) badges.push(h("span", { class: "badge warn", title: ranked.why }, "not fit"));
  if (d.reachable === false) badges.push(h("span", { class: "badge bad" }, "unreachable"));
  if (!d.eligible) badges.push(h("span", { class: "badge warn", title: d.ineligible_why || "" },
    "ineligible" + (d.eligibility_since ? " for " + ago(d.eligibility_since) : "")));
  if (d.signalled) badges.push(h("span", { class: "badge bad signal", title: d.signalled, dataset: { testid: "signal-" + d.name } },
    "about to go" + (d.signalled_at ? " (" + ago(d.signalled_at) + ")" : "") + ": " + d.signalled));
  if (target && target.degraded) badges.push(h("span", { class: "badge warn", title: target.why || "" }, "degraded"));
  const buttons = [];
  const share = (view.weights || {})[d.name];
  if (share) badges.push(h("span", { class: "badge " + (active ? "active" : "warn"), dataset: { testid: "weight-" + d.name },
    title: "share of the fleet's traffic (haru route weight)" }, share + "%"));
  if (!active) {
    buttons.push(h("button", { class: "ghost", onclick: () => askWeight(d.name, share || 0), dataset: { testid: "weight-" + d.name } }, "Weight…"));
  } else if (Object.keys(view.weights || {}).length || Object.keys(view.model_weights || {}).length) {
    buttons.push(h("button", { class: "ghost", onclick: () => sendWeights({ reset: true }), dataset: { testid: "weights-reset" } }, "Reset weights"));
  }
  if (!active) {
    buttons.push(h("button", { onclick: () => askOperation("promote", d.name), dataset: { testid: "promote-" + d.name } }, "Promote"));
    buttons.push(h("button", { class: "ghost", onclick: () => askOperation("demote", d.name), dataset: { testid: "demote-" + d.name } }, "Demote"));
  }
  const rows = Object.values(d.models || {}).map((m) => {
    const r = m.residency || {};
    return h("tr", { dataset: { testid: "model-" + d.name + "-" + m.name, state: r.state || "unknown" } },
      h("td", { class: "model" }, h("button", { onclick: () => openTimeline(m.name) }, m.name)),
      h("td", {}, stateCell(m)),
      h("td", { class: "for", dataset: { since: r.since || "" } }, r.since ? ago(r.since) : ""),
      h("td", { class: "col-vram mono" }, gib(m.vram_bytes) + " · GPU " + m.gpu_index));
  });
  const training = Object.values(d.training || {}).map((t) =>
    h("div", { class: "training", dataset: { testid: "training-" + d.name + "-" + t.slot } },
      "training ", h("b", {}, t.slot), ": ",
      t.running ? h("span", { class: "state s-resident" }, "running") : h("span", { class: "state s-stopped" }, "stopped"),
      " ", h("span", { class: "for", dataset: { since: t.since || "" } }, t.since ? ago(t.since) : ""),
      !t.running && t.last_stop ? h("span", { class: "reason" }, " (" + t.last_stop + (t.last_exit_code !== null && t.last_exit_code !== undefined ? ", exit " + t.last_exit_code : "") + ")") : null,
      h("span", { class: "reason" }, " · " + gib(t.vram_bytes) + " on GPU " + t.gpu_index)));
  const agent = d.agent || {};
  return h("article", { class: "domain" + (active ? " active" : ""), dataset: { testid: "domain-" + d.name } },
    h("div", { class: "domain-head" }, h("h2", {}, d.name), ...badges, buttons.length ? h("span", { class: "btns" }, ...buttons) : null),
    h("div", { class: "sub" }, [d.provider, d.region, agent.host ? "agent " + agent.host + (agent.running ? "" : " (stopped)") : "no agent"].filter(Boolean).join(" · ")),
    ...(d.gpus || []).map((g) => renderGpu(view, d, g)),
    h("table", {}, h("thead", {}, h("tr", {}, h("th", {}, "model"), h("th", {}, "state"), h("th", {}, "for"), h("th", { class: "col-vram" }, "VRAM"))),
      h("tbody", {}, rows)),
    ...training);
}

function stepsOf(op) {
  const flow = state.flows[op.kind] || [];
  const byName = {};
  for (const s of op.steps || []) byName[s.step] = s;
  return flow.map((name) => byName[name] || { step: name, state: "pending" });
}

function renderOperation(view) {
  const op = view.operation || view.last_operation;
  const box = $("op-current");
  if (!op) { fill(box, h("p", { class: "muted" }, "No operation yet.")); return; }
  const running = !!view.operation;
  const head = h("div", { class: "op-line" },
    h("span", { class: "badge " + (running ? "warn" : op.state === "completed" ? "active" : "bad") }, running ? "in flight" : op.state),
    h("b", {}, op.kind + " of " + op.target), op.source ? "from " + op.source : null,
    h("span", { class: "reason" }, "reason: " + op.reason), h("span", { class: "mono" }, op.op_id),
    op.requested_at ? h("span", { class: "for", dataset: running ? { since: op.requested_at } : {} },
      running ? ago(op.requested_at) : clock(op.requested_at)) : null);
  const steps = h("div", { class: "steps", dataset: { testid: "steps" } }, stepsOf(op).map((s) =>
    h("div", { class: "step " + s.state, dataset: { testid: "step-" + s.step, state: s.state } },
      h("b", {}, s.step.replace(/_/g, " ")),
      s.state === "pending" ? "waiting" : s.state === "started" ? "running" + (s.attempt > 1 ? " (attempt " + s.attempt + ")" : "")
        : s.state + " · " + ms(s.took_ms), s.error ? h("div", { class: "error", title: s.error }, s.error)
        : s.state === "skipped" && s.detail ? h("div", { class: "muted", title: s.detail }, s.detail) : null)));
  const tried = (op.tried || []).length ? h("p", { class: "muted", dataset: { testid: "op-tried" } }, "tried first: " +
    op.tried.map((t) => t.target + (t.error ? " (" + t.step + " failed: " + t.error + ")" : "")).join(", ")) : null;
  fill(box, head, tried, steps, op.error ? h("p", { class: "error" }, "aborted: " + op.error.replace(/^(\w+): \1: /, "$1: ") + " (routing did not move)") : null);
}

async function loadOperations() {
  const fleet = state.fleet;
  if (!fleet) return;
  try {
    const resp = await fetch("/ui/api/operations?fleet=" + encodeURIComponent(fleet), { headers: authHeaders() });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    if (fleet !== state.fleet) return;
    const ops = data.operations.filter((o) => o.state !== "running").slice(0, 30);
    $("op-past").replaceChildren(...(ops.length ? ops.map(renderPastOp) : [h("p", { class: "muted" }, "None yet.")]));
  } catch (err) {
    $("op-past").replaceChildren(h("p", { class: "error" }, "Could not load operations: " + err.message));
  }
}

function renderPastOp(op) {
  return h("details", { class: "op", dataset: { testid: "past-" + op.op_id } },
    h("summary", {},
      h("span", { class: "badge " + (op.state === "completed" ? "active" : "bad") }, op.state),
      h("b", {}, op.kind + " of " + op.target), h("span", { class: "reason" }, op.reason),
      h("span", { class: "mono" }, clock(op.requested_at)), h("span", { class: "for" }, "took " + ms(op.duration_ms)),
      op.error ? h("span", { class: "error" }, op.error) : null),
    h("table", {}, h("thead", {}, h("tr", {}, h("th", {}, "step"), h("th", {}, "outcome"), h("th", {}, "wall"), h("th", {}, "agents"))),
      h("tbody", {}, op.steps.map((s) => h("tr", {},
        h("td", {}, s.step + (s.attempt > 1 ? " #" + s.attempt : "")),
        h("td", { class: s.state === "failed" ? "error" : "" }, s.state + (s.error ? ": " + s.error : "") + (s.state === "skipped" && s.detail ? ": " + s.detail : "")),
        h("td", { class: "mono" }, ms(s.duration_ms)), h("td", { class: "mono" }, ms(s.took_ms)))))));
}

// -------------------------------------------------------------------------------------- routers

async function loadRouters() {
  const fleet = state.fleet;
  if (!fleet) return;
  try {
    const resp = await fetch("/ui/api/routers?fleet=" + encodeURIComponent(fleet), { headers: authHeaders() });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    if (fleet !== state.fleet) return;
    $("routers").replaceChildren(...(data.routers.length ? [h("table", {},
      h("thead", {}, h("tr", {}, h("th", {}, "router"), h("th", {}, "kind"), h("th", {}, "state"), h("th", {}, "holds"), h("th", {}, "heard"))),
      h("tbody", {}, data.routers.map((r) => h("tr", { dataset: { testid: "router-" + r.router } },
        h("td", {}, r.router), h("td", {}, r.kind),
        h("td", { class: r.state === "applied" ? "" : "error" }, r.state + (r.state === "behind" ? " (route at " + data.revision + ")" : "") + (r.error ? ": " + r.error : "")),
        h("td", { class: "mono" }, "revision " + r.revision + (r.active ? " → " + r.active : "")),
        h("td", { class: "mono" }, r.silent_s.toFixed(1) + " s ago")))))]
      : [h("p", { class: "muted" }, "None reported (haru route follow).")]));
  } catch (err) {
    $("routers").replaceChildren(h("p", { class: "error" }, "Could not load routers: " + err.message));
  }
}
setInterval(loadRouters, 2000);

// ------------------------------------------------------------------------------------------ cost

const CLASSES = ["active", "standby_training", "standby_idle", "waking", "lost", "unreachable"];
const CLASS_WORDS = { active: "active", standby_training: "training", standby_idle: "idle", waking: "waking",
  lost: "lost", unreachable: "unreachable" };
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}
function hours(s) { return s < 60 ? s.toFixed(0) + " s" : s < 3600 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(s < 36000 ? 2 : 1) + " h"; }

async function loadCost() {
  const fleet = state.fleet;
  if (!fleet) return;
  try {
    const resp = await fetch("/ui/api/cost?fleet=" + encodeURIComponent(fleet) + "&hours=24", { headers: authHeaders() });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    if (fleet !== state.fleet) return;
    renderCost(data);
  } catch (err) {
    $("cost").replaceChildren(h("p", { class: "error" }, "Could not load the cost: " + err.message));
  }
}
setInterval(loadCost, 30000);

function renderCost(data) {
  // each domain's seconds by class, drawn over the whole window (a gap: no host, not billed)
  const span = (Date.parse(data.until) - Date.parse(data.since)) / 1000;
  const cur = data.currency || "";
  const rows = Object.entries(data.domains).map(([name, d]) => {
    let x = 0;
    const segs = [];
    for (const c of CLASSES) {
      const s = d.seconds[c];
      if (!s) continue;
      const w = (1000 * s) / span;
      segs.push(svg("rect", { x: x.toFixed(2), y: "0", width: w.toFixed(2), height: "16", class: "seg-" + c, "data-class": c },
        svg("title", {}, CLASS_WORDS[c] + " " + hours(s) + (cur && d.cost[c] !== null ? ", " + d.cost[c] + " " + cur : ""))));
      x += w;
    }
    const unpriced = Object.values(d.unpriced_seconds).reduce((a, b) => a + b, 0);
    const money = (cur ? d.total_cost + " " + cur : "") + (unpriced > 0 ? (cur ? " · " : "") + "unpriced " + hours(unpriced) : "");
    return h("div", { class: "cost-row", dataset: { testid: "cost-" + name } },
      h("b", {}, name),
      svg("svg", { class: "cost-bar", viewBox: "0 0 1000 16", preserveAspectRatio: "none", role: "img",
        "aria-label": name + ": " + CLASSES.filter((c) => d.seconds[c]).map((c) => CLASS_WORDS[c] + " " + hours(d.seconds[c])).join(", ") }, ...segs),
      h("span", { class: "mono", dataset: { testid: "cost-money-" + name } }, money));
  });
  const legend = h("div", { class: "cost-legend" }, CLASSES.map((c) =>
    h("span", {}, svg("svg", { width: "10", height: "10" }, svg("rect", { width: "10", height: "10", class: "seg-" + c })), CLASS_WORDS[c])));
  const perM = data.per_million_tokens.with_ha;
  const sums = cur ? h("p", { class: "cost-sums", dataset: { testid: "cost-sums" } },
    "fleet " + data.cost + " " + cur + " · HA premium " + data.ha_premium + " · harvested by training " + data.harvested +
    " · " + data.total_tokens.toLocaleString() + " tokens" + (perM ? " · " + perM + " " + cur + " per million with HA, " +
    data.per_million_tokens.without_ha + " without" : "") + (data.complete ? "" : " · some hours unpriced"))
    : h("p", { class: "muted", dataset: { testid: "cost-sums" } }, "No price declared: hours only (docs/cost.md).");
  $("cost").replaceChildren(...(rows.length ? [legend, ...rows, sums] : [h("p", { class: "muted" }, "No domain yet.")]));
}

// -------------------------------------------------------------------------------------- timeline

function openTimeline(model) {
  state.timelineModel = model;
  $("tl-title").textContent = model + " — history, newest first";
  $("verify-out").textContent = "";
  $("tl-list").replaceChildren(h("li", {}, "Loading…"));
  $("timeline").hidden = false;
  loadTimeline(model, false);
}
// An open timeline follows the fleet, at most one reload a second (it reads the fleet's history).
let timelineTimer = null, timelineAt = 0;
function refreshTimeline() {
  if (timelineTimer) return;
  const wait = Math.max(0, 1000 - (Date.now() - timelineAt));
  timelineTimer = setTimeout(() => {
    timelineTimer = null; timelineAt = Date.now();
    if (state.timelineModel && !$("timeline").hidden) loadTimeline(state.timelineModel, true);
  }, wait);
}
let timelineBusy = false;
async function loadTimeline(model, quiet) {
  if (timelineBusy && quiet) return;
  timelineBusy = true;
  try {
    const url = "/ui/api/why?fleet=" + encodeURIComponent(state.fleet) + "&model=" + encodeURIComponent(model);
    const resp = await fetch(url, { headers: authHeaders() });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    if (state.timelineModel !== model) return;
    $("tl-list").replaceChildren(...data.events.map(renderItem));
  } catch (err) {
    if (!quiet) $("tl-list").replaceChildren(h("li", { class: "error" }, "Could not load: " + err.message));
  } finally { timelineBusy = false; }
}
function itemClass(type, p) {
  if (type === "model_lost" || type === "model_failed") return "t-lost";
  if (type === "operation_aborted") return "t-aborted";
  if (type === "model_resident") return "t-resident";
  if (type === "operation_completed") return "t-completed";
  if (type === "route_moved") return "t-route";
  return "";
}
function summary(type, p) {
  const keep = Object.entries(p || {}).filter(([k, v]) => !["model", "spec"].includes(k) && v !== "" && v !== null && v !== 0 && !(Array.isArray(v) && !v.length));
  return keep.map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : v)).join("  ");
}
function renderItem(it) {
  return h("li", { class: itemClass(it.type, it.payload), dataset: { seq: it.seq, type: it.type } },
    h("div", { class: "meta" }, "#" + it.seq + "  " + clock(it.time) + (it.domain ? "  on " + it.domain : "") + (it.cause ? "  caused by #" + it.cause : "")),
    h("div", { class: "what" }, it.type.replace(/_/g, " ")),
    h("div", { class: "body" }, summary(it.type, it.payload)));
}
$("tl-close").addEventListener("click", () => { $("timeline").hidden = true; state.timelineModel = null; });
$("timeline").addEventListener("click", (ev) => { if (ev.target === $("timeline")) $("tl-close").click(); });
$("verify-btn").addEventListener("click", async () => {
  const out = $("verify-out");
  out.className = ""; out.textContent = "verifying…";
  try {
    const resp = await fetch("/ui/api/verify?fleet=" + encodeURIComponent(state.fleet), { headers: authHeaders() });
    const data = await resp.json();
    if (!resp.ok) throw new Error((data.error && data.error.message) || "HTTP " + resp.status);
    out.className = data.ok ? "verify-ok" : "verify-bad";
    const first = (data.breaks && data.breaks[0]) || (data.misplaced && data.misplaced[0]);
    out.textContent = data.summary + (first ? " — first: " + first : "");
  } catch (err) { out.className = "verify-bad"; out.textContent = "could not verify: " + err.message; }
});

// ------------------------------------------------------------------------------ promote / demote

let pending = null;
function askOperation(verb, domain) {
  pending = { verb, domain, fleet: state.fleet };
  $("cf-title").textContent = (verb === "promote" ? "Promote " : "Demote ") + domain + "?";
  $("cf-text").textContent = verb === "promote"
    ? "Make " + domain + " the active domain of fleet " + state.fleet + ": stop its training, verify its GPUs, wake and probe its models, then move the route."
    : "Put " + domain + " to sleep and start its training (fleet " + state.fleet + "). The active domain cannot be demoted.";
  $("cf-ok").textContent = verb === "promote" ? "Promote" : "Demote";
  $("confirm").hidden = false;
  $("cf-ok").focus();
}
$("cf-cancel").addEventListener("click", () => { $("confirm").hidden = true; pending = null; });
$("cf-ok").addEventListener("click", async () => {
  const p = pending;
  $("confirm").hidden = true;
  pending = null;
  if (!p) return;
  try {
    const resp = await fetch("/v1/fleets/" + encodeURIComponent(p.fleet) + "/" + p.verb, {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify({ domain: p.domain }),
    });
    let body = {};
    try { body = await resp.json(); } catch (e) { /* not JSON */ }
    const meaning = state.meanings[String(resp.status)] || "";
    const detail = body.message || (body.error && body.error.message) || "";
    toast(resp.status, meaning, detail + (body.op_id ? " (" + body.op_id + ")" : ""));
    if (resp.status === 401) showLogin("That token was refused.");
  } catch (err) { toast(0, "the request failed", err.message); }
});

// ------------------------------------------------------------------------- traffic weights (canaries)

function askWeight(domain, current) {
  const answer = window.prompt("Percent of fleet " + state.fleet + "'s traffic for " + domain +
    " (the active domain takes the rest; 0 takes it back). A sleeping domain is woken and probed first.", String(current || 10));
  if (answer === null) return;
  const share = Number(answer);
  if (!Number.isInteger(share)) { toast(400, "not a whole percent", answer); return; }
  sendWeights({ weights: { [domain]: share } });
}

async function sendWeights(body) {
  try {
    const resp = await fetch("/v1/fleets/" + encodeURIComponent(state.fleet) + "/weights", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    let out = {};
    try { out = await resp.json(); } catch (e) { /* not JSON */ }
    const detail = out.message || (out.error && out.error.message) || "";
    toast(resp.status, state.meanings[String(resp.status)] || "", detail + (out.op_id ? " (" + out.op_id + ")" : ""));
    if (resp.status === 401) showLogin("That token was refused.");
  } catch (err) { toast(0, "the request failed", err.message); }
}

let toastTimer = null;
function toast(code, meaning, detail) {
  const t = $("toast");
  t.className = "toast " + (code === 202 || code === 200 ? "ok" : code === 409 ? "warn" : "bad");
  fill(t, h("span", { class: "code", dataset: { testid: "toast-code" } }, code || "error"), meaning, detail ? h("div", { class: "reason" }, detail) : null);
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, 12000);
}

// ------------------------------------------------------------------------------------------ start

$("fleet").addEventListener("change", (ev) => { state.fleet = ev.target.value; localStorage.setItem("haru.fleet", state.fleet); render(); });
document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") { $("confirm").hidden = true; $("tl-close").click(); } });
// "for how long" ticks every second without a new snapshot
setInterval(() => {
  for (const el of document.querySelectorAll("[data-since]")) if (el.dataset.since) el.textContent = ago(el.dataset.since);
}, 1000);
// A link may carry the token in its fragment (never sent to a server): keep it for this tab, drop it from the URL.
if (location.hash.startsWith("#token=")) {
  state.token = decodeURIComponent(location.hash.slice(7));
  sessionStorage.setItem("haru.token", state.token);
  history.replaceState(null, "", location.pathname + location.search);
}
connect();
