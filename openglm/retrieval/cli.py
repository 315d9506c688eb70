"""`openglm index build PATH`, `openglm index search PATH "query" -k 10` and `openglm index serve PATH`."""

from __future__ import annotations

import argparse
import json
import sys
import time

HINT_AFTER_S = 2.0  # a cold search slower than this suggests `openglm index serve` (on a terminal)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


DEFAULT_IDLE = 1800.0  # warm.DEFAULT_IDLE_TIMEOUT_S, without importing it for `openglm --help`


def register(subparsers):
    p = subparsers.add_parser("index", help="code knowledge base: build and search a repository index")
    sub = p.add_subparsers(dest="index_command", metavar="ACTION")

    b = sub.add_parser("build", help="index a repository (incremental: only changed files re-embed)")
    b.add_argument("path", help="repository root")
    b.add_argument("--index", default=None, help="index directory (default: PATH/.openglm-index)")
    b.add_argument("--model", default=None,
                   help="sentence-transformers model directory (default: the bundled all-MiniLM-L6-v2)")
    b.add_argument("--max-seq-length", type=int, default=256,
                   help="embedder token limit per chunk, in tokens (default %(default)s)")
    b.add_argument("--json", action="store_true", help="print the update statistics as JSON")
    b.set_defaults(func=_build)

    s = sub.add_parser("search", help="search an index; prints path:line spans")
    s.add_argument("path", help="repository root or index directory")
    s.add_argument("query", help="what to look for: words, a name or a description")
    s.add_argument("-k", type=_positive_int, default=10, help="number of results, >= 1 (default %(default)s)")
    s.add_argument("--mode", choices=["hybrid", "dense", "bm25"], default="hybrid",
                   help="dense embeddings, BM25 words, or both fused (default %(default)s)")
    s.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    s.add_argument("--show", action="store_true", help="also print each chunk's first lines")
    s.set_defaults(func=_search)

    w = sub.add_parser("serve", help="keep an index and its embedder loaded so `index search` answers at once",
                       description="Load the index and its embedder once and answer `openglm index search` for "
                                   "this index over a private Unix socket (searches without a server load the "
                                   "embedder themselves, seconds each). Runs in the foreground; Ctrl-C stops.")
    w.add_argument("path", help="repository root or index directory")
    w.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE, metavar="SECONDS",
                   help="exit after this many seconds without a search; 0: never (default %(default)g)")
    w.set_defaults(func=_serve)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _build(args) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from .code_index import CodeIndex  # FAISS + torch: loaded when the command runs
    from .embedder import Embedder

    if not Path(args.path).is_dir():  # before loading the embedder
        print(f"error: repository path {args.path} does not exist or is not a directory", file=sys.stderr)
        return 1
    try:
        embedder = Embedder(args.model, max_seq_length=args.max_seq_length)
        index, stats = CodeIndex.build(args.path, args.index, embedder=embedder, progress=sys.stderr.isatty())
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in stats.skipped:
        print(f"note: skipped {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(stats)))
    else:
        print(f"index {index.index_dir}: {stats.total_chunks} chunks; files added {len(stats.added)}, "
              f"changed {len(stats.changed)}, removed {len(stats.removed)}, unchanged {stats.unchanged}; "
              f"{stats.chunks_embedded} chunks embedded")
    return 0


def _search(args) -> int:
    from .warm import index_dir_of, search_warm  # sockets and json only: no model is loaded for a warm search

    took = None
    try:
        hits = search_warm(index_dir_of(args.path), args.query, args.k, args.mode)
        if hits is None:  # no `openglm index serve` for this index: load it here
            start = time.perf_counter()
            from .code_index import CodeIndex  # FAISS + torch: loaded only when no warm server answers

            hits = [h.to_dict() for h in CodeIndex.open(args.path).search(args.query, args.k, mode=args.mode)]
            took = time.perf_counter() - start
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        for h in hits:
            print(json.dumps({k: v for k, v in h.items() if k != "text" or args.show}))
    else:
        _print_table(hits, args.show)
    if took is not None and took > HINT_AFTER_S and sys.stderr.isatty():
        print(f"note: loading the index and its embedder took {took:.1f} s; `openglm index serve {args.path}` "
              "keeps them loaded for later searches", file=sys.stderr)
    return 0


def _print_table(hits: list[dict], show: bool) -> None:
    width = max([len(h["location"]) for h in hits] + [8])
    print(f"{'rank':>4}  {'score':>7}  {'location':<{width}}  name")
    for rank, h in enumerate(hits, 1):
        print(f"{rank:>4}  {h['score']:>7.4f}  {h['location']:<{width}}  {h['name'] or h['kind']}")
        if show:
            for line in h["text"].splitlines()[:6]:
                print(f"{'':>15}| {line}")


def _serve(args) -> int:
    from .warm import serve_index  # the server loads FAISS + torch: the command's purpose

    if args.idle_timeout < 0:
        print(f"error: --idle-timeout must be >= 0, got {args.idle_timeout:g}", file=sys.stderr)
        return 1
    try:
        return serve_index(args.path, args.idle_timeout)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
