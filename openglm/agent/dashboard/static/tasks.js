// The tasks page: every task, updated live from /v1/dash/stream (one server-side poller for all viewers).
"use strict";
const rows = new Map();
const fresh = new Set();

function phaseCell(r) {
  const p = r.phase || {};
  const parts = [D.el("div", {}, p.name || "—")];
  if (p.budget && p.budget.steps) {
    parts.push(D.el("div", { class: "muted" }, `${p.steps ?? 0}/${p.budget.steps} phase steps` +
      (p.budget.minutes ? `, ${D.dur(p.elapsed_s || 0)} of ${p.budget.minutes} min` : "")));
    if (p.used !== null && p.used !== undefined) parts.push(D.bar(p.used, `phase budget used for ${r.id}`));
  } else if (p.steps !== null && p.steps !== undefined) {
    parts.push(D.el("div", { class: "muted" }, `${p.steps} steps in phase` + (p.elapsed_s !== null && p.elapsed_s !== undefined ? `, ${D.dur(p.elapsed_s)}` : "")));
  }
  return parts;
}

function timeCell(r) {
  const t = r.time;
  if (t.clock === "finished") return [D.el("div", {}, `${D.dur(t.elapsed_s)} used`),
    D.el("div", { class: "muted" }, t.timeout_s ? `finished (timeout ${D.dur(t.timeout_s)})` : "finished")];
  if (!t.timeout_s) return [D.el("div", {}, `${D.dur(t.elapsed_s)} elapsed`), D.el("div", { class: "muted" }, "no timeout")];
  return [D.el("div", {}, `${D.dur(t.elapsed_s)} of ${D.dur(t.timeout_s)}`),
    D.el("div", { class: "muted" }, `${D.dur(t.remaining_s)} left` + (t.clock === "stopped" ? " (clock stopped)" : "")),
    D.bar(t.used, `time budget used for ${r.id}`)];
}

function render() {
  const state = document.getElementById("f-state").value;
  const text = document.getElementById("f-text").value.trim().toLowerCase();
  const alertsOnly = document.getElementById("f-alerts").checked;
  const finished = ["SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"];
  const list = [...rows.values()].sort((a, b) => b.created_at - a.created_at).filter((r) =>
    (!state || (state === "active" ? !finished.includes(r.state) : r.state === state)) &&
    (!text || r.id.toLowerCase().includes(text) || r.objective.toLowerCase().includes(text)) &&
    (!alertsOnly || r.alert_count > 0));
  const body = document.querySelector("#tasks tbody");
  body.replaceChildren(...list.map((r) => {
    const tr = D.el("tr", { "data-task": r.id, "data-step": r.steps.committed, class: fresh.has(r.id) ? "flash" : null },
      D.el("td", { "data-label": "Task" }, D.el("a", { href: `task.html?id=${encodeURIComponent(r.id)}`, class: "nowrap" }, r.id),
        D.el("div", { class: "muted" }, r.objective)),
      D.el("td", { "data-label": "State" }, D.badge(r.state), r.control ? D.el("div", { class: "muted" }, `${r.control} requested`) : null,
        r.reason ? D.el("div", { class: "muted" }, r.reason) : null),
      D.el("td", { "data-label": "Phase" }, phaseCell(r)),
      D.el("td", { "data-label": "Time budget" }, timeCell(r)),
      D.el("td", { "data-label": "Steps", class: "steps" }, `${r.steps.committed} / ${r.steps.max}`,
        D.el("div", { class: "muted" }, `${r.steps.model_calls} model calls`)),
      D.el("td", { "data-label": "Last activity" }, D.el("span", { title: D.time(r.last_activity.ts) }, D.ago(r.last_activity.ts)),
        D.el("div", { class: "muted" }, r.last_activity.kind || "")),
      D.el("td", { "data-label": "Cost (tokens)" }, D.num(r.cost.tokens),
        D.el("div", { class: "muted" }, `${D.num(r.cost.prompt_tokens)} in / ${D.num(r.cost.completion_tokens)} out` +
          (r.cost.max_tokens ? ` (cap ${D.num(r.cost.max_tokens)})` : ""))),
      D.el("td", { "data-label": "Alerts", class: "alerts" }, r.alerts.length ? r.alerts.slice(0, 3).map((a) =>
        D.el("div", { class: `alert ${a.level}`, title: D.time(a.ts) }, D.alertText(a))) : D.el("span", { class: "muted" }, "none")));
    return tr;
  }));
  fresh.clear();
  document.getElementById("count").textContent = `${list.length} of ${rows.size} tasks`;
  document.getElementById("empty").hidden = list.length > 0;
}

document.getElementById("zone").textContent = `times in ${D.zone}`;
for (const id of ["f-state", "f-text", "f-alerts"]) document.getElementById(id).addEventListener("input", render);
D.stream(() => "/v1/dash/stream", (kind, data) => {
  if (kind !== "rows") return;
  if (data.full) rows.clear();
  for (const r of data.rows) { if (!data.full) fresh.add(r.id); rows.set(r.id, r); }
  document.body.dataset.version = data.version;
  render();
}, (s) => { document.getElementById("conn").textContent = s === "live" ? "live" : "reconnecting…"; });
setInterval(render, 10000);  // "12 s ago" ages between updates
