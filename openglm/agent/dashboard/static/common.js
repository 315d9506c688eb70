// Shared by the dashboard pages: API calls with the bearer token, a fetch-based SSE reader (an
// EventSource cannot send the Authorization header), local-time formatting and small SVG charts.
"use strict";
const D = {};

D.token = function () {
  const m = location.hash.match(/token=([^&]+)/);  // a link may carry it once: #token=...
  if (m) {
    sessionStorage.setItem("openglm-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("openglm-token") || "";
};

D.headers = function () {
  const t = D.token();
  return t ? { Authorization: "Bearer " + t } : {};
};

D.askToken = function () {
  if (document.getElementById("token-form")) return;
  const form = D.el("form", { id: "token-form", class: "panel", "aria-label": "Sign in" },
    D.el("label", { for: "token-input" }, "This server needs its bearer token: "),
    D.el("input", { id: "token-input", type: "password", autocomplete: "off" }),
    " ", D.el("button", { type: "submit", class: "primary" }, "Use token"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("openglm-token", document.getElementById("token-input").value);
    location.reload();
  });
  document.querySelector("main").prepend(form);
};

D.api = async function (path, opts = {}) {
  const headers = { ...D.headers(), ...(opts.body ? { "Content-Type": "application/json" } : {}) };
  const r = await fetch(path, { ...opts, headers });
  const text = await r.text();
  let body;
  try { body = JSON.parse(text); } catch (e) { body = text; }
  if (!r.ok) {
    if (r.status === 401) D.askToken();
    const detail = body && typeof body === "object" ? (body.detail ?? body) : body;
    throw new Error(`${r.status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
  }
  return body;
};

// Server-sent events over fetch. onEvent(kind, data) returning false ends the stream; it reconnects
// (after 1 s) when the connection drops; url() is called again so it can resume from the last seen id.
D.stream = function (url, onEvent, onState) {
  let stopped = false, ctrl = null;
  (async () => {
    while (!stopped) {
      ctrl = new AbortController();
      try {
        const r = await fetch(url(), { headers: { ...D.headers(), Accept: "text/event-stream" }, signal: ctrl.signal });
        if (!r.ok) { if (r.status === 401) D.askToken(); throw new Error("HTTP " + r.status); }
        if (onState) onState("live");
        const reader = r.body.getReader(), dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            let kind = "message", data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) kind = line.slice(7);
              else if (line.startsWith("data: ")) data += line.slice(6);
            }
            if (data && onEvent(kind, JSON.parse(data)) === false) { stopped = true; ctrl.abort(); return; }
          }
        }
      } catch (e) {
        if (stopped) return;
      }
      if (onState) onState("reconnecting");
      await new Promise((res) => setTimeout(res, 1000));
    }
  })();
  return { stop() { stopped = true; if (ctrl) ctrl.abort(); } };
};

D.el = function (tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
};

// Times: always the viewer's own time zone (the browser's), with the zone named once per page.
D.zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
D.time = (ts) => ts ? new Date(ts * 1000).toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" }) : "—";
D.clock = (ts) => ts ? new Date(ts * 1000).toLocaleTimeString(undefined, { hour12: false }) : "—";
D.ago = function (ts) {
  if (!ts) return "—";
  const s = Math.max(0, Date.now() / 1000 - ts);
  return s < 60 ? `${Math.round(s)} s ago` : s < 3600 ? `${Math.round(s / 60)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
};
// A duration, rounded once to the unit shown (so 18 min 59.6 s is "19 min 0 s", never "18 min 60 s").
D.dur = function (s) {
  if (s === null || s === undefined) return "—";
  if (s < 9.95) return `${s.toFixed(1)} s`;
  if (s < 59.5) return `${Math.round(s)} s`;
  if (s < 3600 - 0.5) { const r = Math.round(s); return `${Math.floor(r / 60)} min ${r % 60} s`; }
  const r = Math.round(s / 60);
  return `${Math.floor(r / 60)} h ${r % 60} min`;
};
// A task's time against its timeout: the clock runs only while a worker runs the task; a finished task
// shows what it used, with no time left and no budget bar.
D.timeText = function (t) {
  if (t.clock === "finished") return t.timeout_s ? `${D.dur(t.elapsed_s)} used (timeout ${D.dur(t.timeout_s)})` : `${D.dur(t.elapsed_s)} used`;
  if (!t.timeout_s) return `${D.dur(t.elapsed_s)} elapsed (no timeout)`;
  return `${D.dur(t.elapsed_s)} of ${D.dur(t.timeout_s)}, ${D.dur(t.remaining_s)} left` + (t.clock === "stopped" ? " (clock stopped until it runs again)" : "");
};
D.bytes = function (b) {
  if (b === null || b === undefined) return "—";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(b < 10 && i ? 1 : 0)} ${u[i]}`;
};
// A monitor reading in the unit its graph uses (the monitor reports bytes, bytes/s, percent, seconds).
D.human = function (metric, v) {
  if (typeof v !== "number") return String(v);
  if (metric.startsWith("rss_growth")) return `${(v * 60 / 1048576).toFixed(1)} MB/min`;
  if (metric.endsWith("_bytes")) return D.bytes(v);
  if (metric.endsWith("_percent")) return `${v.toFixed(0)}%`;
  if (metric.endsWith("_s")) return `${v.toFixed(2)} s`;
  return String(+v.toPrecision(4));
};
D.alertText = (a) => a.metric ? `${a.metric} ${D.human(a.metric, a.value)} over ${D.human(a.metric, a.limit)}: ${a.action}` : a.text;
D.num = (n) => (n === null || n === undefined) ? "—" : Number(n).toLocaleString();
D.badge = (state) => D.el("span", { class: `badge s-${state}` }, state);
D.bar = function (used, label) {
  const pct = Math.round(100 * Math.min(1, Math.max(0, used || 0)));
  return D.el("div", { class: "bar" + (pct >= 90 ? " hot" : ""), role: "progressbar", "aria-label": label,
    "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct }, D.el("span", { style: `width:${pct}%` }));
};

// A line chart as inline SVG: series of [t, v] points, a threshold line (dashed, red) and event
// markers (e.g. the monitor's crossings). Tiny by design: no library, nothing fetched.
D.chart = function ({ title, unit = "", series, threshold = null, markers = [], fmt = (v) => v.toFixed(1) }) {
  const W = 600, H = 180, L = 56, R = 10, T = 10, B = 24;
  const pts = series.flatMap((s) => s.points);
  const mk = markers.filter((m) => m.v !== null && m.v !== undefined && isFinite(m.v));
  const ts = pts.map((p) => p[0]).concat(mk.map((m) => m.t));
  const vs = pts.map((p) => p[1]).concat(mk.map((m) => m.v)).concat(threshold ? [threshold.value] : []);
  const t0 = ts.length ? Math.min(...ts) : 0, t1 = ts.length ? Math.max(...ts) : 1;
  let v0 = Math.min(0, ...vs), v1 = Math.max(1e-9, ...vs) * 1.1;
  const x = (t) => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5);
  const y = (v) => T + (H - T - B) * (1 - (v - v0) / (v1 - v0 || 1));
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const last = series[0] && series[0].points.length ? series[0].points[series[0].points.length - 1][1] : null;
  const label = `${title}: ${last === null ? "no readings yet" : "latest " + fmt(last) + " " + unit}` +
    (threshold ? `; threshold ${fmt(threshold.value)} ${unit}` : "") + (mk.length ? `; ${mk.length} alert(s)` : "");
  const svg = node("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label });
  svg.append(node("title", {}, label));
  svg.append(node("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fbfcfd", stroke: "#d9dee6" }));
  for (const v of [v0, (v0 + v1) / 2, v1]) {
    svg.append(node("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", "font-size": 13, fill: "#5d6778" }, fmt(v)));
  }
  if (ts.length) {
    svg.append(node("text", { x: L, y: H - 6, "font-size": 13, fill: "#5d6778" }, D.clock(t0)));
    svg.append(node("text", { x: W - R, y: H - 6, "font-size": 13, fill: "#5d6778", "text-anchor": "end" }, D.clock(t1)));
  }
  if (threshold) {
    const ty = y(threshold.value);
    svg.append(node("line", { x1: L, x2: W - R, y1: ty, y2: ty, stroke: "#b3261e", "stroke-dasharray": "6 4", "stroke-width": 1.5, class: "threshold" }));
    svg.append(node("text", { x: W - R - 4, y: ty - 4, "text-anchor": "end", "font-size": 13, fill: "#b3261e" }, threshold.label));
  }
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    svg.append(node("path", { d, fill: "none", stroke: s.color || "#2457c5", "stroke-width": 2, class: "series" }));
    if (s.points.length === 1) svg.append(node("circle", { cx: x(s.points[0][0]), cy: y(s.points[0][1]), r: 3, fill: s.color || "#2457c5" }));
  }
  for (const m of mk) {
    svg.append(node("circle", { cx: x(m.t), cy: y(m.v), r: 5, fill: "#b3261e", stroke: "#fff", class: "marker" },));
    svg.lastChild.append(node("title", {}, m.label));
  }
  const box = D.el("figure", { class: "chart panel", style: "margin:0" },
    D.el("figcaption", {}, D.el("strong", {}, title), " ",
      D.el("span", { class: "value" }, last === null ? "no readings yet" : `${fmt(last)} ${unit}`)));
  box.append(svg);
  return box;
};
