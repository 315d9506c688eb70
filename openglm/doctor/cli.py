"""`openglm doctor` (the checks load torch: imported when the command runs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check this machine, a checkpoint, a training run or a running server; each problem with "
                       "its fix",
        description="The write-ups' troubleshooting as checks: the machine (torch, ISA, native kernels, threads, "
                    "memory), a checkpoint (what serve would refuse, template vs tokenizer), a training run (expert "
                    "load, dead experts, loss spikes, gradient norms), a server (/health, /metrics, KV, queue, store, "
                    "memory growth). Exit status 1 when a check finds an error.")
    p.add_argument("target", nargs="?", default=None,
                   help="a checkpoint folder or a training run folder (default: none, the machine alone)")
    p.add_argument("--url", default=None, help="a running `openglm serve` or `openglm agent-server`, e.g. "
                                               "http://127.0.0.1:8000 (default: none)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the tokenizer folder serve would be given (default: the checkpoint's own)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file with the server's API key, for /metrics (default: $OPENGLM_API_KEY)")
    p.add_argument("--watch", type=float, default=5.0, metavar="SECONDS",
                   help="seconds to sample a local server's memory for the leak-rate estimate; 0: off (default 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (default: text)")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    from openglm.doctor.diagnose import (
        diagnose,  # torch: loaded when the command runs, `openglm --help` stays fast
    )

    if args.target is not None and args.url is not None:
        print("openglm doctor: give a TARGET folder or --url, not both", file=sys.stderr)
        return 2
    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else os.environ.get("OPENGLM_API_KEY")
    report = diagnose(args.target, args.url, args.tokenizer, key or None, args.watch)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return report.exit_code()
