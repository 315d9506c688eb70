// The task page: the event log streamed (the task API's own SSE), the dashboard hub's stream for the
// task's row and resource readings, and the running command's output; controls call the task API.
"use strict";
const ID = new URLSearchParams(location.search).get("id") || "";
const S = {
  info: null, control: true, thresholds: {}, samples: [], lastSeq: 0, steps: new Map(), ladder: [],
  marks: [], plan: null, phase: null, pending: null, diffStep: null, inRun: false, userRollbacks: [],
};
const MB = 1024 * 1024, GB = 1024 * MB;
const $ = (id) => document.getElementById(id);
const LADDER = new Set(["recovery_escalation", "recovery_outcome", "restart", "replan", "stuck", "model_switch",
  "budget_exhausted", "rollback", "loop_condensed", "verification"]);

function step(n) {
  if (!S.steps.has(n)) S.steps.set(n, { n, model: null, calls: [], obs: [], snapshot: null, start: null, end: null });
  return S.steps.get(n);
}

function fold(e) {
  S.lastSeq = Math.max(S.lastSeq, e.seq);
  const d = e.data || {};
  if (e.kind === "model_response") {
    const s = step(e.step);
    s.model = d; s.start = e.ts - (d.latency_s || 0);
    S.pending = e.step;
  } else if (e.kind === "tool_call") step(e.step).calls.push(d);
  else if (e.kind === "observation") step(e.step).obs.push(d);
  else if (e.kind === "snapshot") { const s = step(e.step); s.snapshot = d.id; s.changed = d.changed; }
  else if (e.kind === "step_committed") { const s = step(e.step); s.end = e.ts; if (S.pending === e.step) S.pending = null; }
  else if (e.kind === "phase") S.phase = d;
  else if (e.kind === "resilience_state" && d.plan) S.plan = d.plan;
  else if (e.kind === "resource_threshold_crossed" || e.kind === "resource_monitor_action") {
    S.marks.push({ t: e.ts, metric: d.metric, value: d.value, limit: d.limit, kind: e.kind, action: d.action, outcome: d.outcome });
  }
  else if (e.kind === "run_started") S.inRun = true;
  else if (e.kind === "state") S.inRun = false;
  // A rollback is the user's (the API, the CLI, this page) or the runtime's (the recovery ladder's L3, a
  // restart); logs from before the `by` field tell them apart by whether a run was going on.
  if (e.kind === "rollback" && (d.by || (S.inRun ? "runtime" : "user")) === "user") S.userRollbacks.push(e);
  else if (LADDER.has(e.kind)) S.ladder.push(e);
}

function ladderRow(e) {
  const d = e.data || {};
  const level = d.level !== undefined ? `L${d.level}` : e.kind === "rollback" ? "L3" : e.kind === "replan" ? "L4" : "—";
  const cause = d.cause || d.detail || d.failure || d.kind || d.error_class || (e.kind === "rollback" ? "rollback" : "");
  const action = e.kind === "recovery_escalation" ? `${d.error_class || ""} → level ${d.level}, attempt ${d.attempt}` +
    (d.delay_s ? `, retry in ${d.delay_s}s` : "") + (d.question ? `, asks: ${d.question}` : "") :
    e.kind === "recovery_outcome" ? `outcome: ${d.outcome || JSON.stringify(d)}` :
    e.kind === "rollback" ? `workspace back to step ${d.to_step}` : `${e.kind}: ${JSON.stringify(d).slice(0, 200)}`;
  return D.el("tr", {}, D.el("td", { "data-label": "Time" }, D.time(e.ts)), D.el("td", { "data-label": "Step" }, e.step),
    D.el("td", { "data-label": "Level" }, level), D.el("td", { "data-label": "Cause" }, String(cause).slice(0, 300)),
    D.el("td", { "data-label": "Action" }, action));
}

function short(v, n = 160) { const s = typeof v === "string" ? v : JSON.stringify(v); return s.length > n ? s.slice(0, n) + "…" : s; }

