"""Fault localisation on generated bug-injection instances (real PyPI packages, see openglm swe-gen),
or on real bugs (BugsInPy, `--real`), plus the SWE-bench-format harness figures on the same instances.

Injected bugs: for each instance the buggy revision is checked out and `openglm.swe.localize` runs
with the instance's FAIL_TO_PASS tests and problem statement. A hit at file / function / line level
means the injected bug's file / function / line is within the top-k of a technique's ranking. Results
are cached per instance (.bench/localize/results.seed<S>.jsonl), so a rerun resumes.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_localize.py [--per-package 30]
        [--packages a b] [--harness] [--workers 2] [--json out.json]

Real bugs (`--real`, instances from `openglm swe-gen --from-bugsinpy`): each instance is prepared as
the harness prepares it (checkout at the buggy commit, its venv over the instance's dependency
environment, the test patch applied) and localised twice: with the FAIL_TO_PASS tests (`--failing`
mode) and by running the whole suite (suite mode); a hit means a location the fix changes (any of its
files / functions / lines) is within the top k; stmt@5 counts a ranked line as a hit when it is a line
of a statement the fix changes (a fix inside a multi-line regex literal: coverage only ever reports
the statement's first and last lines). `--baseline REV` measures an earlier openglm commit on
the same instances (its localize run from a git worktree, the instance's packages on PYTHONPATH),
for before/after tables. See `real_main` and docs/swe.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openglm.swe.gen.generate import GenConfig, export_queries, generate  # noqa: E402
from openglm.swe.gen.packages import by_name  # noqa: E402
from openglm.swe.harness.instances import load_instances, load_predictions  # noqa: E402
from openglm.swe.localize import LocalizeConfig, localize  # noqa: E402
from openglm.util.git import git  # noqa: E402

TECHNIQUES = ("combined", "sbfl", "traceback", "text")
LEVELS = ("files", "functions", "lines")
KS = (1, 5)


def truth(inst: dict) -> dict[str, set[str]]:
    bug = inst["openglm_bug"]
    return {"files": {bug["file"]}, "functions": {f"{bug['file']}::{bug['function']}"},
            "lines": {f"{bug['file']}:{ln}" for ln in bug["lines"]}}


def first_hit_rank(ranking: list[dict], wanted: set[str]) -> int | None:
    for i, item in enumerate(ranking):
        if item["location"] in wanted:
            return i + 1
    return None


def workdir_for(inst: dict, repos: Path, work: Path) -> Path:
    """A private clone of the package repo (one per package), checked out at the buggy commit."""
    slug = inst["repo"].replace("/", "__")
    wd = work / slug
    if not (wd / ".git").exists():
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str((repos / slug).resolve()), str(wd)],
                       check=True)
    git(wd, "checkout", "-q", "--force", "--detach", inst["base_commit"])
    git(wd, "clean", "-q", "-fdx")
    return wd


def evaluate(inst: dict, repos: Path, work: Path) -> dict:
    wd = workdir_for(inst, repos, work)
    t0 = time.time()
    out = localize(wd, inst["FAIL_TO_PASS"], issue=inst["problem_statement"], config=LocalizeConfig(top=20))
    seconds = time.time() - t0
    want = truth(inst)
    ranks = {}
    for tech in TECHNIQUES:
        levels = out["combined"] if tech == "combined" else out["techniques"].get(tech, {})
        ranks[tech] = {lv: first_hit_rank(levels.get(lv, []), want[lv]) for lv in LEVELS}
    return {"instance_id": inst["instance_id"], "base_commit": inst["base_commit"],
            "package": inst["repo"].split("/")[-1],
            "kind": inst["openglm_bug"]["kind"], "ranks": ranks, "seconds": round(seconds, 2),
            "observed_failing": len(out["observed_failing"])}


def hit_table(rows: list[dict]) -> dict:
    table = {}
    for tech in TECHNIQUES:
        for lv in LEVELS:
            for k in KS:
                hits = sum(1 for r in rows if (rk := r["ranks"][tech][lv]) is not None and rk <= k)
                table[f"{tech}/{lv}/top{k}"] = hits / len(rows) if rows else 0.0
    return table


def print_tables(rows: list[dict], harness: dict | None) -> None:
    t = hit_table(rows)
    print(f"\nLocalisation on {len(rows)} instances from {len({r['package'] for r in rows})} packages "
          f"(median {statistics.median(r['seconds'] for r in rows):.1f}s per instance)\n")
    print(f"{'technique':<10} | {'file@1':>7} {'file@5':>7} | {'func@1':>7} {'func@5':>7} | "
          f"{'line@1':>7} {'line@5':>7}")
    print("-" * 68)
    for tech in TECHNIQUES:
        cells = [f"{100 * t[f'{tech}/{lv}/top{k}']:6.1f}%" for lv in LEVELS for k in KS]
        print(f"{tech:<10} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]} | {cells[4]} {cells[5]}")
    print("\ncombined, per package:")
    by_pkg = defaultdict(list)
    for r in rows:
        by_pkg[r["package"]].append(r)
    for pkg, rs in sorted(by_pkg.items()):
        tp = hit_table(rs)
        print(f"  {pkg:<26} n={len(rs):3d}  func@1 {100 * tp['combined/functions/top1']:5.1f}%  "
              f"func@5 {100 * tp['combined/functions/top5']:5.1f}%  line@5 {100 * tp['combined/lines/top5']:5.1f}%")
    by_kind = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    print("\ncombined, per mutation kind:")
    for kind, rs in sorted(by_kind.items()):
        tk = hit_table(rs)
        print(f"  {kind:<16} n={len(rs):3d}  func@1 {100 * tk['combined/functions/top1']:5.1f}%  "
              f"line@5 {100 * tk['combined/lines/top5']:5.1f}%")
    if harness:
        print("\nHarness (SWE-bench grading, isolated venv per instance):")
        for name, rep in harness.items():
            print(f"  {name:<7} resolved {rep['resolved_instances']}/{rep['total_instances']} "
                  f"({100 * rep['resolved_instances'] / max(rep['total_instances'], 1):.1f}%), "
                  f"unresolved {rep['unresolved_instances']}, errors {rep['error_instances']}, "
                  f"wall {rep['wall_s']:.0f}s")


def corrupt_patch(patch: str) -> str:
    """The patch with a removed line that is not in the file added to its first hunk (header
    counts kept consistent): neither `git apply` nor `patch --fuzz` can apply it, since fuzz only
    forgives context lines, so a harness must report it unresolved (patch not applied)."""
    lines = patch.splitlines(keepends=True)
    h = next(n for n, ln in enumerate(lines) if ln.startswith("@@"))
    lines[h] = re.sub(r"^@@ -(\d+)(?:,(\d+))?", lambda m: f"@@ -{m[1]},{int(m[2] or 1) + 1}", lines[h])
    lines.insert(h + 1, "-# openglm: a line that is not in the file\n")
    return "".join(lines)


def corrupt_predictions(instances: list[dict]) -> dict[str, dict]:
    return {i["instance_id"]: {"instance_id": i["instance_id"], "model_name_or_path": "corrupt",
                               "model_patch": corrupt_patch(i["patch"])} for i in instances}


def run_harness(instances: list[dict], repos: Path, out: Path, workers: int) -> dict:
    from openglm.swe.harness import HarnessConfig, run_evaluation

    results = {}
    for name in ("gold", "empty", "corrupt"):
        t0 = time.time()
        config = HarnessConfig(run_id=f"bench-{name}", out_dir=out, repos_dir=repos, workers=workers, timeout=300)
        # a fresh run: the harness resumes by instance id, and ids are reused when the set changes
        shutil.rmtree(out / "logs" / "run_evaluation" / config.run_id, ignore_errors=True)
        preds = corrupt_predictions(instances) if name == "corrupt" else load_predictions(name, instances)
        rep = run_evaluation(instances, preds, config)
        results[name] = {k: v for k, v in rep.items() if not k.endswith("_ids")} | {"wall_s": time.time() - t0}
    return results


def main() -> int:
    if "--real" in sys.argv:
        return real_main([a for a in sys.argv[1:] if a != "--real"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", nargs="*")
    ap.add_argument("--per-package", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=str(ROOT / ".bench"))
    ap.add_argument("--limit", type=int, default=0, help="evaluate only the first N instances")
    ap.add_argument("--harness", action="store_true", help="also grade gold and empty patches")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write the figures as JSON here")
    args = ap.parse_args()

    cache = Path(args.cache)
    gen_dir = cache / "swe-gen"
    path = generate(by_name(args.packages), GenConfig(out_dir=gen_dir, per_package=args.per_package, seed=args.seed))
    instances = load_instances(path)
    if args.limit:
        instances = instances[: args.limit]
    export_queries(instances, cache / "localize" / "queries.jsonl")
    results_file = cache / "localize" / f"results.seed{args.seed}.jsonl"
    done = {}
    if results_file.exists():
        commits = {i["instance_id"]: i["base_commit"] for i in instances}
        for line in results_file.read_text().splitlines():
            r = json.loads(line)
            if r.get("base_commit") == commits.get(r["instance_id"]):  # not a stale, other bug
                done[r["instance_id"]] = r
    work = cache / "localize" / "work"
    work.mkdir(parents=True, exist_ok=True)
    with results_file.open("a") as f:
        for inst in tqdm([i for i in instances if i["instance_id"] not in done], desc="localize", unit="inst"):
            r = evaluate(inst, gen_dir / "repos", work)
            done[r["instance_id"]] = r
            f.write(json.dumps(r) + "\n")
            f.flush()
    rows = [done[i["instance_id"]] for i in instances]
    harness = run_harness(instances, gen_dir / "repos", cache / "swe-eval", args.workers) if args.harness else None
    print_tables(rows, harness)
    if args.json:
        Path(args.json).write_text(json.dumps({"n": len(rows), "hits": hit_table(rows), "harness": harness},
                                              indent=2))
    return 0


# ---- real bugs (BugsInPy) -------------------------------------------------------------------------------
REAL_LEVELS = (("files", 1), ("functions", 1), ("functions", 5), ("lines", 1), ("lines", 5), ("statements", 5))
REAL_NAMES = {("files", 1): "file@1", ("functions", 1): "func@1", ("functions", 5): "func@5",
              ("lines", 1): "line@1", ("lines", 5): "line@5", ("statements", 5): "stmt@5"}
DEVELOPMENT = ("youtube-dl", "thefuck", "black")  # the projects localisation was tuned on
# runs an openglm revision's localize in a child process (--baseline): JSON config in, JSON result out
BASELINE_DRIVER = """
import json, sys
from openglm.swe.localize import LocalizeConfig, localize
req = json.load(sys.stdin)
known = set(LocalizeConfig.__dataclass_fields__)
config = LocalizeConfig(**{k: v for k, v in req["config"].items() if k in known})
print(json.dumps(localize(req["repo"], req["failing"], issue="", config=config)))
"""


def real_truth(inst: dict) -> dict[str, set[str]]:
    bug = inst["openglm_bug"]
    return {level: set(bug[level]) for level in ("files", "functions", "lines")}


def statement_lines(source: str) -> dict[int, range]:
    """{line: the lines of the innermost statement holding it} (a compound statement: its header only).
    Coverage reports a multi-line statement by the lines that hold bytecode, never by the inner lines
    of a long string or call, so a line-level localiser can only rank statements."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    spans: dict[int, range] = {}
    for node in ast.walk(tree):  # outer statements first: inner ones overwrite their lines
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno or node.lineno
            span = range(node.lineno, max(last, node.lineno) + 1)
            for line in span:
                if line not in spans or len(span) <= len(spans[line]):
                    spans[line] = span
    return spans


