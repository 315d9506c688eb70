"""Retrieval quality on code: does the buggy function come back in the top 5 / top 10?

Queries are the problem statements of the fault-localisation benchmark
(`.bench/localize/queries.jsonl`, written by benchmarks/bench_localize.py: query, repo,
base_commit, file, function). Each repository is indexed once at its pristine revision
(`git archive HEAD`, read-only on the repository).

Without that file (`--stdlib`, or when it is missing) an equivalent set is built from the standard
library: the first sentence of a function's docstring is the query, and the indexed copy of the
modules has every docstring blanked (line numbers kept), so the answer cannot be found by
copying the query.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_retrieval_quality.py [--json out]
        [--sweep] [--cli-latency 5]

`--sweep` also prints the hybrid fusion's top-5 / top-10 over a grid of RRF offsets and (dense, bm25) weights
(each query's two rankings are computed once), the table the defaults in code_index.py were chosen from.
`--cli-latency N` times `openglm index search` as a user runs it, N times each: cold (the command loads the
index and its embedder) and warm (an `openglm index serve` answers), and counts the bytes each writes to stderr.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from machine import cpu_model, isa  # noqa: E402  benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

from openglm.retrieval import code_index  # noqa: E402
from openglm.retrieval.code_index import CodeIndex, fuse  # noqa: E402
from openglm.retrieval.embedder import Embedder  # noqa: E402

OUT = Path(".bench/quality")
MODES = ("dense", "bm25", "hybrid")
STDLIB_MODULES = ["textwrap.py", "json", "csv.py", "argparse.py", "shutil.py", "pathlib.py", "tarfile.py",
                  "zipfile.py", "configparser.py", "difflib.py", "statistics.py", "fractions.py",
                  "calendar.py", "gzip.py", "heapq.py", "bisect.py", "ipaddress.py", "email/utils.py",
                  "http/cookies.py", "urllib/parse.py", "string.py", "random.py", "fnmatch.py",
                  "glob.py", "tempfile.py", "shlex.py", "base64.py", "quopri.py", "uuid.py", "pprint.py"]


def is_hit(hit, file: str, function: str) -> bool:
    if hit.path != file:
        return False
    return hit.name == function or hit.name.endswith("." + function) or function.endswith("." + hit.name)


POOL = 50  # candidates of each ranking the hybrid fuses (CodeIndex.search's max(5k, 50) at k = 10)
# the fusion settings --sweep tries: (RRF offset c, (dense, bm25) weights; None: the query-adaptive default)
SWEEP = [(60.0, (0.5, 1.0)), (60.0, (1.0, 1.0))] + [(c, (1.0, w)) for c in (10.0, 30.0, 60.0)
                                                     for w in (0.75, 0.5, 0.33, 0.25)] + [(code_index.RRF_C, None)]


def rankings(index: CodeIndex, queries: list[dict]) -> list[dict]:
    """Each query's dense and BM25 candidates (computed once), the times they took, and its target chunks."""
    rows = []
    for q in queries:
        t0 = time.perf_counter()
        dense = index._dense(q["query"], POOL)
        t1 = time.perf_counter()
        lexical = index._lexical(q["query"], POOL)
        t2 = time.perf_counter()
        rows.append({**q, "dense": dense, "bm25": lexical, "ms": {"dense": 1000 * (t1 - t0),
                                                                  "bm25": 1000 * (t2 - t1)}})
    return rows


def ranked_ids(row: dict, mode: str, k: int, c: float | None = None, weights=None) -> list[int]:
    if mode == "hybrid":
        return [i for i, _ in fuse(row["query"], row["dense"], row["bm25"], k, weights=weights,
                                   c=code_index.RRF_C if c is None else c)]
    return [i for i, _ in row[mode][:k]]


def score(index: CodeIndex, rows: list[dict], mode: str, c=None, weights=None, ks=(1, 5, 10)) -> dict:
    """Queries whose target is in the top k, whose file is in the top 10, and (`overruled`) whose target
    the dense ranking had first and this ranking does not."""
    hits = {k: 0 for k in ks}
    file_hits = overruled = 0
    for row in rows:
        ranked = [index.chunks[i] for i in ranked_ids(row, mode, max(ks), c, weights)]
        for k in ks:
            hits[k] += any(is_hit(h, row["file"], row["function"]) for h in ranked[:k])
        file_hits += any(h.path == row["file"] for h in ranked)
        dense_first = row["dense"] and is_hit(index.chunks[row["dense"][0][0]], row["file"], row["function"])
        overruled += bool(dense_first) and not (ranked and is_hit(ranked[0], row["file"], row["function"]))
    return {**{f"top{k}": hits[k] for k in ks}, "file_top10": file_hits, "overruled": overruled}