function renderTimeline() {
  const rows = [...S.steps.values()].filter((s) => s.n > 0).sort((a, b) => b.n - a.n).slice(0, 300);
  $("timeline").tBodies[0].replaceChildren(...rows.map((s) => {
    const m = s.model;
    const resp = m && m.response ? m.response : {};
    const calls = s.calls.length ? s.calls : (resp.tool_calls || []);
    return D.el("tr", { "data-step": s.n },
      D.el("td", { "data-label": "Step" }, String(s.n), s.end ? null : D.el("div", { class: "muted" }, "running")),
      D.el("td", { "data-label": "Model call" }, m ? `${(m.latency_s || 0).toFixed(2)} s, ${m.prompt_tokens || 0}+${m.completion_tokens || 0} tok` : "—",
        resp.content ? D.el("div", { class: "muted" }, short(resp.content)) : null,
        resp.finish_reason === "length" ? D.el("div", { class: "fail" }, `reply cut off by ${resp.truncation || "max_tokens"}`) : null),
      D.el("td", { "data-label": "Tool calls" }, calls.map((c) => D.el("div", { class: "mono" }, `${c.name} ${short(c.arguments, 200)}`))),
      D.el("td", { "data-label": "Observation" }, s.obs.map((o) => D.el("details", {},
        D.el("summary", {}, D.el("span", { class: o.ok ? "ok" : "fail" }, o.ok ? "ok" : "failed"),
          o.meta && o.meta.exit_code !== undefined ? ` exit ${o.meta.exit_code}` : "", o.meta && o.meta.killed ? ` (${o.meta.killed})` : "",
          o.meta && o.meta.duration_s !== undefined ? `, ${o.meta.duration_s} s` : ""),
        D.el("pre", {}, (o.output || "").slice(0, 4000))))),
      D.el("td", { "data-label": "Duration" }, s.end && s.start ? D.dur(s.end - s.start) : "—"),
      D.el("td", { "data-label": "Snapshot", class: "mono" }, s.snapshot ? s.snapshot.slice(0, 10) : "—",
        s.changed === false ? D.el("div", { class: "muted" }, "unchanged") : null));
  }));
  $("ladder").tBodies[0].replaceChildren(...(S.ladder.length ? S.ladder.slice(-100).reverse().map(ladderRow)
    : [D.el("tr", {}, D.el("td", { colspan: 5, class: "muted" }, "no recovery events"))]));
  $("rollbacks").replaceChildren(...S.userRollbacks.slice(-20).reverse().map((e) => D.el("li", {},
    `${D.time(e.ts)}: rolled back by the user to step ${e.data.to_step} (snapshot ${String(e.data.snapshot).slice(0, 10)})`)));
  $("rollbacks").hidden = !S.userRollbacks.length;
  const pend = S.pending !== null ? S.steps.get(S.pending) : null;
  const cmd = pend && pend.model && pend.model.response ? (pend.model.response.tool_calls || []).find((c) => c.name === "bash") : null;
  $("live-cmd").textContent = cmd ? `step ${pend.n} running: ${cmd.arguments.command}` : "no command running (the last command's output is shown)";
}

function renderPlan() {
  const box = $("plan");
  const parts = [];
  if (S.phase) {
    const pd = S.phase.data || {};
    const b = S.phase.budget;
    parts.push(D.el("p", {}, D.el("strong", {}, `Phase: ${S.phase.phase}`),
      pd.phase_steps !== undefined ? ` — ${pd.phase_steps}${b && b.steps ? "/" + b.steps : ""} steps in this phase` : "",
      b && b.minutes ? `, budget ${b.minutes} min` : ""));
  }
  if (S.plan && S.plan.root) {
    const visit = (g) => D.el("li", {}, D.el("span", { class: g.status === "done" ? "ok" : g.status === "failed" ? "fail" : "" }, `[${g.status}] `),
      g.text, g.note ? D.el("span", { class: "muted" }, ` (${g.note})`) : null, g.children && g.children.length ? D.el("ul", {}, g.children.map(visit)) : null);
    parts.push(D.el("ul", { "aria-label": `Plan, revision ${S.plan.revision}` }, visit(S.plan.root)));
  }
  box.replaceChildren(...(parts.length ? parts : [D.el("span", { class: "muted" }, "no plan or phase recorded (plain tool-calling policy)")]));
}