def statement_truth(inst: dict, repo: Path) -> set[str]:
    """The lines of the statements (in the buggy tree) holding a line the fix changes."""
    out = set(real_truth(inst)["lines"])
    sources: dict[str, dict[int, range]] = {}
    for key in list(out):
        rel, _, line = key.rpartition(":")
        if rel not in sources:
            path = repo / rel
            sources[rel] = statement_lines(path.read_text(errors="replace")) if path.is_file() else {}
        out.update(f"{rel}:{n}" for n in sources[rel].get(int(line), ()))
    return out


def real_ranks(result: dict, inst: dict, statements: set[str] | None = None) -> dict[str, int | None]:
    """First-hit ranks per level; with `statements`, also `statements` (a ranked line in a changed statement)."""
    want = real_truth(inst)
    ranks = {level: first_hit_rank(result["combined"].get(level, []), want[level]) for level in want}
    if statements is not None:
        ranks["statements"] = first_hit_rank(result["combined"].get("lines", []), statements)
    return ranks


def prepared(inst: dict, repos: Path, envs: Path):
    """A harness sandbox for the instance with its test patch applied (what a user has after
    writing the failing test): checkout, venv over the dependency environment, the project installed."""
    from openglm.swe.harness import HarnessConfig
    from openglm.swe.harness.env import apply_patch
    from openglm.swe.harness.run import Sandbox

    box = Sandbox(inst, HarnessConfig(repos_dir=repos, envs_dir=envs))
    ok, log = apply_patch(box.repo, inst.get("test_patch") or "")
    if not ok:
        box.close()
        raise RuntimeError(f"{inst['instance_id']}: the test patch does not apply:\n{log[-500:]}")
    return box


