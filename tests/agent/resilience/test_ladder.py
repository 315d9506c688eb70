"""The recovery ladder: escalation order, limits, reset, persistence; L1/L2 against a real HTTP server."""

import httpx
import pytest
from helpers import FaultServer

from openglm.agent.llm import FallbackModel, ModelError
from openglm.agent.llm.openai_chat import OpenAIChatModel
from openglm.agent.resilience import (
    Escalation,
    Failure,
    LadderConfig,
    LadderPolicy,
    Level,
    RecoveryLadder,
    classify,
    retry_call,
)


def _levels(ladder, error_class, n, **kw):
    return [ladder.on_failure(Failure(error_class, f"boom {i}"), **kw) for i in range(n)]


def test_transient_failures_climb_all_five_levels_with_backoff():
    events = []
    ladder = RecoveryLadder(on_event=lambda k, d: events.append((k, d)))
    decisions = _levels(ladder, "transient", 9)
    assert [int(d.level) for d in decisions] == [1, 1, 1, 2, 2, 3, 4, 5, 5]
    policy = LadderConfig().policy("transient")
    assert [d.delay_s for d in decisions[:3]] == [policy.backoff_s * 2**k for k in range(3)]
    assert decisions[7].question and "transient" in decisions[7].question
    escalations = [d for k, d in events if k == "recovery_escalation"]
    assert [e["level"] for e in escalations] == [1, 1, 1, 2, 2, 3, 4, 5, 5]
    assert all(h["outcome"] == "failed" for h in ladder.history)


def test_success_resets_and_records_the_outcome():
    ladder = RecoveryLadder()
    _levels(ladder, "transient", 4)  # reached L2
    ladder.on_success()
    assert ladder.history[-1]["outcome"] == "recovered" and ladder.history[-1]["level"] == 2
    assert ladder.on_failure(Failure("transient", "again")).level is Level.RETRY


def test_policies_per_error_class_and_rollback_only_with_a_green_snapshot():
    ladder = RecoveryLadder()
    assert [int(d.level) for d in _levels(ladder, "verification_failed", 3)] == [3, 4, 5]
    ladder = RecoveryLadder()
    assert [int(d.level) for d in _levels(ladder, "verification_failed", 2, can_rollback=False)] == [4, 5]
    ladder = RecoveryLadder()
    assert [int(d.level) for d in _levels(ladder, "stuck", 2)] == [4, 5]
    custom = LadderConfig(policies={"flaky": LadderPolicy(levels=(Level.RETRY,), retries=1, backoff_s=0)})
    ladder = RecoveryLadder(custom)
    assert [int(d.level) for d in _levels(ladder, "flaky", 2)] == [1, 5]  # L5 is always the last resort
    with pytest.raises(KeyError, match="no_such_class"):
        RecoveryLadder().on_failure(Failure("no_such_class", "x"))


def test_level_never_goes_down_within_an_episode_and_state_survives_a_new_process():
    ladder = RecoveryLadder()
    _levels(ladder, "verification_failed", 1)  # L3
    assert ladder.on_failure(Failure("transient", "timeout")).level is Level.REPLAN  # not back to L1
    restored = RecoveryLadder().load(ladder.state())
    assert restored.on_failure(Failure("transient", "timeout")).level is Level.HUMAN
    restored.on_answer("try the other module")
    assert restored.history[-1]["outcome"] == "answered" and restored.history[-1]["answer"]
    assert restored.on_failure(Failure("transient", "t")).level is Level.RETRY


def test_classify_http_and_exceptions():
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    for status, cls in [(500, "transient"), (503, "transient"), (429, "transient"), (404, "command_failed")]:
        exc = httpx.HTTPStatusError("e", request=req, response=httpx.Response(status, request=req))
        assert classify(exc).error_class == cls
    assert classify(httpx.ReadTimeout("slow")).error_class == "transient"
    assert classify(RuntimeError("maximum context length is 8192 tokens")).error_class == "context_limit"
    assert classify(ValueError("bad")).error_class == "command_failed"


def _chat(url, timeout=0.5):
    def call():
        resp = httpx.post(url + "/chat/completions", json={"messages": []}, timeout=timeout)
        resp.raise_for_status()
        return resp.json()["choices"][0]["message"]["content"]
    return call


def test_L1_endpoint_500_429_timeout_then_recovers():
    slept = []
    events = []
    ladder = RecoveryLadder(LadderConfig(policies={"transient": LadderPolicy(backoff_s=0.01)}),
                            on_event=lambda k, d: events.append((k, d)))
    with FaultServer(faults=["500", "429", "hang"], hang_s=1.0) as server:
        result = retry_call(_chat(server.url), ladder, sleep=lambda s: slept.append(s))
        assert result == "done" and server.requests == 4
    assert slept == [0.01, 0.02, 0.04]
    statuses = [d["detail"].get("status") for k, d in events if k == "recovery_escalation"]
    assert statuses == [500, 429, None]  # the third was the timeout
    assert ladder.history[-1]["outcome"] == "recovered" and ladder.floor == 0


def test_L2_is_the_fallback_models_turn_and_past_it_the_ladder_escalates():
    ladder = RecoveryLadder(LadderConfig(policies={"transient": LadderPolicy(backoff_s=0.0)}))
    levels = []

    def retried(model):  # what the resilience layer asks each model with: retries while the ladder says L1
        try:
            return retry_call(lambda: model.query([{"role": "user", "content": "hi"}]), ladder, sleep=lambda s: None)
        except Escalation as esc:
            levels.append(esc.decision.level)
            raise esc.error

    switched = []
    with FaultServer(default="500") as primary, FaultServer(reply="from fallback") as fallback:
        model = FallbackModel(OpenAIChatModel(primary.url, "p", timeout=0.5, context_window=4096),
                              OpenAIChatModel(fallback.url, "f", timeout=0.5, context_window=4096))
        assert model.answer(retried, on_switch=switched.append).content == "from fallback"
        assert levels == [Level.ALTERNATIVE] and switched == [1]
        assert primary.requests == 4 and fallback.requests == 1  # three retries, then the fallback once
    assert ladder.history[-1]["outcome"] == "recovered"
    with FaultServer(default="500") as dead, FaultServer(default="429") as dead_too:
        model = FallbackModel(OpenAIChatModel(dead.url, "p", timeout=0.5, context_window=4096),
                              OpenAIChatModel(dead_too.url, "f", timeout=0.5, context_window=4096))
        with pytest.raises(ModelError, match=r"primary failed .*; fallback failed"):
            model.answer(retried)
        assert dead_too.requests == 1  # the episode is already at L2: no retries for the fallback
        with pytest.raises(Escalation) as info:  # the next failure goes past the call: a rollback
            retry_call(lambda: model.query([{"role": "user", "content": "hi"}]), ladder, sleep=lambda s: None)
    assert info.value.decision.level is Level.ROLLBACK
