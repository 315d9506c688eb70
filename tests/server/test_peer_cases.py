"""vLLM's and SGLang's GLM parser cases (tests/server/peer_glm_cases.py) through openglm's chat-output
parser, whole and streamed in several chunkings: each gives the peer's result, or, where the case is
marked `differs`, openglm's documented one."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

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
    fragments = [sum(1 for d in deltas for c in d.calls if c.id == call.id) for call in p.calls]
    return {"reasoning": msg.get("reasoning_content"), "content": msg.get("content"), "streamed": streamed,
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])],
            "fragments": fragments, "deltas": deltas}


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
    if "min_argument_fragments" in expect and any(n < expect["min_argument_fragments"] for n in result["fragments"]):
        bad.append(f"argument fragments {result['fragments']} < {expect['min_argument_fragments']}")
    for part in expect.get("args_text_contains", ()):
        if not any(part in args for _, args in result["calls"]):
            bad.append(f"arguments text lacks {part!r}")
    return bad


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_peer_case(case):
    for chunks in chunkings(case):
        result = parse(case, chunks)
        where = f"chunks={chunks!r}"[:300]
        if case.get("differs"):
            assert mismatches(result, case["expect"]), f"now matches the peer: drop its `differs` mark ({where})"
            assert not mismatches(result, case["openglm"]), (mismatches(result, case["openglm"]), where)
        else:
            assert not mismatches(result, case["expect"]), (mismatches(result, case["expect"]), where)
        # what a stream sent is never taken back
        assert "".join(d.content for d in result["deltas"]) == (result["content"] or ""), where
        assert "".join(d.reasoning for d in result["deltas"]) == (result["reasoning"] or ""), where


def test_every_difference_is_explained():
    differing = [c for c in CASES if c.get("differs")]
    assert all(c.get("openglm") for c in differing)
    assert len({c["id"] for c in CASES}) == len(CASES)
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    missing = [c["id"] for c in differing if c["id"] not in docs]
    assert not missing, f"docs/serving.md does not list the deliberate differences {missing}"