def localize_real(inst: dict, mode: str, box, baseline: Path | None, timeout: float) -> dict:
    """One localisation of a prepared instance; the result JSON (with seconds)."""
    env = inst.get("openglm_env") or {}
    python = str(box.venv / "bin" / "python")
    failing = inst["FAIL_TO_PASS"] if mode == "failing" else []
    config = {"top": 20, "python": python, "pytest_args": env.get("pytest_args", []), "timeout": timeout,
              "find_failing": mode == "suite"}
    t0 = time.time()
    if baseline is None:
        result = localize(box.repo, failing, issue="", config=LocalizeConfig(**config))
    else:
        result = run_baseline(baseline, box, failing, config, timeout)
    result["seconds"] = round(time.time() - t0, 1)
    return result


def run_baseline(root: Path, box, failing: list[str], config: dict, timeout: float) -> dict:
    """The baseline revision's localize in a child process. It runs tests under its own interpreter
    only, so the instance's packages come in on PYTHONPATH (the instance venv's site-packages and the
    dependency environment's), as a user of that revision would have had to."""
    from openglm.swe.testrun import run_command

    pth = next((box.venv / "lib").glob("python3*/site-packages"))
    paths = [str(pth)] + [ln for ln in (pth / "openglm-harness.pth").read_text().splitlines()[1:] if ln]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *paths]))
    req = json.dumps({"repo": str(box.repo), "failing": failing, "config": config})
    # cwd is the baseline tree: `python -c` puts the cwd first on sys.path, before PYTHONPATH
    rc, out, timed_out = run_command([sys.executable, "-c", BASELINE_DRIVER], root, env=env, input=req,
                                     timeout=timeout + 300)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not last.startswith("{"):
        return {"combined": {}, "failing_set": [], "error": f"exit {rc}: {out[-800:]}"}
    result = json.loads(last)
    result.setdefault("failing_set", result.get("observed_failing", []))
    return result