function renderInfo() {
  const t = S.info.task, r = S.info.row;
  $("task-id").textContent = t.id;
  $("state").replaceChildren(D.badge(t.state));
  document.body.dataset.state = t.state;
  $("objective").textContent = t.objective;
  const kv = [];
  const add = (k, ...v) => kv.push(D.el("dt", {}, k), D.el("dd", {}, ...v));
  add("State", t.state + (t.control ? ` (${t.control} requested)` : "") + (t.reason ? ` — ${t.reason}` : ""));
  if (r) {
    add("Time", D.timeText(r.time), r.time.used !== null && r.time.used !== undefined ? D.bar(r.time.used, "time budget used") : "");
    add("Alerts", ...(r.alerts.length ? r.alerts.slice(0, 5).map((a) => D.el("div", { class: `alert ${a.level}`, title: D.time(a.ts) }, D.alertText(a)))
      : [D.el("span", { class: "muted" }, "none")]));
    add("Steps", `${r.steps.committed} committed (max ${r.steps.max}), ${r.steps.model_calls} model calls`);
    add("Last activity", `${D.ago(r.last_activity.ts)} (${r.last_activity.kind}, ${D.time(r.last_activity.ts)})`);
    add("Cost", `${D.num(r.cost.tokens)} tokens (${D.num(r.cost.prompt_tokens)} in / ${D.num(r.cost.completion_tokens)} out)` +
      (r.cost.max_tokens ? `, cap ${D.num(r.cost.max_tokens)}` : ""));
  }
  add("Created", D.time(t.created_at));
  add("Workspace", D.el("span", { class: "mono" }, t.workspace));
  $("progress").replaceChildren(...kv);
  const running = t.state === "RUNNING", can = S.control;
  $("btn-pause").disabled = !can || !(running || t.state === "QUEUED") || t.control === "pause";
  $("btn-resume").disabled = !can || !(t.state === "PAUSED" || (running && t.control === "pause"));
  $("btn-cancel").disabled = !can || !["RUNNING", "QUEUED", "PAUSED", "NEEDS_INPUT"].includes(t.state) || t.control === "cancel";
  $("answer-form").hidden = t.state !== "NEEDS_INPUT";
  $("btn-answer").disabled = !can;
  $("question").textContent = t.reason;
  const sel = $("snap-step"), keep = sel.value;
  sel.replaceChildren(...S.info.snapshots.slice().reverse().map((s) => D.el("option", { value: s.step }, `step ${s.step} (${s.snapshot.slice(0, 10)})`)));
  if (keep && [...sel.options].some((o) => o.value === keep)) sel.value = keep;
  updateRollbackButton();
  if (!can) $("control-msg").textContent = "read-only key: controls are off";
}

function updateRollbackButton() {
  const t = S.info && S.info.task;
  const allowed = t && !["RUNNING", "QUEUED"].includes(t.state);
  $("btn-rollback").disabled = !S.control || !allowed || S.diffStep === null || String(S.diffStep) !== $("snap-step").value;
  if (t && !allowed) $("snap-msg").textContent = "pause the task to roll back";
  else if ($("snap-msg").textContent === "pause the task to roll back") $("snap-msg").textContent = "";
}

function series(key, scale = 1) {
  return S.samples.filter((s) => typeof s[key] === "number").map((s) => [s.ts, s[key] * scale]);
}

function marks(metric, scale) {
  return S.marks.filter((m) => m.metric === metric && typeof m.value === "number").map((m) => ({
    t: m.t, v: m.value * scale,
    label: `${D.time(m.t)}: ${m.metric} ${m.kind === "resource_monitor_action" ? "action " + m.action : "crossed"}`,
  }));
}

