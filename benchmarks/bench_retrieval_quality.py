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
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import random
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from openglm.retrieval.code_index import CodeIndex  # noqa: E402
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


def evaluate(index: CodeIndex, queries: list[dict], ks=(5, 10)) -> dict:
    out = {}
    for mode in MODES:
        hits = {k: 0 for k in ks}
        file_hits = 0
        t = time.perf_counter()
        for q in queries:
            ranked = index.search(q["query"], max(ks), mode=mode)
            for k in ks:
                hits[k] += any(is_hit(h, q["file"], q["function"]) for h in ranked[:k])
            file_hits += any(h.path == q["file"] for h in ranked[:max(ks)])
        out[mode] = {**{f"top{k}": hits[k] for k in ks}, "file_top10": file_hits,
                     "ms_per_query": 1000 * (time.perf_counter() - t) / max(1, len(queries))}
    return out


def merge(total: dict, part: dict) -> None:
    for mode, row in part.items():
        agg = total.setdefault(mode, {"top5": 0, "top10": 0, "file_top10": 0, "ms": []})
        for key in ("top5", "top10", "file_top10"):
            agg[key] += row[key]
        agg["ms"].append(row["ms_per_query"])


# ---- the fault-localisation queries --------------------------------------------------------
def export_revision(repo_dir: Path, commit: str, dest: Path) -> None:
    """Files of `commit` into `dest` (read-only use of the repository: git archive)."""
    data = subprocess.run(["git", "-C", str(repo_dir), "archive", "--format=tar", commit],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def run_localize(path: Path, repos: Path, embedder: Embedder, limit: int) -> tuple[dict, int]:
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
        merge(total, evaluate(index, items))
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


def run_stdlib(embedder: Embedder, n_queries: int) -> tuple[dict, int]:
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
    merge(total, evaluate(index, queries))
    return total, len(queries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", default=".bench/localize/queries.jsonl")
    ap.add_argument("--repos", default=".bench/swe-gen/repos")
    ap.add_argument("--stdlib", action="store_true", help="use the standard-library query set")
    ap.add_argument("--limit", type=int, default=300, help="at most this many queries")
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    embedder = Embedder(max_seq_length=args.max_seq_length)
    source = Path(args.queries)
    if args.stdlib or not source.exists():
        print(f"query set: standard-library docstrings ({source} {'ignored' if args.stdlib else 'missing'})")
        total, n = run_stdlib(embedder, args.limit)
        name = "stdlib-docstrings"
    else:
        print(f"query set: {source} (fault-localisation problem statements)")
        total, n = run_localize(source, Path(args.repos), embedder, args.limit)
        name = "localize"
    print(f"\n== retrieval quality ({name}, {n} queries): buggy/target function in the top k\n"
          f"  {'mode':<8} {'top-5':>7} {'top-10':>7} {'file@10':>8} {'ms/query':>9}")
    rows = {}
    for mode in MODES:
        t = total[mode]
        rows[mode] = {"top5": t["top5"] / n, "top10": t["top10"] / n, "file_top10": t["file_top10"] / n,
                      "ms_per_query": sum(t["ms"]) / len(t["ms"])}
        r = rows[mode]
        print(f"  {mode:<8} {r['top5']:>7.3f} {r['top10']:>7.3f} {r['file_top10']:>8.3f} {r['ms_per_query']:>9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"query_set": name, "queries": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