def baseline_tree(rev: str, cache: Path) -> Path:
    """A git worktree of openglm at `rev` (made once)."""
    sha = git(ROOT, "rev-parse", "--short", rev).strip()
    tree = cache / f"baseline-{sha}"
    if not tree.exists():
        git(ROOT, "worktree", "add", "--detach", str(tree), sha)
    return tree


def real_rows(instances: list[dict], args, baseline: Path | None, results_file: Path) -> list[dict]:
    done: dict[tuple[str, str], dict] = {}
    if results_file.exists():
        for line in results_file.read_text().splitlines():
            r = json.loads(line)
            done[(r["instance_id"], r["mode"])] = r
    modes = ("failing", "suite") if args.mode == "both" else (args.mode,)
    todo = [i for i in instances if any((i["instance_id"], m) not in done for m in modes)]
    with results_file.open("a") as f:
        for inst in tqdm(todo, desc="localize (real bugs)", unit="inst"):
            try:
                box = prepared(inst, Path(args.repos_dir), Path(args.envs_dir))
            except Exception as e:  # an environment that does not build: reported, not fatal
                for mode in modes:
                    r = {"instance_id": inst["instance_id"], "mode": mode, "error": f"{type(e).__name__}: {e}",
                         "ranks": {}, "seconds": 0.0}
                    done[(inst["instance_id"], mode)] = r
                continue
            with box:
                for mode in modes:
                    if (inst["instance_id"], mode) in done:
                        continue
                    res = localize_real(inst, mode, box, baseline, args.timeout)
                    r = {"instance_id": inst["instance_id"], "project": project_of(inst), "mode": mode,
                         "ranks": real_ranks(res, inst, statement_truth(inst, box.repo)), "seconds": res["seconds"],
                         "ranked": bool(res.get("combined", {}).get("functions")),
                         "failing_set": len(res.get("failing_set", [])),
                         "other_failing": len(res.get("other_failing", [])),
                         "timed_out": res.get("timed_out", False), "error": res.get("error"),
                         "top_functions": [x["location"] for x in res.get("combined", {}).get("functions", [])[:5]],
                         "top_lines": [x["location"] for x in res.get("combined", {}).get("lines", [])]}
                    done[(inst["instance_id"], mode)] = r
                    f.write(json.dumps(r) + "\n")
                    f.flush()
    return [done[(i["instance_id"], m)] for i in instances for m in modes if (i["instance_id"], m) in done]