function renderCharts() {
  const th = S.thresholds, lim = (m, k) => th[m] ? { value: th[m].limit * k, label: `${th[m].floor ? "min" : "limit"} ${+(th[m].limit * k).toFixed(2)}` } : null;
  const cpuKey = series("cpu_percent").length ? "cpu_percent" : "worker_cpu_percent";
  const rssKey = series("rss_bytes").length ? "rss_bytes" : "tools_rss_bytes";
  const latest = S.samples.length ? S.samples[S.samples.length - 1] : {};
  const growth = (v, k, u) => typeof v === "number" ? `${(v * k / MB).toFixed(2)} ${u}` : "—";
  const charts = [
    D.chart({ title: "CPU", unit: "%", series: [{ points: series(cpuKey) }], threshold: lim("cpu_percent", 1), markers: marks("cpu_percent", 1) }),
    D.chart({ title: "Memory (RSS)", unit: "MB", series: [{ points: series(rssKey, 1 / MB), color: "#6a3fb5" }] }),
    D.chart({ title: "Memory growth (leak-rate estimate)", unit: "MB/min", series: [{ points: series("rss_growth_short", 60 / MB), color: "#a15c00" }],
      threshold: lim("rss_growth_short", 60 / MB), markers: marks("rss_growth_short", 60 / MB), fmt: (v) => v.toFixed(2) }),
    D.chart({ title: "Disk free", unit: "GB", series: [{ points: series("disk_free_bytes", 1 / GB), color: "#1c7c3c" }],
      threshold: lim("disk_free_bytes", 1 / GB), markers: marks("disk_free_bytes", 1 / GB) }),
    D.chart({ title: "Model endpoint latency", unit: "s", series: [{ points: series("endpoint_latency_s") }],
      threshold: lim("endpoint_latency_s", 1), markers: marks("endpoint_latency_s", 1), fmt: (v) => v.toFixed(2) }),
  ];
  charts[2].append(D.el("div", { class: "muted", id: "leak-rate" }, `leak rate: ${growth(latest.rss_growth_short, 60, "MB/min")} (short window), ` +
    `${growth(latest.rss_growth_long, 3600, "MB/h")} (long window; limit ${th.rss_growth_long ? (th.rss_growth_long.limit * 3600 / MB).toFixed(1) + " MB/h" : "—"})`));
  $("charts").replaceChildren(...charts);
  const alerts = S.marks.slice(-20).reverse();
  $("res-alerts").replaceChildren(D.el("strong", {}, "Resource alerts: "), ...(alerts.length ? alerts.map((m) =>
    D.el("div", { class: "alert error", "data-metric": m.metric }, `${D.time(m.t)} — ${m.metric} = ${D.human(m.metric, m.value)} ` +
      `(limit ${D.human(m.metric, m.limit)}): ${m.kind === "resource_monitor_action" ? `action ${m.action} — ${m.outcome || ""}` : "threshold crossed"}`))
    : [D.el("span", { class: "muted" }, "none")]));
}

let refreshTimer = null;
function refresh(delay = 250) {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(async () => {
    try {
      S.info = await D.api(`/v1/dash/tasks/${encodeURIComponent(ID)}`);
      S.thresholds = S.info.thresholds;
      if (!S.samples.length) S.samples = S.info.resources;
      renderInfo();
      renderCharts();
    } catch (e) { $("control-msg").textContent = String(e.message || e); }
  }, delay);
}

async function control(action, body) {
  $("control-msg").textContent = `${action}…`;
  try {
    const t = await D.api(`/v1/tasks/${encodeURIComponent(ID)}/${action}`, { method: "POST", body: body ? JSON.stringify(body) : undefined });
    $("control-msg").textContent = `${action}: now ${t.state}${t.control ? ` (${t.control} requested)` : ""}`;
  } catch (e) { $("control-msg").textContent = `${action} refused: ${e.message}`; }
  refresh(0);
}

