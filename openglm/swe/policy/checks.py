"""The policy's checking tools, run as shell commands in the workspace so that their work and
output go through the runtime's step protocol (recorded, snapshotted, replayable):

    python -m openglm.swe.policy.checks repomap|localize|search|bisect|regress|score|suite < request.json

Each prints a human-readable summary and, on its last line, `OPENGLM-CHECK <json>` for the policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MARKER = "OPENGLM-CHECK "


def _emit(summary: str, data: dict) -> None:
    print(summary)
    print(MARKER + json.dumps(data, separators=(",", ":")))


def repomap(req: dict) -> None:
    from openglm.swe.repomap import render, repo_map  # each check loads only what it runs (one process per check)

    m = repo_map(".")
    _emit(render(m, max_lines=60), {"files": m["n_python_files"], "tests": m["tests"]["count"]})


def localize(req: dict) -> None:
    from openglm.swe.localize import LocalizeConfig  # runs tests with coverage
    from openglm.swe.localize import localize as run

    out = run(".", req.get("failing_tests", []), issue=req.get("issue", ""), config=LocalizeConfig(top=10))
    top = {level: [x["location"] for x in out["combined"][level][:5]] for level in ("files", "functions", "lines")}
    text = "\n".join(f"top {level}:\n  " + "\n  ".join(v) for level, v in top.items())
    _emit(f"observed failing tests: {out['observed_failing']}\n{text}", {"top": top,
                                                                         "failing": out["observed_failing"]})


def search(req: dict) -> None:
    """The code knowledge base (openglm.retrieval): the repo's index if built, else live BM25."""
    from openglm.retrieval.code_index import search_repository  # FAISS + torch: only for this check

    hits, how = search_repository(".", req["query"], k=int(req.get("k", 10)), mode=req.get("mode", "hybrid"))
    rows = [{"location": h.location, "name": h.name, "score": round(h.score, 4)} for h in hits]
    text = "\n".join(f"  {r['location']}  {r['name']}  {r['score']}" for r in rows) or "  (no match)"
    _emit(f"code search ({how}) for {req['query'][:80]!r}:\n{text}", {"how": how, "hits": rows})


def bisect(req: dict) -> None:
    from openglm.swe.bisect import BisectRefused  # only for this check
    from openglm.swe.bisect import bisect as run

    try:
        out = run(".", req["good"], req["command"], bad=req.get("bad", "HEAD"))
    except BisectRefused as e:  # an end that does not behave: say why instead of naming a wrong commit
        _emit(f"bisect refused: {e}", {"first_bad_commit": None, "refused": str(e)})
        return
    _emit(f"first bad commit: {out['first_bad_commit']} {out.get('subject', '')}",
          {k: out.get(k) for k in ("first_bad_commit", "subject", "files")})


def regress(req: dict) -> None:
    """Write the regression test and run it: it must FAIL before the fix (TDD)."""
    from openglm.swe.testrun import run_tests  # only for this check

    path = Path(req["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(req["content"])
    run = run_tests(".", [req["test"]], timeout=req.get("timeout", 300))  # the repository's own runner
    failed = bool(run.failed)
    text = "\n".join(r["longrepr"][-1500:] for r in run.results.values() if r["longrepr"])
    verdict = ("FAILS before the fix, as it must" if failed else
               "PASSES before the fix: it does not reproduce the bug; write one that fails")
    _emit(f"regression test {req['test']}: {verdict}\n{text or run.output[-1500:]}",
          {"test": req["test"], "path": req["path"], "failed_before_fix": failed,
           "ran": bool(run.results)})


def score(req: dict) -> None:
    from openglm.swe.policy.scoring import score_and_apply  # only for this check

    out = score_and_apply(".", req["candidates"], req.get("tests", []), req.get("suite", True),
                          req.get("timeout", 600))
    lines = []
    for s in out["scores"]:
        status = "PASSES" if s.get("passes") else f"rejected ({s.get('why', '')})"
        imp = s.get("impact", {}).get("score", "-")
        lines.append(f"candidate {s['index']} [{s['summary']}]: applies={s['applies']} "
                     f"compiles={s.get('compiles')} new_pyflakes={len(s.get('new_pyflakes', []))} "
                     f"impact={imp} tests_pass={s.get('tests_pass')} suite_pass={s.get('suite_pass')} -> {status}")
    lines.append(f"chosen: {out['chosen']}")
    _emit("\n".join(lines), out)


def suite(req: dict) -> None:
    from openglm.swe.testrun import repo_runner, run_tests  # only for this check

    runner = repo_runner(".")
    run = run_tests(".", req.get("targets", []), runner=runner, timeout=req.get("timeout", 900))
    ok = bool(run.results) and not run.failed and not run.timed_out
    _emit(f"full suite: {len(run.passed)} passed, {len(run.failed)} failed {run.failed[:10]} (runner: {runner})",
          {"ok": ok, "runner": runner, "passed": len(run.passed), "failed": run.failed[:50]})


COMMANDS = {f.__name__: f for f in (repomap, localize, search, bisect, regress, score, suite)}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        print(f"usage: python -m openglm.swe.policy.checks {{{'|'.join(COMMANDS)}}} < request.json",
              file=sys.stderr)
        return 2
    raw = sys.stdin.read().strip()
    COMMANDS[argv[0]](json.loads(raw) if raw else {})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