def evaluate(index: CodeIndex, queries: list[dict], sweep: dict | None = None) -> dict:
    rows = rankings(index, queries)
    n = max(1, len(rows))
    ms = {m: sum(r["ms"][m] for r in rows) / n for m in ("dense", "bm25")}
    ms["hybrid"] = ms["dense"] + ms["bm25"]
    if sweep is not None:
        for c, weights in SWEEP:
            key = f"c={c:g} " + ("adaptive (default)" if weights is None else
                                 f"dense {weights[0]:g} bm25 {weights[1]:g}")
            part = score(index, rows, "hybrid", c, weights)
            agg = sweep.setdefault(key, {"top1": 0, "top5": 0, "top10": 0, "overruled": 0})
            for name in agg:
                agg[name] += part[name]
    return {mode: {**score(index, rows, mode), "ms_per_query": ms[mode]} for mode in MODES}


def merge(total: dict, part: dict) -> None:
    for mode, row in part.items():
        agg = total.setdefault(mode, {"top1": 0, "top5": 0, "top10": 0, "file_top10": 0, "overruled": 0, "ms": []})
        for key in ("top1", "top5", "top10", "file_top10", "overruled"):
            agg[key] += row[key]
        agg["ms"].append(row["ms_per_query"])


# ---- the fault-localisation queries --------------------------------------------------------
def export_revision(repo_dir: Path, commit: str, dest: Path) -> None:
    """Files of `commit` into `dest` (read-only use of the repository: git archive)."""
    data = subprocess.run(["git", "-C", str(repo_dir), "archive", "--format=tar", commit],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def run_localize(path: Path, repos: Path, embedder: Embedder, limit: int, sweep: dict | None) -> tuple[dict, int]:
    """Each repository is indexed once, at its pristine revision (HEAD): an injected bug changes a
    line or two of one function, not where that function is or what it is called."""
    queries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    by_repo: dict[str, list[dict]] = {}
    for q in queries:
        by_repo.setdefault(q["repo"], []).append(q)
    total: dict = {}
    for repo, items in by_repo.items():
        work = OUT / "work" / repo.replace("/", "__")
        shutil.rmtree(work / "src", ignore_errors=True)  # the index stays: a rerun re-embeds nothing
        export_revision(repos / repo.replace("/", "__"), "HEAD", work / "src")
        index, stats = CodeIndex.build(work / "src", work / "index", embedder=embedder, progress=True)
        print(f"  {repo}: {stats.total_chunks} chunks, {len(items)} queries", flush=True)
        merge(total, evaluate(index, items, sweep))
    return total, len(queries)


# ---- the standard-library fallback ---------------------------------------------------------
def first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".")