$("btn-pause").addEventListener("click", () => control("pause"));
$("btn-resume").addEventListener("click", () => control("resume"));
$("btn-cancel").addEventListener("click", () => control("cancel"));
$("answer-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("answer-text").value.trim();
  if (!text) { $("control-msg").textContent = "write an answer first"; return; }
  control("answer", { answer: text }).then(() => { $("answer-text").value = ""; });
});
$("snap-step").addEventListener("change", () => { S.diffStep = null; $("diff").hidden = true; updateRollbackButton(); });
$("btn-diff").addEventListener("click", async () => {
  const n = $("snap-step").value;
  $("snap-msg").textContent = "computing diff…";
  try {
    const d = await D.api(`/v1/dash/tasks/${encodeURIComponent(ID)}/diff?step=${n}`);
    $("diff").hidden = false;
    const deletes = (d.name_status || []).filter((l) => l.startsWith("A\t")).map((l) => l.slice(2));
    const warn = deletes.length ? `Rolling back DELETES ${deletes.length} file(s) the snapshot does not have` +
      (d.in_place ? ` from your folder ${d.workspace} (used in place)` : "") + `:\n  ${deletes.slice(0, 50).join("\n  ")}` +
      (deletes.length > 50 ? `\n  ... and ${deletes.length - 50} more` : "") + "\n\n" : "";
    $("diff").textContent = d.files ? `${warn}Rolling back to step ${n} undoes these changes (${d.files} file(s)):\n${d.stat}\n${d.patch}${d.truncated ? "\n[... diff truncated]" : ""}`
      : `The workspace equals the snapshot of step ${n}: nothing to undo.`;
    S.diffDeletes = d.in_place ? deletes : [];  // the user's own folder: ask before deleting from it
    S.diffStep = n;
    $("snap-msg").textContent = "";
  } catch (e) { $("snap-msg").textContent = `diff failed: ${e.message}`; }
  updateRollbackButton();
});
$("btn-rollback").addEventListener("click", async () => {
  const n = Number($("snap-step").value);
  if (S.diffDeletes && S.diffDeletes.length && !window.confirm(`Roll back to step ${n}? ${S.diffDeletes.length} file(s) ` +
      `listed in the diff are deleted: ${S.diffDeletes.slice(0, 5).join(", ")}${S.diffDeletes.length > 5 ? ", ..." : ""}`)) {
    $("snap-msg").textContent = "not rolled back";
    return;
  }
  try {
    const t = await D.api(`/v1/tasks/${encodeURIComponent(ID)}/rollback`, { method: "POST", body: JSON.stringify({ step: n }) });
    $("snap-msg").textContent = `rolled back to step ${n} (snapshot ${t.snapshot.slice(0, 10)})`;
    S.diffStep = null; $("diff").hidden = true;
  } catch (e) { $("snap-msg").textContent = `rollback refused: ${e.message}`; }
  refresh(0);
});

async function start() {
  $("zone").textContent = `times in ${D.zone}`;
  $("traj-link").href = `trajectory.html?id=${encodeURIComponent(ID)}`;
  try {
    const me = await D.api("/v1/dash/me");
    S.control = me.control;
  } catch (e) { /* 401: the token form is shown */ }
  refresh(0);
  let renderTimer = null;
  D.stream(() => `/v1/tasks/${encodeURIComponent(ID)}/events?stream=true&after=${S.lastSeq}`, (kind, e) => {
    if (kind === "end") { refresh(0); return false; }
    fold(e);
    clearTimeout(renderTimer);
    renderTimer = setTimeout(() => { renderTimeline(); renderPlan(); renderCharts(); }, 100);
    if (["state", "step_committed", "rollback", "answer", "phase", "snapshot"].includes(e.kind)) refresh();
  }, (s) => { $("conn").textContent = s === "live" ? "live" : "reconnecting…"; });
  D.stream(() => "/v1/dash/stream", (kind, data) => {
    const r = (data.rows || []).find((x) => x.id === ID);
    if (!r || !S.info) return;
    S.info.row = r;
    const last = S.samples.length ? S.samples[S.samples.length - 1].ts : 0;
    if (r.resources && Object.keys(r.resources).length && r.updated_at > last) S.samples.push({ ts: r.updated_at, ...r.resources });
    if (r.state !== S.info.task.state || r.control !== S.info.task.control) refresh(0);
    else { renderInfo(); renderCharts(); }
  });
  const out = $("live-output");
  D.stream(() => `/v1/dash/tasks/${encodeURIComponent(ID)}/output`, (kind, d) => {
    if (kind === "reset") out.textContent = `$ ${d.command}${d.started ? `   (started ${D.time(d.started)})` : ""}\n`;
    else if (kind === "output") {
      const stick = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
      out.textContent = (out.textContent + d.text).slice(-200000);
      if (stick) out.scrollTop = out.scrollHeight;
    } else if (kind === "end") return false;
  });
}
start();
