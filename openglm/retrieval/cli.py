"""`openglm index build PATH` and `openglm index search PATH "query" -k 10`."""

from __future__ import annotations

import json
import sys


def register(subparsers):
    p = subparsers.add_parser("index", help="code knowledge base: build and search a repository index")
    sub = p.add_subparsers(dest="index_command", metavar="ACTION")

    b = sub.add_parser("build", help="index a repository (incremental: only changed files re-embed)")
    b.add_argument("path", help="repository root")
    b.add_argument("--index", default=None, help="index directory (default: PATH/.openglm-index)")
    b.add_argument("--model", default=None,
                   help="sentence-transformers model directory (default: the bundled all-MiniLM-L6-v2)")
    b.add_argument("--max-seq-length", type=int, default=256, help="embedder token limit per chunk")
    b.add_argument("--json", action="store_true", help="print the update statistics as JSON")
    b.set_defaults(func=_build)

    s = sub.add_parser("search", help="search an index; prints path:line spans")
    s.add_argument("path", help="repository root or index directory")
    s.add_argument("query")
    s.add_argument("-k", type=int, default=10, help="number of results")
    s.add_argument("--mode", choices=["hybrid", "dense", "bm25"], default="hybrid")
    s.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    s.add_argument("--show", action="store_true", help="also print each chunk's first lines")
    s.set_defaults(func=_search)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _build(args) -> int:
    from dataclasses import asdict

    from .code_index import CodeIndex  # FAISS + torch: loaded when the command runs
    from .embedder import Embedder

    try:
        embedder = Embedder(args.model, max_seq_length=args.max_seq_length)
        index, stats = CodeIndex.build(args.path, args.index, embedder=embedder, progress=sys.stderr.isatty())
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(stats)))
    else:
        print(f"index {index.index_dir}: {stats.total_chunks} chunks; files added {len(stats.added)}, "
              f"changed {len(stats.changed)}, removed {len(stats.removed)}, unchanged {stats.unchanged}; "
              f"{stats.chunks_embedded} chunks embedded")
    return 0


def _search(args) -> int:
    from .code_index import CodeIndex  # FAISS + torch: loaded when the command runs

    try:
        hits = CodeIndex.open(args.path).search(args.query, args.k, mode=args.mode)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        for h in hits:
            print(json.dumps({k: v for k, v in h.to_dict().items() if k != "text" or args.show}))
        return 0
    width = max([len(h.location) for h in hits] + [8])
    print(f"{'rank':>4}  {'score':>7}  {'location':<{width}}  name")
    for rank, h in enumerate(hits, 1):
        print(f"{rank:>4}  {h.score:>7.4f}  {h.location:<{width}}  {h.name or h.kind}")
        if args.show:
            for line in h.text.splitlines()[:6]:
                print(f"{'':>15}| {line}")
    return 0
