"""A task's trajectory for the viewer and the HTML export: one entry per model turn.

Each turn holds its prompt: the conversation as the runtime rebuilds it from the log
(`state.rebuild`, the same replay a resumed worker does), only the messages new since the previous
turn (so a 500-turn trajectory stays linear in size), plus what the policy added for this turn alone
(logged with the model request, e.g. the SWE policy's phase prompt); then the reply, its reasoning,
the tool calls with their results, and the verdicts the step produced (candidate scores,
deliverable checks, tests, phase moves).
"""

from __future__ import annotations

from openglm.agent.state import rebuild

VERDICT_KINDS = ("candidate_scores", "deliverables", "regression_test", "verification", "phase_transition",
                 "recovery_escalation", "rollback", "answer", "stuck", "restart")
MAX_TEXT = 20000  # characters of one message or result kept in the viewer


def _clip(text) -> str:
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + f"\n[... {len(text) - MAX_TEXT} characters more]"


def _message(m: dict) -> dict:
    out = {"role": m.get("role", "?"), "content": _clip(m.get("content") or "")}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"name": c["function"]["name"], "arguments": _clip(c["function"]["arguments"])}
                             for c in m["tool_calls"]]
    return out


def build(task, events, initial_messages: list[dict]) -> dict:
    turns: list[dict] = []
    by_step: dict[int, dict] = {}
    seen: list = []  # the prompt of the previous turn, to show only what is new

    request: dict = {}  # the model_request logged with the response (what the policy added to the prompt)

    def before(e, st):
        if e.kind == "model_request":
            request.clear()
            request.update(e.data)
        if e.kind != "model_response":
            return
        prompt = st.messages()
        n = len(seen)
        same_prefix = n <= len(prompt) and all(a == b for a, b in zip(seen, prompt[:n]))
        new = prompt[n:] if same_prefix else prompt
        seen[:] = prompt
        r = e.data.get("response", {})
        turn = {"step": e.step, "ts": e.ts, "prompt_messages": len(prompt),
                "prompt_rewritten": not same_prefix,  # condensed or rolled back: shown whole
                "policy_rewrote": bool(request.get("rewritten")),  # sent differently from the log's conversation
                "prompt": ([_message(m) for m in new]
                           + [{**_message(m), "added": True} for m in request.get("added", [])]),
                "reply": _clip(r.get("content") or ""),
                "reasoning": _clip(r.get("reasoning") or r.get("reasoning_content") or ""),
                "model": r.get("model", ""), "latency_s": e.data.get("latency_s"),
                "truncation": (r.get("truncation") or "max_tokens") if r.get("finish_reason") == "length" else "",
                "prompt_tokens": e.data.get("prompt_tokens", 0),
                "completion_tokens": e.data.get("completion_tokens", 0),
                "calls": [{"id": c.get("id", ""), "name": c.get("name"), "arguments": c.get("arguments"),
                           "result": None} for c in r.get("tool_calls", [])],
                "verdicts": [], "snapshot": None}
        turns.append(turn)
        by_step[e.step] = turn
        request.clear()

    state = rebuild(initial_messages, events, before=before)
    for e in events:
        turn = by_step.get(e.step)
        if turn is None:
            continue
        if e.kind == "observation":
            result = {"ok": e.data.get("ok"), "output": _clip(e.data.get("output", "")), "meta": e.data.get("meta", {})}
            slot = next((c for c in turn["calls"] if c["id"] and c["id"] == e.data.get("call_id")
                         and c["result"] is None), None)
            if slot is None:  # a ```bash block (no call id) or a control call the loop answered
                slot = {"id": e.data.get("call_id", ""), "name": e.data.get("name"), "arguments": None, "result": None}
                turn["calls"].append(slot)
            slot["result"] = result
        elif e.kind == "snapshot":
            turn["snapshot"] = e.data.get("id")
        elif e.kind in VERDICT_KINDS:
            turn["verdicts"].append({"kind": e.kind, "data": e.data})
    return {"task": {"id": task.id, "objective": task.objective, "state": task.state, "reason": task.reason,
                     "created_at": task.created_at, "finished_at": task.finished_at, "step": task.step,
                     "prompt_tokens": task.prompt_tokens, "completion_tokens": task.completion_tokens,
                     "phase": state.phase or task.phase},
            "turns": turns}