def build_stdlib_set(dest: Path, n_queries: int, seed: int = 0) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    shutil.rmtree(dest, ignore_errors=True)
    for name in STDLIB_MODULES:
        files = sorted((stdlib / name).rglob("*.py")) if (stdlib / name).is_dir() else [stdlib / name]
        for f in files:
            rel = f.relative_to(stdlib).as_posix()
            text = f.read_text()
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text)):
                body = getattr(node, "body", None)
                if not (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                        and isinstance(getattr(body[0], "value", None), ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    continue
                doc = body[0]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    query = first_sentence(doc.value.value)
                    if len(query.split()) >= 5 and not node.name.startswith("__"):
                        candidates.append({"file": rel, "line": node.lineno, "name": node.name, "query": query})
                for i in range(doc.lineno - 1, doc.end_lineno):  # blank the docstring, keep line numbers
                    lines[i] = ""
                if len(body) == 1:  # a body that was only a docstring still needs a statement
                    lines[doc.lineno - 1] = " " * doc.col_offset + "pass"
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text("\n".join(lines) + "\n")
    random.Random(seed).shuffle(candidates)
    return candidates[:n_queries]


def run_stdlib(embedder: Embedder, n_queries: int, sweep: dict | None) -> tuple[dict, int]:
    src = OUT / "stdlib" / "src"
    raw = build_stdlib_set(src, n_queries)
    index, stats = CodeIndex.build(src, OUT / "stdlib" / "index", embedder=embedder, progress=True)
    print(f"  indexed {stats.total_chunks} chunks of {len(STDLIB_MODULES)} stdlib modules", flush=True)
    # The target is the chunk of the function defined at that line (its qualified name).
    queries = []
    for q in raw:
        owner = [c for c in index.chunks.values() if c.path == q["file"] and c.start_line <= q["line"] <= c.end_line
                 and c.name.split(".")[-1] == q["name"]]
        if owner:
            queries.append({**q, "function": owner[0].name})
    total: dict = {}
    merge(total, evaluate(index, queries, sweep))
    return total, len(queries)


def cli_latency(index_dir: Path, query: str, n: int) -> dict:
    """`openglm index search` as a user runs it (a fresh process each time), cold and with `openglm index serve`
    answering: median wall seconds, stderr bytes per run, and whether both printed the same hits."""
    from openglm.retrieval.warm import socket_path

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if socket_path(index_dir).exists():
        raise SystemExit(f"an `openglm index serve` already serves {index_dir}: stop it for a cold measurement")
    search = [sys.executable, "-m", "openglm", "index", "search", str(index_dir), query, "-k", "10"]

    def run() -> tuple[float, int, str]:
        t = time.perf_counter()
        proc = subprocess.run(search, env=env, capture_output=True, text=True, check=True)
        return time.perf_counter() - t, len(proc.stderr.encode()), proc.stdout

    cold = [run() for _ in range(n)]
    t = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "openglm", "index", "serve", str(index_dir), "--idle-timeout",
                               "600"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        ready = server.stderr.readline()  # written once the index and the embedder are loaded
        if "warm on" not in ready:
            raise SystemExit(f"openglm index serve did not start: {ready.strip()}")
        start_s = time.perf_counter() - t
        warm = [run() for _ in range(n)]
    finally:
        server.terminate()
        server.wait(timeout=60)
    row = {name: {"median_s": statistics.median(r[0] for r in runs), "stderr_bytes": max(r[1] for r in runs)}
           for name, runs in (("cold", cold), ("warm", warm))}
    return {**row, "server_start_s": start_s, "same_hits": {r[2] for r in cold} == {r[2] for r in warm}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", default=".bench/localize/queries.jsonl")
    ap.add_argument("--repos", default=".bench/swe-gen/repos")
    ap.add_argument("--stdlib", action="store_true", help="use the standard-library query set")
    ap.add_argument("--limit", type=int, default=300, help="at most this many queries")
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="also print the hybrid fusion over a grid of settings")
    ap.add_argument("--cli-latency", type=int, default=0, metavar="N",
                    help="also time `openglm index search` N times cold and N times warm (stdlib set only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical cores; {isa()})")
    embedder = Embedder(max_seq_length=args.max_seq_length)
    source = Path(args.queries)
    sweep: dict | None = {} if args.sweep else None
    if args.stdlib or not source.exists():
        print(f"query set: standard-library docstrings ({source} {'ignored' if args.stdlib else 'missing'})")
        total, n = run_stdlib(embedder, args.limit, sweep)
        name = "stdlib-docstrings"
    else:
        print(f"query set: {source} (fault-localisation problem statements)")
        total, n = run_localize(source, Path(args.repos), embedder, args.limit, sweep)
        name = "localize"
    print(f"\n== retrieval quality ({name}, {n} queries): buggy/target function in the top k; dense-1 lost: "
          f"queries whose target the dense ranking had first and this ranking does not\n"
          f"  {'mode':<8} {'top-1':>7} {'top-5':>7} {'top-10':>7} {'file@10':>8} {'dense-1 lost':>13} {'ms/query':>9}")
    rows = {}
    for mode in MODES:
        t = total[mode]
        rows[mode] = {**{key: t[key] / n for key in ("top1", "top5", "top10", "file_top10")},
                      "dense_first_lost": t["overruled"], "ms_per_query": sum(t["ms"]) / len(t["ms"])}
        r = rows[mode]
        print(f"  {mode:<8} {r['top1']:>7.3f} {r['top5']:>7.3f} {r['top10']:>7.3f} {r['file_top10']:>8.3f} "
              f"{r['dense_first_lost']:>13} {r['ms_per_query']:>9.1f}")
    report = {"query_set": name, "queries": n, "rows": rows}
    if sweep is not None:
        print(f"\n== hybrid fusion sweep (weighted RRF, score = sum of w / (c + rank)) over {n} queries\n"
              f"  {'setting':<34} {'top-1':>7} {'top-5':>7} {'top-10':>7} {'dense-1 lost':>13}")
        for key, agg in sweep.items():
            print(f"  {key:<34} {agg['top1'] / n:>7.3f} {agg['top5'] / n:>7.3f} {agg['top10'] / n:>7.3f} "
                  f"{agg['overruled']:>13}")
        report["sweep"] = sweep
    if args.cli_latency and name == "stdlib-docstrings":
        lat = cli_latency(OUT / "stdlib" / "index", "detect circular references", args.cli_latency)
        print(f"\n== `openglm index search` wall time, a new process each run ({args.cli_latency} runs, median)\n"
              f"  {'search':<34} {'seconds':>8} {'stderr bytes':>13}")
        for kind, label in (("cold", "cold (loads index + embedder)"), ("warm", "warm (`openglm index serve`)")):
            print(f"  {label:<34} {lat[kind]['median_s']:>8.2f} {lat[kind]['stderr_bytes']:>13}")
        print(f"  server start (load, once)          {lat['server_start_s']:>8.2f}; same hits cold and warm: "
              f"{lat['same_hits']}")
        report["cli_latency"] = lat
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
