"""vLLM's and SGLang's GLM parser cases (tests/server/peer_glm_cases.py) through openglm's chat-output
parser, and through the server's output path (`render.py`: the JSON body and the SSE stream a client
assembles), whole and streamed in several chunkings: each gives the peer's result, or, where the case is
marked `differs`, openglm's documented one."""

import asyncio
import importlib.util
import json
import random
from pathlib import Path

import pytest

from openglm.engine.outputs import CompletionOutput, RequestOutput
from openglm.server import render
from openglm.server.async_engine import Delta
from openglm.server.chat_output import ChatOutputParser


def load_cases():
    spec = importlib.util.spec_from_file_location("peer_glm_cases", Path(__file__).with_name("peer_glm_cases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


CASES = load_cases()


def chunkings(case) -> list[list[str]]:
    """The whole text, the peer's own chunks, one character at a time, and a few random cuts."""
    text = case["output"]
    out = [[text]] + ([case["chunks"]] if case.get("chunks") else [])
    if text:
        out.append(list(text))
    rng = random.Random(len(text))
    for _ in range(3):
        if len(text) > 2:
            cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
            out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def parse(case, chunks, parser=ChatOutputParser) -> dict:
    """What a client sees: the message, what was streamed before the end, argument deltas per call."""
    p = parser(case["thinking"], case["tools"])
    deltas = [p.feed(c) for c in chunks]
    streamed = "".join(d.content for d in deltas)
    deltas.append(p.finish())
    msg, _ = p.message("stop")
    fragments = [sum(1 for d in deltas if any(c.index == i and c.arguments for c in d.calls))
                 for i in range(len(p.calls))]
    return {"reasoning": msg.get("reasoning_content"), "content": msg.get("content"), "streamed": streamed,
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])],
            "fragments": fragments, "chunks": len(chunks), "deltas": deltas}


def mismatches(result: dict, expect: dict) -> list[str]:
    """How `result` differs from an expectation (empty: it matches)."""
    bad = []

    def text(v):
        return (v or "").strip()

    for key in ("reasoning", "content"):
        if key in expect and text(result[key]) != text(expect[key]):
            bad.append(f"{key}: {result[key]!r} != {expect[key]!r}")
    if "calls" in expect:
        got = [(name, json.loads(args)) for name, args in result["calls"]]
        if got != [(name, args) for name, args in expect["calls"]]:
            bad.append(f"calls: {got!r} != {expect['calls']!r}")
    for part in expect.get("content_contains", ()):
        if part not in (result["content"] or ""):
            bad.append(f"content lacks {part!r}")
    if "streamed_content" in expect and text(result["streamed"]) != text(expect["streamed_content"]):
        bad.append(f"streamed {result['streamed']!r} != {expect['streamed_content']!r}")
    least = expect.get("min_argument_fragments", 0)
    if result["chunks"] >= least and any(n < least for n in result["fragments"]):  # streamed finely enough
        bad.append(f"argument fragments {result['fragments']} < {least}")
    for part in expect.get("args_text_contains", ()):
        if not any(part in args for _, args in result["calls"]):
            bad.append(f"arguments text lacks {part!r}")
    return bad


def check(case, result, where):
    if case.get("differs"):
        assert mismatches(result, case["expect"]), f"now matches the peer: drop its `differs` mark ({where})"
        assert not mismatches(result, case["openglm"]), (mismatches(result, case["openglm"]), where)
    else:
        assert not mismatches(result, case["expect"]), (mismatches(result, case["expect"]), where)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_peer_case(case):
    for chunks in chunkings(case):
        result = parse(case, chunks)
        where = f"chunks={chunks!r}"[:300]
        check(case, result, where)
        # what a stream sent is never taken back
        assert "".join(d.content for d in result["deltas"]) == (result["content"] or ""), where
        assert "".join(d.reasoning for d in result["deltas"]) == (result["reasoning"] or ""), where
        for i, (_, args) in enumerate(result["calls"]):
            assert "".join(c.arguments for d in result["deltas"] for c in d.calls if c.index == i) == args, where


# ---- the same cases through the server's output path (render.py): the JSON body and the SSE stream ----
def engine_outputs(text: str, chunks: list[str]):
    """What the engine reports for `text` streamed in `chunks`: cumulative texts, the last one finished."""
    done = 0
    for k, chunk in enumerate(chunks):
        done += len(chunk)
        last = k == len(chunks) - 1
        choice = CompletionOutput(0, text[:done], [], "stop" if last else None)
        yield RequestOutput("r0", [1], [choice], last), [Delta(chunk, [], [], done - len(chunk))]


def served(case, chunks) -> tuple[dict, str, dict]:
    """(the non-streaming message and finish reason, the message a client assembles from the stream)."""
    meta = render.Meta("chatcmpl-1", 0, "m", None)
    outputs = list(engine_outputs(case["output"], chunks or [""]))
    body = render.chat_body(meta, outputs[-1][0], case["thinking"], case["tools"])

    async def stream():
        async def source():
            for out, deltas in outputs:
                yield 0, out, deltas
        return [c async for c in render.chat_stream(meta, source(), 1, False, case["thinking"], case["tools"])]

    assembled = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    finish = None
    for chunk in asyncio.run(stream()):
        (choice,) = chunk["choices"]
        finish = choice["finish_reason"] or finish
        delta = choice["delta"]
        for key in ("content", "reasoning_content", "reasoning"):
            assembled[key] += delta.get(key) or ""
        for call in delta.get("tool_calls", []):
            entry = assembled["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"].get("arguments", "")
    (choice,) = body["choices"]
    return choice["message"], choice["finish_reason"], {**assembled, "finish_reason": finish}


def as_result(message: dict, calls: list[tuple[str, str]]) -> dict:
    return {"reasoning": message.get("reasoning_content"), "content": message.get("content"), "streamed": "",
            "calls": calls, "fragments": [], "chunks": 0}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_peer_case_through_the_server(case):
    expect = case["openglm"] if case.get("differs") else case["expect"]
    if "streamed_content" in expect:
        expect = {k: v for k, v in expect.items() if k != "streamed_content"}  # the whole turn's content differs
    for chunks in chunkings(case):
        where = f"chunks={chunks!r}"[:300]
        message, finish, streamed = served(case, chunks)
        body_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert not mismatches(as_result(message, body_calls), expect), where
        # the stream, assembled as a client does, is the body
        assert streamed["content"] == (message["content"] or ""), where
        assert streamed["reasoning_content"] == streamed["reasoning"] == message.get("reasoning_content", ""), where
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed["tool_calls"].items())] == body_calls, where
        assert all(c["id"].startswith("call_") for c in streamed["tool_calls"].values()), where
        assert streamed["finish_reason"] == finish == ("tool_calls" if body_calls else "stop"), where


def test_every_difference_is_explained():
    differing = [c for c in CASES if c.get("differs")]
    assert all(c.get("openglm") for c in differing)
    assert len({c["id"] for c in CASES}) == len(CASES)
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    missing = [c["id"] for c in differing if c["id"] not in docs]
    assert not missing, f"docs/serving.md does not list the deliberate differences {missing}"
