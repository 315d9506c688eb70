"""The four-phase SWE policy on the agent runtime: environment -> diagnosis -> design -> verification.

Each phase is explicit state (`phase` events committed with the step, replayed on resume) with its
own prompt, tools and time/step budget. The model proposes; the checks (run as shell commands, so
they are recorded and snapshotted like any action) decide: a regression test must fail before the
fix, N candidate patches are scored and the least destructive passing one applied, the full suite
must pass before `submit` is let through. Failed designs go to the recovery ladder
(openglm.agent.resilience): L3 roll back to the regression-test snapshot and redesign, L4 re-plan
from diagnosis (workspace and conversation kept), L5 ask a human (NEEDS_INPUT).
"""

from __future__ import annotations

import copy
import json

from openglm.agent.llm.base import ToolCall
from openglm.agent.policy import ToolCallingPolicy
from openglm.agent.resilience import Failure, Level, RecoveryLadder
from openglm.swe.policy import prompts
from openglm.swe.policy.config import PHASES, SWEPolicyConfig
from openglm.swe.policy.tools import CHECKS, PHASE_TOOLS, check_call, echo_call, parse_check
from openglm.swe.repomap import render, repo_map

REPOMAP_ID = "openglm-repomap"


def initial_data() -> dict:
    return {"phase": "environment", "phase_steps": 0, "phase_started_s": 0.0, "mapped": False,
            "failing_tests": [], "regression": None, "design_base_step": None, "rounds": 0,
            "chosen": None, "verified": False, "ladder": {}, "pending_rollback": None,
            "ask_human": None, "note": ""}


