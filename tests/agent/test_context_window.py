"""The agent's OpenAI client keeps conversations inside the endpoint's window and in OpenAI's order;
steps record tool replies before user observations; a context overflow is recoverable."""

import json

import pytest
from agent_testkit import call, turn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_glm_serve_e2e import check_openai_message_rules
from testutil import serve_in_thread

from openglm.agent import service
from openglm.agent.llm import ContextOverflowError, ReplayModel
from openglm.agent.llm.base import ModelResponse, ToolCall
from openglm.agent.llm.openai_chat import OpenAIChatModel, fit_messages
from openglm.agent.resilience.ladder import classify
from openglm.agent.state import AgentState, rebuild
from openglm.agent.worker import Worker


def _conversation(turns: int, output_chars: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Objective: fix it"}]
    for i in range(turns):
        msgs.append({"role": "assistant", "content": f"step {i}", "reasoning_content": f"thought {i}",
                     "tool_calls": [{"id": f"c{i}", "type": "function",
                                     "function": {"name": "bash", "arguments": json.dumps({"command": f"ls {i}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out{i} " + "x" * output_chars})
    return msgs


def _size(msgs):
    return sum(len(json.dumps(m)) for m in msgs)


def test_fit_keeps_objective_and_latest_turns_and_marks_what_it_cut():
    msgs = _conversation(30, 1500)
    fitted = fit_messages(msgs, budget=3000, keep_turns=3, chars_per_token=3.0)
    assert _size(fitted) <= 3000 * 3.0
    assert fitted[:2] == msgs[:2]  # system prompt and objective, untouched
    assert fitted[-6:] == msgs[-6:]  # the latest turns whole (reasoning too: all after the last user turn)
    text = json.dumps(fitted)
    assert "characters truncated" in text and "earlier turn(s) dropped" in text
    check_openai_message_rules(fitted)
    assert fit_messages(msgs[:6], budget=100_000) == msgs[:6]  # what fits is sent unchanged


def test_reasoning_is_kept_per_clear_thinking():
    msgs = _conversation(2, 10) + [{"role": "user", "content": "more"}] + _conversation(1, 10)[2:]
    fitted = fit_messages(msgs, budget=100_000)
    assert [m.get("reasoning_content") for m in fitted if m["role"] == "assistant"] == [None, None, "thought 0"]
    kept = fit_messages(msgs, budget=100_000, clear_thinking=False)
    assert [m.get("reasoning_content") for m in kept if m["role"] == "assistant"] == ["thought 0", "thought 1",
                                                                                       "thought 0"]


def test_tool_replies_come_right_after_their_calls():
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "x", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "y", "arguments": "{}"}}]},
            {"role": "user", "content": "Observation (repomap): ..."},
            {"role": "tool", "tool_call_id": "b", "content": "B"}]
    fitted = fit_messages(msgs, budget=100_000)
    check_openai_message_rules(fitted)
    assert [(m["role"], m.get("tool_call_id")) for m in fitted[2:]] == [("tool", "a"), ("tool", "b"), ("user", None)]
    assert fitted[2]["content"] == "[no result recorded]"


def test_a_step_records_tool_replies_before_user_observations():
    state = AgentState(initial=[{"role": "user", "content": "objective"}])
    response = ModelResponse(content="", tool_calls=[ToolCall("bash", {"command": "ls"}, id="c1"),
                                                     ToolCall("view", {"path": "x"}, id="c2")])
    observations = [{"call_id": "openglm-repomap", "name": "repomap", "output": "map", "as_user": True},
                    {"call_id": "c2", "name": "view", "output": "x!"}]
    state.add_step(1, response, observations, "sha")
    msgs = state.messages()
    check_openai_message_rules(msgs)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "user"]
    assert msgs[3]["content"] == "x!" and "not run" in msgs[2]["content"]


@pytest.fixture(scope="module")
def endpoint():
    """A fake OpenAI endpoint: /models reports a 900-token window; chat answers 400
    context_length_exceeded while the request is over `limit_chars` of messages."""
    app, seen, limit = FastAPI(), [], {"chars": 10**9}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 900}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        if len(json.dumps(body["messages"])) > limit["chars"]:
            return JSONResponse({"error": {"message": "maximum context length exceeded",
                                           "code": "context_length_exceeded"}}, status_code=400)
        return {"model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": "ok", "reasoning_content": "hmm"}}],
                "usage": {"prompt_tokens": len(json.dumps(body["messages"])) // 2, "completion_tokens": 1}}

    url, stop = serve_in_thread(app)
    yield f"{url}/v1", seen, limit
    stop()


def test_client_reads_the_window_and_always_sends_max_tokens(endpoint):
    url, seen, limit = endpoint
    limit["chars"] = 10**9
    model = OpenAIChatModel(url, "m", max_tokens=200)
    r = model.query(_conversation(20, 400))
    assert model.context_window == 900 and r.reasoning == "hmm"
    body = seen[-1]
    assert 1 <= body["max_tokens"] <= 200
    assert len(json.dumps(body["messages"])) / 3.0 + body["max_tokens"] <= 900
    check_openai_message_rules(body["messages"])
    assert model.chars_per_token < 3.0  # recalibrated from the endpoint's prompt_tokens (2 chars a token)
    assert r.to_message()["reasoning_content"] == "hmm"


def test_overflow_refits_then_is_a_recoverable_context_limit(endpoint):
    url, seen, limit = endpoint
    model = OpenAIChatModel(url, "m", max_tokens=100)
    limit["chars"] = 1200  # tighter than the client's estimate: the first try overflows, a refit fits
    n = len(seen)
    assert model.query(_conversation(20, 400)).content == "ok"
    assert len(seen) - n >= 2 and len(json.dumps(seen[-1]["messages"])) <= 1200
    limit["chars"] = 10  # nothing fits
    with pytest.raises(ContextOverflowError) as e:
        model.query(_conversation(3, 10))
    assert classify(e.value).error_class == "context_limit"


class _SmallWindowModel(ReplayModel):
    """A replay model whose window only takes condensed histories (raises like the client does)."""

    def __init__(self, turns, max_chars):
        super().__init__(turns)
        self.max_chars, self.overflows = max_chars, 0

    def query(self, messages, tools=None):
        if sum(len(str(m.get("content") or "")) for m in messages) > self.max_chars:
            self.overflows += 1
            raise ContextOverflowError("context length exceeded")
        return super().query(messages, tools)


def test_a_context_overflow_condenses_the_history_and_the_task_goes_on(store, config, workspace):
    turns = [turn(call("bash", command="python3 -c \"print('y' * 8000)\"")),
             turn(call("bash", command="echo ok > done.txt")), turn(call("submit", summary="done"))]
    task = service.submit(store, config, "print a lot", str(workspace))
    model = _SmallWindowModel(turns, max_chars=4000)
    assert Worker(config, store=store, model=model).run_one() == "SUCCEEDED"
    assert model.overflows == 1 and (workspace / "done.txt").is_file()
    condensed = [e.data for e in store.all_events(task.id) if e.kind == "condensation"]
    assert condensed and condensed[0]["reason"] == "context overflow"
    assert rebuild([], store.all_events(task.id)).condensed_upto >= 1  # a resume sees the condensation


def test_an_overflow_that_condensing_cannot_fix_pauses_with_that_reason(store, config, workspace):
    task = service.submit(store, config, "x" * 5000, str(workspace))
    model = _SmallWindowModel([turn(call("submit", summary="never"))], max_chars=100)
    assert Worker(config, store=store, model=model).run_one() == "PAUSED"
    assert store.get_task(task.id).reason.startswith("context overflow")
