"""One run of a task under a lease: the write-ahead step protocol.

Step n:
  1. unless the log already holds step n's model response (a crash came after it was recorded),
     call the model and append `model_request` + `model_response` (write-ahead);
  2. run the actions (tool calls) in the workspace;
  3. snapshot the workspace;
  4. append the tool calls, observations, snapshot and `step_committed` in ONE atomic write.
A SIGKILL anywhere loses at most the uncommitted step: on resume the workspace is restored to
the last committed snapshot, the state is rebuilt from the log and step n is redone from its
recorded response, so no model call is paid twice and no half-applied action survives.

Every event the run logs is applied to its state by `AgentState.apply`, as a resume would replay it.
The run asks `self.model` (a Model: the configured one inside the hook layers' model wrappers) and
acts in `self.tools` (an Environment: `RunTools` inside the tool wrappers).
"""

from __future__ import annotations

import time

from openglm.agent.faults import crashpoint
from openglm.agent.hooks import Hooks, RunContext, StepRecord
from openglm.agent.llm.base import ContextOverflowError, Model, ModelResponse
from openglm.agent.process import live_output_file, running_pidfile
from openglm.agent.state import rebuild
from openglm.agent.task import TERMINAL, TaskState
from openglm.agent.tools import Environment, ToolBox, ToolResult
from openglm.agent.tools.files import PathEscape, confine


class RunTools:
    """The toolbox as one run uses it: a command gets at most the time the task has left, its process
    group and live output are recorded in the task's folder, and a cancel or a lost lease stops it."""

    def __init__(self, toolbox: ToolBox, ctx: RunContext, task_dir):
        self.toolbox, self.ctx = toolbox, ctx
        self.pidfile, self.output_file = running_pidfile(task_dir), live_output_file(task_dir)

    def call(self, name: str, args: dict) -> ToolResult:
        return self.toolbox.call(name, args, timeout=self.ctx.remaining_s, pidfile=self.pidfile,
                                 output_file=self.output_file, should_stop=self._should_stop)

    def _should_stop(self) -> bool:
        return self.ctx.control == "cancel" or self.ctx.lease_lost