def project_of(inst: dict) -> str:
    return (inst.get("openglm_bugsinpy") or {}).get("project") or inst["instance_id"].rsplit("-", 1)[0]


def hit_rate(rows: list[dict], level: str, k: int) -> float:
    hits = sum(1 for r in rows if (rk := r["ranks"].get(level)) is not None and rk <= k)
    return hits / len(rows) if rows else 0.0


def real_table(title: str, rows: list[dict]) -> list[str]:
    out = [title, f"  {'project':<16} {'n':>4}  " + "  ".join(f"{REAL_NAMES[c]:>6}" for c in REAL_LEVELS)
           + f"  {'ranked':>6}  {'median s':>8}  {'max s':>6}"]
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["project"]].append(r)
    order = [p for p in DEVELOPMENT if p in groups] + sorted(p for p in groups if p not in DEVELOPMENT)
    sets = [(p, groups[p]) for p in order]
    dev = [r for r in rows if r["project"] in DEVELOPMENT]
    held = [r for r in rows if r["project"] not in DEVELOPMENT]
    sets += [("development", dev), ("held-out", held), ("all", rows)]
    for name, rs in sets:
        if not rs:
            continue
        secs = [r["seconds"] for r in rs] or [0.0]
        out.append(f"  {name:<16} {len(rs):>4}  " + "  ".join(f"{100 * hit_rate(rs, lv, k):5.1f}%"
                                                              for lv, k in REAL_LEVELS)
                   + f"  {sum(1 for r in rs if r.get('ranked')):>6}  {statistics.median(secs):>8.1f}"
                   + f"  {max(secs):>6.0f}")
    return out


