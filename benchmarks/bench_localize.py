"""Fault localisation on generated bug-injection instances (real PyPI packages, see openglm swe-gen),
plus the SWE-bench-format harness figures on the same instances (gold, empty and corrupt patches).

For each instance the buggy revision is checked out and `openglm.swe.localize` runs with the
instance's FAIL_TO_PASS tests and problem statement. A hit at file / function / line level means the
injected bug's file / function / line is within the top-k of a technique's ranking. Results are
cached per instance (.bench/localize/results.seed<S>.jsonl), so a rerun resumes.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_localize.py [--per-package 30]
        [--packages a b] [--harness] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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


if __name__ == "__main__":
    raise SystemExit(main())