class SWEPolicy(ToolCallingPolicy):
    name = "swe-four-phase"

    def __init__(self, config: SWEPolicyConfig | None = None):
        self.config = config or SWEPolicyConfig()
        super().__init__(context_limit=self.config.context_limit, system_prompt=prompts.SYSTEM)
        self._pd: dict | None = None  # phase data as of the last prepare/after_step (None on a redo)
        self._objective = ""
        self._map: tuple[str | None, str] = (None, "")  # (workspace, rendered repo map), built once

    def initial_messages(self, task):
        self._objective = task.objective
        return super().initial_messages(task)

    # ---- before the model call ----
    def prepare(self, ctx, state, tools):
        pd = self._data(state)
        events = []
        if pd["pending_rollback"] is not None:  # an L3 decision of the last step: carry it out now
            if pd["pending_rollback"] in state.steps:
                ctx.rollback(pd["pending_rollback"])
            pd["pending_rollback"] = None
            phase = {"phase": pd["phase"], "data": pd, "budget": self._budget(pd)}
            state.apply("phase", state.step, phase)
            events.append(("phase", phase))
        messages, _, more = super().prepare(ctx, state, tools)
        self._pd = pd
        prompt = self._phase_prompt(pd)
        if pd["phase"] == "environment" and not pd["ask_human"]:  # the prompt says the repo map is given
            prompt += "\n\nRepo map:\n" + self._repo_map(ctx.workspace)
        messages = messages + [{"role": "user", "content": prompt}]
        offered = [t for t in tools if t["function"]["name"] != "submit" or pd["phase"] == "verification"]
        return messages, offered + PHASE_TOOLS[pd["phase"]], events + more

    def _repo_map(self, workspace) -> str:
        key = str(workspace)
        if self._map[0] != key:
            self._map = (key, render(repo_map(workspace)))
        return self._map[1]

    def _budget(self, pd: dict) -> dict:
        """The phase's budget, shown by the dashboard next to the steps and time spent in the phase."""
        b = self.config.budgets[pd["phase"]]
        return {"steps": b.steps, "minutes": b.minutes}

    def _phase_prompt(self, pd: dict) -> str:
        if pd["ask_human"]:
            return prompts.HUMAN
        b = self.config.budgets[pd["phase"]]
        text = prompts.PHASE[pd["phase"]].format(minutes=b.minutes, steps=b.steps, n=self.config.n_candidates,
                                                 chosen=pd["chosen"])
        return text + (f"\n\n{pd['note']}" if pd["note"] else "")

    # ---- the model's answer -> actions ----
    def actions(self, response):
        pd = self._pd
        if pd is not None and pd["ask_human"]:
            question = pd["ask_human"] + ("\n\n" + response.content if response.content else "")
            return [(ToolCall(name="ask_user", arguments={"question": question}, id="openglm-ask"), True)]
        out = []
        for call, as_user in super().actions(response):
            out.append((self._translate(call, pd), as_user))
        return out

    def _translate(self, call: ToolCall, pd: dict | None) -> ToolCall:
        name = call.name
        if name not in CHECKS and name not in ("phase_done", "submit"):
            return call
        if pd is None:  # a step redone after a crash: phase state is rebuilt at the next step
            return echo_call(f"{name}: interrupted by a restart; call it again", call.id, ok=False)
        allowed = [t["function"]["name"] for t in PHASE_TOOLS[pd["phase"]]]
        if name == "submit":
            if pd["phase"] == "verification" and pd["verified"]:
                return call
            return echo_call("submit refused: the full suite has not passed after a scored fix yet "
                             "(run_suite in the verification phase)", call.id, ok=False)
        if name not in allowed:
            return echo_call(f"{name} is not available in the {pd['phase']} phase (tools: {allowed})",
                             call.id, ok=False)
        args = call.arguments
        if name == "phase_done":
            return echo_call(f"{pd['phase']} phase done: {args.get('summary', '')}", call.id)
        if name == "propose_candidates" and not pd["regression"]:
            return echo_call("write the regression test first (regression_test) and show it failing",
                             call.id, ok=False)
        request = dict(args)
        if name == "localize":
            request.setdefault("issue", self._objective)
        elif name == "propose_candidates":
            request = {"candidates": args.get("candidates", [])[: self.config.n_candidates],
                       "tests": pd["failing_tests"] + [pd["regression"]["test"]],
                       "suite": self.config.run_suite_when_scoring, "timeout": self.config.test_timeout}
        elif name in ("regression_test", "run_suite"):
            request["timeout"] = self.config.test_timeout
        return check_call(self.config.python, CHECKS[name], request, call.id)

    # ---- after the step ran: read the verdicts, move between phases ----
    def after_step(self, ctx, state, record):
        pd = self._data(state)
        events: list[tuple[str, dict]] = []
        pd["phase_steps"] += 1
        calls = {c.id: c for c in (record.response.tool_calls if record.response else [])}
        for obs in record.observations:
            if obs["call_id"] == REPOMAP_ID:
                pd["mapped"] = True
            elif obs["call_id"] == "openglm-ask":
                pd["ask_human"] = None
                ladder = self._ladder(pd, events)
                ladder.on_answer("asked")  # the human's answer ends the failure episode
                pd["ladder"] = ladder.state()
                self._enter(pd, "design" if pd["regression"] else "diagnosis", "the human was asked", ctx,
                            record.step, events)
            elif obs["call_id"] in calls:
                self._observe(pd, calls[obs["call_id"]], obs, ctx, record.step, events)
        self._check_budget(pd, ctx, record.step, events)
        events.append(("phase", {"phase": pd["phase"], "data": pd, "budget": self._budget(pd)}))
        self._pd = pd
        return events

    def _observe(self, pd, call, obs, ctx, step, events):
        name, check = call.name, parse_check(obs["output"])
        if name == "phase_done" and obs["ok"]:
            if pd["phase"] == "diagnosis":
                pd["failing_tests"] = list(call.arguments.get("failing_tests") or pd["failing_tests"])
            nxt = PHASES[PHASES.index(pd["phase"]) + 1] if pd["phase"] in ("environment", "diagnosis") else None
            if nxt:
                self._enter(pd, nxt, call.arguments.get("summary", ""), ctx, step, events)
        elif name == "localize" and check:
            pd["failing_tests"] = pd["failing_tests"] or check["failing"]
        elif name == "regression_test" and check:
            events.append(("regression_test", check))
            if check["failed_before_fix"]:
                pd["regression"] = {"test": check["test"], "path": check["path"]}
                pd["design_base_step"] = step  # redesigns roll back to here: test kept, fix gone
        elif name == "propose_candidates" and check:
            pd["rounds"] += 1
            events.append(("candidate_scores", {"round": pd["rounds"], "chosen": check["chosen"],
                                                "scores": [_brief(s) for s in check["scores"]]}))
            if check["chosen"] is not None:
                ladder = self._ladder(pd, events)
                ladder.on_success()
                pd["ladder"] = ladder.state()
                pd["chosen"], pd["verified"] = check["chosen"], False
                self._enter(pd, "verification", f"candidate {check['chosen']} chosen", ctx, step, events)
            else:
                why = "; ".join(f"{s['index']}: {s.get('why', '')}" for s in check["scores"])
                self._fail(pd, f"no candidate passed: {why}", check["scores"], ctx, step, events)
        elif name == "run_suite" and check:
            if check["ok"]:
                pd["verified"] = True
            else:
                self._fail(pd, f"the full suite fails after the fix: {check['failed'][:5]}", [], ctx, step,
                           events)

    def _fail(self, pd, why, scores, ctx, step, events, error_class="verification_failed"):
        ladder = self._ladder(pd, events)
        decision = ladder.on_failure(Failure(error_class, why), can_rollback=pd["design_base_step"] is not None)
        pd["ladder"] = ladder.state()
        if decision.level is Level.ROLLBACK:
            pd["pending_rollback"] = pd["design_base_step"]
            self._enter(pd, "design", "L3: roll back and redesign", ctx, step, events,
                        note=prompts.REDESIGN.format(why=why, n=self.config.n_candidates,
                                                     scores=json.dumps([_brief(s) for s in scores])[:3000]))
        elif decision.level is Level.REPLAN:  # keeps the workspace and the conversation: re-think, not undo
            self._enter(pd, "diagnosis", "L4: re-plan from diagnosis", ctx, step, events,
                        note=prompts.REPLAN.format(why=why))
        else:  # L5 (or a level this policy cannot act on): a human decides
            pd["ask_human"] = decision.question or why

    @staticmethod
    def _ladder(pd, events) -> RecoveryLadder:
        """The ladder, loaded from the phase data (its state travels with the committed step)."""
        return RecoveryLadder(on_event=lambda kind, data: events.append((kind, data))).load(pd["ladder"] or {})

    def _enter(self, pd, phase, reason, ctx, step, events, note: str = ""):
        """Move to `phase` (a `phase_transition` event); `note` is shown with the phase's prompt."""
        events.append(("phase_transition", {"from": pd["phase"], "to": phase, "reason": reason[:500],
                                             "step": step}))
        pd.update(phase=phase, phase_steps=0, phase_started_s=round(ctx.elapsed_s, 3), note=note)
        if phase == "design":
            pd["chosen"], pd["verified"] = None, False

    def _check_budget(self, pd, ctx, step, events):
        budget = self.config.budgets[pd["phase"]]
        over_steps = pd["phase_steps"] >= budget.steps
        over_time = ctx.elapsed_s - pd["phase_started_s"] > budget.minutes * 60
        if not (over_steps or over_time) or pd["ask_human"]:
            return
        why = f"{pd['phase']} budget spent ({'steps' if over_steps else 'time'})"
        if pd["phase"] in ("environment", "diagnosis"):
            self._enter(pd, PHASES[PHASES.index(pd["phase"]) + 1], why, ctx, step, events,
                        note=f"The {why}; move on with what is known.")
        else:
            self._fail(pd, why, [], ctx, step, events, error_class="stuck")

    def _data(self, state) -> dict:
        pd = copy.deepcopy(state.phase_data) if state.phase_data else {}
        return {**initial_data(), **pd}


def _brief(s: dict) -> dict:
    keys = ("index", "summary", "applies", "compiles", "new_pyflakes", "tests_pass", "suite_pass", "passes",
            "why", "lines_changed")
    out = {k: s[k] for k in keys if k in s}
    if "impact" in s:
        out["impact"] = s["impact"]["score"]
        out["callers"] = len(s["impact"]["callers"])
    return out