def real_harness(instances: list[dict], args) -> list[str]:
    """Gold and empty patches on the instances, per project: resolved / unresolved / errors."""
    from openglm.swe.harness import HarnessConfig, run_evaluation

    out = ["Harness (SWE-bench grading, no Docker; per project: resolved / unresolved / errors, seconds)"]
    reports = {}
    for name in ("gold", "empty"):
        config = HarnessConfig(run_id=f"bench-real-{name}", out_dir=Path(args.cache) / "swe-eval-real",
                               repos_dir=Path(args.repos_dir), envs_dir=Path(args.envs_dir), workers=args.workers,
                               timeout=900)
        shutil.rmtree(config.out_dir / "logs" / "run_evaluation" / config.run_id, ignore_errors=True)
        t0 = time.time()
        reports[name] = (run_evaluation(instances, load_predictions(name, instances), config), time.time() - t0)
    by_project: dict[str, list[str]] = defaultdict(list)
    for inst in instances:
        by_project[project_of(inst)].append(inst["instance_id"])
    out.append(f"  {'project':<16} {'n':>4}  {'gold':>16}  {'empty':>16}")
    for proj in [p for p in DEVELOPMENT if p in by_project] + sorted(p for p in by_project if p not in DEVELOPMENT) \
            + ["all"]:
        ids = set(by_project[proj]) if proj != "all" else {i["instance_id"] for i in instances}
        cells = []
        for name in ("gold", "empty"):
            rep = reports[name][0]
            cells.append(f"{len(ids & set(rep['resolved_ids']))}/{len(ids & set(rep['unresolved_ids']))}"
                         f"/{len(ids & set(rep['error_ids']))}")
        out.append(f"  {proj:<16} {len(ids):>4}  {cells[0]:>16}  {cells[1]:>16}")
    out.append(f"  wall: gold {reports['gold'][1]:.0f}s, empty {reports['empty'][1]:.0f}s "
               f"({args.workers} worker(s))")
    return out


def real_main(argv: list[str]) -> int:
    from machine import cpu_model

    ap = argparse.ArgumentParser(description="fault localisation on real bugs (BugsInPy instances)")
    ap.add_argument("--instances", default=str(ROOT / ".bench/bugsinpy/instances.jsonl"))
    ap.add_argument("--repos-dir", required=True, help="clones of the projects, named owner__name")
    ap.add_argument("--envs-dir", default=None, help="dependency environments (default: next to the instances)")
    ap.add_argument("--projects", nargs="*", help="only these projects")
    ap.add_argument("--per-project", type=int, default=0, help="the first N instances of each project (0: all)")
    ap.add_argument("--mode", choices=("failing", "suite", "both"), default="both")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one localisation's test run may take")
    ap.add_argument("--baseline", help="measure this openglm revision instead (before/after tables)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached results")
    ap.add_argument("--harness", action="store_true", help="also grade gold and empty patches")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--cache", default=str(ROOT / ".bench"))
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.envs_dir = args.envs_dir or str(Path(args.instances).parent / "envs")
    instances = load_instances(args.instances)
    if args.projects:
        instances = [i for i in instances if project_of(i) in args.projects]
    if args.per_project:
        seen: dict[str, int] = defaultdict(int)
        keep = []
        for i in instances:
            seen[project_of(i)] += 1
            if seen[project_of(i)] <= args.per_project:
                keep.append(i)
        instances = keep
    cache = Path(args.cache) / "localize"
    cache.mkdir(parents=True, exist_ok=True)
    baseline = baseline_tree(args.baseline, cache) if args.baseline else None
    tag = f"baseline-{baseline.name.split('-', 1)[1]}" if baseline else "current"
    results_file = cache / f"real.{tag}.jsonl"
    if args.fresh and results_file.exists():
        results_file.unlink()
    rows = real_rows(instances, args, baseline, results_file)
    print(f"\nReal bugs (BugsInPy), openglm {tag}; CPU: {cpu_model()} ({os.cpu_count()} cores)")
    for mode in ("failing", "suite"):
        rs = [r for r in rows if r["mode"] == mode and not (r.get("error") or "").startswith("Env")]
        if rs:
            title = ("localize --failing FAIL_TO_PASS" if mode == "failing" else
                     "localize (runs the suite, no --failing)")
            print("\n".join(real_table(f"\n{title}:", rs)))
            errors = [r["instance_id"] for r in rs if r.get("error")]
            if errors:
                print(f"  errors ({len(errors)}): {' '.join(errors)}")
    if args.harness:
        print("\n" + "\n".join(real_harness(instances, args)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