class TaskRun:
    def __init__(self, store, task, worker, model: Model, toolbox: ToolBox, snapshots, policy,
                 hooks: Hooks | None = None):
        self.store, self.task, self.worker = store, task, worker
        self.configured_model, self.toolbox, self.snapshots, self.policy = model, toolbox, snapshots, policy
        self.hooks = hooks or Hooks()
        self.constraints = task.parsed_constraints
        self.state = None
        self.ctx = RunContext(self)
        self.model: Model = model
        for wrap in self.hooks.model_wrappers:  # each wraps the one before: the last is the outermost
            self.model = wrap(self.model, self.ctx)
        self.tools: Environment = RunTools(toolbox, self.ctx, snapshots.git_dir.parent)
        for wrap in self.hooks.tool_wrappers:
            self.tools = wrap(self.tools, self.ctx)

    # ---- writing to the log (always fenced by our lease) ----
    def _append(self, events, fields=None):
        self.store.append(self.task.id, events, fields, worker=self.worker)

    def log(self, kind: str, data: dict):
        """Append one event at the current step and apply it to the state."""
        step = max(self.state.step, 0)
        self._append([(kind, step, data)])
        self.state.apply(kind, step, data)

    def _record(self, events, fields=None):
        """Append events (kind, step, data) in one write, then apply them to the state in order."""
        self._append(events, fields)
        for kind, step, data in events:
            self.state.apply(kind, step, data)

    # ---- the run ----
    def run(self) -> str:
        """Run until the task finishes, pauses or needs input; returns the state it ended in."""
        self.state = rebuild(self.policy.initial_messages(self.task), self.store.all_events(self.task.id))
        resumed = self.state.step >= 0
        self._append([("run_started", self.state.next_step, {"worker": self.worker, "resumed": resumed,
                                                             "limits": self.toolbox.describe()})],
                     {"started_at": self.task.started_at or time.time()})
        if resumed:
            self.snapshots.restore(self.state.snapshot)  # drop whatever the interrupted step left behind
            self._explain_fault_pause()
        else:
            sha = self.snapshots.take("step 0")
            self._commit(0, [("snapshot", {"id": sha, "changed": True})], sha)
        monitors = [factory(self.ctx) for factory in self.hooks.monitors]
        try:
            while True:
                stop = self._should_stop()
                if stop:
                    return self._finish(*stop)
                outcome = self._step()
                if outcome:
                    return outcome[0]  # already committed with the step
        finally:
            for m in monitors:
                m.stop()

    def _explain_fault_pause(self) -> None:
        """If the previous run paused on a fault (the store or the disk filled up), tell the model why
        before it redoes the step, instead of replaying the step that caused it blindly."""
        for e in reversed(self.store.all_events(self.task.id)[:-1]):  # [-1] is our own run_started
            if e.kind == "run_started":
                return
            reason = str(e.data.get("reason", "")) if e.kind == "state" else ""
            if e.data.get("state") == TaskState.PAUSED.value and ("store:" in reason or "disk full" in reason):
                content = (f"The task was paused during step {self.state.next_step}, which was not committed: "
                           f"{reason}. The workspace was restored to the last committed step. If that step writes "
                           "a lot of data, write less (or clean up first) rather than repeating it as it was.")
                events = [("guidance", {"content": content})]
                events += [("pending_discarded", {})] if self.state.pending else []
                self._record([(k, self.state.step, d) for k, d in events])
                return

    def _should_stop(self) -> tuple[str, str] | None:
        task = self.store.get_task(self.task.id)
        self.ctx.control = task.control
        if task.control == "cancel":
            return TaskState.CANCELLED.value, "cancelled by request"
        if self.ctx.remaining_s is not None and self.ctx.remaining_s <= 0:
            return TaskState.TIMED_OUT.value, f"timeout of {self.constraints.timeout_s:g}s reached"
        if task.control == "pause":
            return TaskState.PAUSED.value, "paused by request"
        for check in self.hooks.budgets:
            if reason := check(self.ctx):
                return TaskState.PAUSED.value, reason
        if self.ctx.pause_reason:
            return TaskState.PAUSED.value, self.ctx.pause_reason
        if self.ctx.input_question:
            return TaskState.NEEDS_INPUT.value, self.ctx.input_question
        if self.state.next_step > self.constraints.max_steps:
            return TaskState.FAILED.value, f"max_steps ({self.constraints.max_steps}) reached without submitting"
        return None

    def _step(self) -> tuple[str, str] | None:
        n = self.state.next_step
        response = self.state.pending
        if response is None:
            response = self._ask_model(n)
        crashpoint("after_model_response")
        observations, outcome, extra, args = [], None, [], {}
        for call, as_user in self.policy.actions(response):
            args[call.id] = call.arguments
            result, outcome_now, check = self._act(call)
            outcome = outcome or outcome_now
            extra += [("deliverables", check)] if check else []
            observations.append({"call_id": call.id, "name": call.name, "output": result.output, "ok": result.ok,
                                 "meta": result.meta, "as_user": as_user})
            crashpoint("after_tool")
            if outcome:
                break
        previous = self.state.snapshot
        sha = self.snapshots.take(f"step {n}")
        crashpoint("after_snapshot")
        record = StepRecord(n, response, observations, sha, changed=sha != previous)
        events = []
        for o in observations:
            events += [("tool_call", {"call_id": o["call_id"], "name": o["name"], "arguments": args[o["call_id"]]}),
                       ("observation", o)]
        events += extra + [("snapshot", {"id": sha, "changed": record.changed})]
        events += self.policy.after_step(self.ctx, self.state, record)
        self._commit(n, events, sha, outcome)
        crashpoint("after_commit")
        for callback in self.hooks.step_callbacks:
            callback(self.ctx, record)
        return outcome

    def _ask_model(self, n: int) -> ModelResponse:
        messages, tools, pre = self.policy.prepare(self.ctx, self.state, self.toolbox.specs())
        t0 = time.monotonic()
        try:
            response = self.model.query(messages, tools)
        except ContextOverflowError:
            if self.state.condensed_upto >= self.state.step:
                raise  # already condensed as far as it goes
            # recoverable: condense every earlier observation (an event, so a resume sees it too), ask again
            condense = {"upto_step": self.state.step, "reason": "context overflow"}
            self.state.apply("condensation", n, condense)
            messages, tools, more = self.policy.prepare(self.ctx, self.state, self.toolbox.specs())
            pre = pre + [("condensation", condense)] + more
            response = self.model.query(messages, tools)
        latency = time.monotonic() - t0
        t = self.task  # only this worker changes the token counters while it holds the lease
        t.prompt_tokens += response.prompt_tokens
        t.completion_tokens += response.completion_tokens
        t.model_calls += 1
        self._record([(k, n, d) for k, d in pre] + [
            ("model_request", n, {"messages": len(messages), "model": getattr(self.configured_model, "name", ""),
                                  **_added_messages(messages, self.state.messages())}),
            ("model_response", n, {"response": response.to_dict(), "latency_s": round(latency, 4),
                                   "prompt_tokens": response.prompt_tokens,
                                   "completion_tokens": response.completion_tokens})],
            {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
             "model_calls": t.model_calls, "phase": self.state.phase or f"step {n}"})
        return self.state.pending

    def _act(self, call) -> tuple[ToolResult, tuple[str, str] | None, dict | None]:
        if call.name == "submit":
            check = self.check_deliverables()
            if check["ok"]:
                return ToolResult("all deliverables present; task complete"), (
                    TaskState.SUCCEEDED.value, call.arguments.get("summary", "")), check
            failing = "\n".join(check["failing"])
            return ToolResult("not done yet; failing deliverables:\n" + failing, ok=False), None, check
        if call.name == "ask_user":
            question = str(call.arguments.get("question", ""))
            outcome = TaskState.NEEDS_INPUT.value, question
            return ToolResult("question sent to the user; the answer follows"), outcome, None
        if call.name == "_no_action" and call.arguments.get("truncated"):
            return ToolResult(f"Your reply was cut off by {call.arguments['truncated']} before its tool call was "
                              "complete, so that call was not run. Make it again with less in one reply: write a "
                              "long file in parts (create it short, then extend it with edit) and keep the text "
                              "before the call brief.", ok=False, meta={"truncated": True}), None, None
        if call.name == "_no_action":
            return ToolResult("No tool call found. Call a tool, or `submit` when done.", ok=False), None, None
        return self.tools.call(call.name, call.arguments), None, None

    def check_deliverables(self) -> dict:
        results, failing = [], []
        for d in self.constraints.deliverables:
            if d.path is not None:
                try:
                    ok = confine(self.snapshots.workspace, d.path).exists()
                except PathEscape:
                    ok = False
            else:
                ok = self.toolbox.call("bash", {"command": d.command}, timeout=self.ctx.remaining_s).ok
            results.append({"deliverable": d.describe(), "ok": ok})
            failing += [] if ok else [d.describe()]
        return {"ok": not failing, "results": results, "failing": failing}

    def _commit(self, n: int, events: list[tuple[str, dict]], sha: str, outcome: tuple[str, str] | None = None):
        """One atomic write: the step's events, its commit record and, if the step ended the run
        (submit succeeded, ask_user), the new state: a kill can never separate them."""
        fields = {"step": n, "snapshot": sha, "active_s": self.ctx.elapsed_s,
                  "progress": min(0.99, n / self.constraints.max_steps)}
        events = [(k, n, d) for k, d in events] + [("step_committed", n, {"snapshot": sha})]
        if outcome:
            state_events, state_fields = self._end_state(*outcome, step=n, snapshot=sha)
            events, fields = events + state_events, {**fields, **state_fields}
        self._record(events, fields)

    def rollback(self, to_step: int) -> str:
        sha = self.state.steps.get(to_step)
        if sha is None:
            raise ValueError(f"step {to_step} is not a committed step of the current history")
        self.snapshots.restore(sha)
        self._record([("rollback", self.state.step, {"to_step": to_step, "snapshot": sha, "by": "runtime"})],
                     {"snapshot": sha})
        return sha

    def _end_state(self, state: str, reason: str, step: int, snapshot: str):
        terminal = TaskState(state) in TERMINAL
        fields = {"state": state, "reason": reason, "worker": "", "control": "", "active_s": self.ctx.elapsed_s,
                  "phase": state.lower(), **({"finished_at": time.time()} if terminal else {}),
                  **({"progress": 1.0} if state == TaskState.SUCCEEDED.value else {})}
        return [("state", step, {"state": state, "reason": reason, "snapshot": snapshot})], fields

    def _finish(self, state: str, reason: str) -> str:
        events, fields = self._end_state(state, reason, self.state.step, self.state.snapshot)
        self._append(events, fields)
        return state


def _added_messages(messages: list[dict], conversation: list[dict]) -> dict:
    """What the policy sent beyond the conversation the log rebuilds (e.g. a phase prompt), so the
    trajectory viewer can show the prompt exactly as sent; a rewritten prompt is only flagged."""
    if len(messages) >= len(conversation) and messages[:len(conversation)] == conversation:
        return {"added": messages[len(conversation):]} if len(messages) > len(conversation) else {}
    return {"rewritten": True}
