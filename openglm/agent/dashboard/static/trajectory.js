// The trajectory viewer: per model turn the prompt (new messages), the reply, its reasoning (folded),
// the tool calls with results, and the step's verdicts. Data from the API, or embedded by the export.
"use strict";

function msg(m) {
  return D.el("div", { class: `msg role-${m.role}` }, D.el("div", { class: "muted" }, m.role, m.added ? " (added by the policy for this turn)" : ""),
    D.el("pre", {}, m.content || ""), (m.tool_calls || []).map((c) => D.el("pre", {}, `→ ${c.name}(${c.arguments})`)));
}

function verdict(v) {
  const d = v.data || {};
  if (v.kind === "candidate_scores") {
    return D.el("div", { class: "verdict" }, D.el("strong", {}, `Candidates, round ${d.round}: chosen ${d.chosen ?? "none"}`),
      D.el("table", { class: "cards", "aria-label": `Candidate scores, round ${d.round}` },
        D.el("thead", {}, D.el("tr", {}, ["#", "summary", "passes", "tests", "suite", "impact", "lines", "verdict"].map((h) => D.el("th", {}, h)))),
        D.el("tbody", {}, (d.scores || []).map((s) => D.el("tr", { class: s.index === d.chosen ? "chosen" : "" },
          D.el("td", { "data-label": "#" }, s.index), D.el("td", { "data-label": "summary" }, s.summary || ""),
          D.el("td", { "data-label": "passes" }, String(s.passes ?? "")), D.el("td", { "data-label": "tests" }, String(s.tests_pass ?? "")),
          D.el("td", { "data-label": "suite" }, String(s.suite_pass ?? "")), D.el("td", { "data-label": "impact" }, String(s.impact ?? "")),
          D.el("td", { "data-label": "lines" }, String(s.lines_changed ?? "")),
          D.el("td", { "data-label": "verdict", class: s.index === d.chosen ? "ok" : "fail" }, s.index === d.chosen ? "chosen" : (s.why || "rejected")))))));
  }
  if (v.kind === "deliverables") {
    return D.el("div", { class: "verdict" }, D.el("strong", { class: d.ok ? "ok" : "fail" }, `Deliverables ${d.ok ? "all present" : "failing"}`),
      D.el("ul", {}, (d.results || []).map((r) => D.el("li", { class: r.ok ? "ok" : "fail" }, `${r.ok ? "✓" : "✗"} ${r.deliverable}`))));
  }
  return D.el("div", { class: "verdict" }, D.el("strong", {}, v.kind), " ", D.el("span", { class: "mono" }, JSON.stringify(d).slice(0, 600)));
}

function turn(t, i, open) {
  const calls = t.calls.map((c) => D.el("div", { class: "call" },
    D.el("div", { class: "mono" }, `${c.name}(${c.arguments === null ? "" : JSON.stringify(c.arguments)})`),
    c.result ? D.el("details", { open: open || null }, D.el("summary", {}, D.el("span", { class: c.result.ok ? "ok" : "fail" }, c.result.ok ? "ok" : "failed"),
      c.result.meta && c.result.meta.duration_s !== undefined ? ` in ${c.result.meta.duration_s} s` : "", " — result"),
      D.el("pre", {}, c.result.output)) : D.el("div", { class: "muted" }, "no result recorded (the step did not commit)")));
  return D.el("article", { class: "turn", id: `turn-${i + 1}`, "aria-label": `Turn ${i + 1}, step ${t.step}` },
    D.el("h3", {}, `Turn ${i + 1} · step ${t.step}`, D.el("span", { class: "muted" },
      ` · ${D.time(t.ts)} · ${t.model || "model"} · ${t.latency_s ?? "?"} s · ${t.prompt_tokens}+${t.completion_tokens} tokens`)),
    D.el("details", { open: open || i === 0 || null, class: "prompt" },
      D.el("summary", {}, `Prompt: ${t.prompt.length} new message(s) of ${t.prompt_messages}` + (t.prompt_rewritten ? " (context condensed or rolled back: shown whole)" : "") +
        (t.policy_rewrote ? " (the policy rewrote the prompt it sent: shown as the log rebuilds it)" : "")),
      t.prompt.map(msg)),
    D.el("div", { class: "msg role-assistant" }, D.el("div", { class: "muted" }, "reply"), D.el("pre", { class: "reply" }, t.reply || "(no text)"),
      t.truncation ? D.el("div", { class: "fail" }, `reply cut off by ${t.truncation}`) : null),
    t.reasoning ? D.el("details", { class: "reasoning" }, D.el("summary", {}, "Reasoning"), D.el("pre", {}, t.reasoning)) : null,
    calls.length ? D.el("div", {}, D.el("strong", {}, "Tool calls"), calls) : null,
    t.verdicts.length ? D.el("div", {}, t.verdicts.map(verdict)) : null,
    t.snapshot ? D.el("div", { class: "muted mono" }, `snapshot ${t.snapshot}`) : null);
}

function show(data) {
  const t = data.task;
  document.getElementById("task-id").textContent = t.id;
  document.getElementById("state").replaceChildren(D.badge(t.state));
  document.getElementById("objective").textContent = t.objective;
  document.getElementById("zone").textContent = `times in ${D.zone}`;
  const kv = [["State", `${t.state}${t.reason ? " — " + t.reason : ""}`], ["Created", D.time(t.created_at)],
    ["Finished", t.finished_at ? D.time(t.finished_at) : "—"], ["Turns", String(data.turns.length)],
    ["Tokens", `${D.num(t.prompt_tokens)} in / ${D.num(t.completion_tokens)} out`], ["Phase", t.phase || "—"]];
  document.getElementById("summary").replaceChildren(...kv.flatMap(([k, v]) => [D.el("dt", {}, k), D.el("dd", {}, v)]));
  const draw = () => {
    const q = document.getElementById("find").value.trim().toLowerCase();
    const open = document.getElementById("expand").checked;
    const shown = data.turns.map((x, i) => [x, i]).filter(([x]) => !q || JSON.stringify(x).toLowerCase().includes(q));
    document.getElementById("turns").replaceChildren(...shown.map(([x, i]) => turn(x, i, open)));
    document.getElementById("count").textContent = `${shown.length} of ${data.turns.length} turns`;
  };
  document.getElementById("find").addEventListener("input", draw);
  document.getElementById("expand").addEventListener("change", draw);
  draw();
  document.body.dataset.ready = "1";
}

if (window.TRAJECTORY) {
  document.getElementById("back").hidden = true;  // an exported file has no server to go back to
  show(window.TRAJECTORY);
} else {
  const id = new URLSearchParams(location.search).get("id") || "";
  document.getElementById("back").href = `task.html?id=${encodeURIComponent(id)}`;
  D.api(`/v1/dash/tasks/${encodeURIComponent(id)}/trajectory`).then(show).catch((e) => {
    document.getElementById("turns").textContent = `cannot load the trajectory: ${e.message}`;
  });
}
