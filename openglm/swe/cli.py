"""CLI commands of openglm.swe: localize, verify, bisect, repomap, swe-eval, swe-solve, swe-gen.

Heavy modules are imported inside the handlers so `openglm --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from openglm.agent.cli import add_model_flags, model_spec_from_args
from openglm.util.files import write_atomic


def _emit(data: dict, out: str | None) -> None:
    text = json.dumps(data, indent=2)
    if out:
        write_atomic(out, text)
    else:
        print(text)


def _read_issue(args) -> str:
    if args.issue == "-":
        return sys.stdin.read()
    if args.issue:
        return Path(args.issue).read_text()
    return args.issue_text or ""


def _selected_instances(args) -> list[dict]:
    """--instances, narrowed to --instance-ids when given."""
    from openglm.swe.harness.instances import load_instances  # each command loads its own modules when it runs

    instances = load_instances(args.instances)
    if args.instance_ids:
        wanted = set(args.instance_ids)
        instances = [i for i in instances if i["instance_id"] in wanted]
    return instances


def _python(args) -> str | None:
    """--python / --venv -> the interpreter tests run under (None: openglm's own); a bad one exits."""
    from openglm.swe.testrun import InterpreterError, resolve_python  # loaded when a command runs

    if not (args.python or args.venv):
        return None
    try:
        return resolve_python(args.python, args.venv)
    except InterpreterError as e:
        raise SystemExit(f"openglm {args.command}: {e}")


def _suite_problem(result: dict) -> str | None:
    """Why a run of the suite gave nothing to localise, in a user's words (None if it did)."""
    if result["failing_set"]:
        return None
    ran, errors = result["tests_ran"], len(result["collection_errors"])
    if result["timed_out"]:
        why = f"the test run timed out ({ran} test(s) finished; raise --timeout)"
    elif ran == 0:
        why = "no tests ran" + (f": {errors} test module(s) failed to import (see collection_errors)"
                                if errors else " (no test files found; name them with --failing)")
    elif result["other_failing"]:
        why = f"only tests stopped at the per-test limit failed ({len(result['other_failing'])})"
    else:
        why = f"no test of the suite failed ({ran} ran)"
    return why


def cmd_localize(args) -> int:
    from openglm.swe.localize import LocalizeConfig, localize  # loaded when the command runs

    issue = _read_issue(args)
    config = LocalizeConfig(scope=args.scope, top=args.top, pythonpath=args.pythonpath, python=_python(args),
                            timeout=args.timeout, test_timeout=args.test_timeout,
                            find_failing=not args.failing and not args.no_run)
    result = localize(args.repo, args.failing or [], issue=issue, config=config)
    if args.failing and not result["failing_set"]:
        print("openglm localize: none of the --failing tests failed: " + "; ".join(result["notes"]), file=sys.stderr)
    if not args.failing and not result["failing_set"] and not issue:
        why = _suite_problem(result) if config.find_failing else "no tests were run (--no-run)"
        print(f"openglm localize: nothing to localise: {why} and no issue was given; "
              "pass --failing NODEID (a failing test) or --issue FILE", file=sys.stderr)
        return 1
    _emit(result, args.json)
    return 0


def cmd_verify(args) -> int:
    from openglm.swe.verify import VerifyConfig, verify  # loaded when the command runs

    result = verify(args.repo, files=args.files, tests=args.tests or [],
                    config=VerifyConfig(runner=args.runner, timeout=args.timeout, pythonpath=args.pythonpath,
                                        python=_python(args)))
    _emit(result, args.json)
    return 0 if result["ok"] else 1


def cmd_bisect(args) -> int:
    from openglm.swe.bisect import BisectRefused, bisect  # loaded when the command runs

    try:
        result = bisect(args.repo, args.good, args.cmd, bad=args.bad, python=_python(args))
    except BisectRefused as e:
        print(f"openglm bisect: {e}", file=sys.stderr)
        return 2
    _emit(result, args.json)
    return 0 if result["first_bad_commit"] else 1


def cmd_repomap(args) -> int:
    from openglm.swe.repomap import render, repo_map  # loaded when the command runs

    m = repo_map(args.repo)
    if args.text:
        print(render(m))
    else:
        _emit(m, args.json)
    return 0


def cmd_swe_eval(args) -> int:
    from openglm.swe.harness import HarnessConfig, run_evaluation  # loaded when the command runs
    from openglm.swe.harness.instances import load_predictions

    instances = _selected_instances(args)
    preds = load_predictions(args.predictions, instances)
    config = HarnessConfig(run_id=args.run_id, out_dir=Path(args.out), repos_dir=Path(args.repos_dir),
                           workers=args.workers, timeout=args.timeout, install_cmd=args.install_cmd,
                           keep_workdirs=args.keep, envs_dir=Path(args.envs_dir))
    report = run_evaluation(instances, preds, config)
    summary = {k: v for k, v in report.items() if not k.endswith("_ids")}
    print(json.dumps(summary, indent=2))
    return 0


def cmd_swe_gen(args) -> int:
    if args.from_bugsinpy:
        from openglm.swe.gen.bugsinpy import BugsInPyConfig, build  # loaded when the command runs

        if not args.repos_dir:
            raise SystemExit("openglm swe-gen --from-bugsinpy needs --repos-dir (clones of the projects, owner__name)")
        out = Path(args.out if args.out != GEN_OUT else ".bench/bugsinpy")
        build(BugsInPyConfig(bugsinpy_dir=Path(args.from_bugsinpy), repos_dir=Path(args.repos_dir), out_dir=out,
                             projects=tuple(args.projects or ()), bugs=tuple(args.bugs or ())))
        return 0
    from openglm.swe.gen.generate import GenConfig, export_queries, generate  # loaded when the command runs
    from openglm.swe.gen.packages import by_name
    from openglm.swe.harness.instances import load_instances  # each command loads its own modules when it runs

    config = GenConfig(out_dir=Path(args.out), per_package=args.per_package, seed=args.seed)
    path = generate(by_name(args.packages), config)
    instances = load_instances(path)
    export_queries(instances, Path(args.queries))
    print(f"{len(instances)} instances -> {path}; queries -> {args.queries}")
    return 0


def cmd_swe_solve(args) -> int:
    from openglm.swe.solve import SolveConfig, solve  # the agent runtime: loaded when the command runs

    instances = _selected_instances(args)
    model = model_spec_from_args(args)
    if model is None:
        raise SystemExit("swe-solve needs --model-url and --model (an OpenAI-compatible endpoint) or --replay")
    config = SolveConfig(out_dir=Path(args.out), repos_dir=Path(args.repos_dir), model=model,
                         model_name=args.model or "replay", timeout=args.timeout, reveal_tests=args.reveal_tests,
                         envs_dir=Path(args.envs_dir))
    print(f"predictions -> {solve(instances, config)}")
    return 0


REPO = "repository folder (a git checkout or plain folder)"


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory (give the repository folder)")
    return text
PYTHONPATH = "sys.path entries relative to the repo (default: src/ if present, else the repo root)"
GEN_OUT = ".bench/swe-gen"
JSON_OUT = "write the JSON to this file (default: stdout)"
INSTANCE_IDS = "only these instance ids (default: all)"


def _add_interpreter(p) -> None:
    p.add_argument("--python", help="interpreter the tests run under, with its own pytest and packages "
                                    "(the repository's environment; default: openglm's)")
    p.add_argument("--venv", help="virtualenv the tests run under (its bin/python)")


def _add_run_outputs(p, func) -> None:
    """The flags every suite-running command shares: the interpreter, where imports resolve, where the JSON goes."""
    _add_interpreter(p)
    p.add_argument("--pythonpath", nargs="*", help=PYTHONPATH)
    p.add_argument("--json", metavar="FILE", help=JSON_OUT)
    p.set_defaults(func=func)


def register(subparsers) -> None:
    p = subparsers.add_parser("localize", help="rank files/functions/lines for a failing test (JSON)")
    p.add_argument("repo", type=existing_dir, help=REPO)
    p.add_argument("--failing", nargs="*", help="failing test node ids (tests/test_x.py::test_y); "
                                                 "default: run the suite and use the tests that fail")
    p.add_argument("--no-run", action="store_true", help="without --failing, do not run the suite "
                                                         "(localise from --issue alone)")
    p.add_argument("--issue", help="file with the issue statement ('-' = stdin)")
    p.add_argument("--issue-text", help="the issue statement inline")
    p.add_argument("--scope", choices=["files", "all"], default="files",
                   help="tests run for coverage: the failing tests' files or the whole suite (default %(default)s)")
    p.add_argument("--top", type=int, default=20, help="locations listed per level (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds the test run may take; no test starts after it (default %(default)s)")
    p.add_argument("--test-timeout", type=float, default=120,
                   help="seconds one test may take before it is stopped (default %(default)s)")
    _add_run_outputs(p, cmd_localize)

    p = subparsers.add_parser("verify", help="compile + Pyflakes + tests with per-test results (JSON)")
    p.add_argument("repo", type=existing_dir, help=REPO)
    p.add_argument("--files", nargs="*", help="files to check (default: changed vs HEAD)")
    p.add_argument("--tests", nargs="*", help="test targets (default: the runner's discovery)")
    p.add_argument("--runner", choices=["auto", "pytest", "unittest", "none"], default="auto",
                   help="test runner; auto = pytest when installed, else unittest (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds the test run may take (default %(default)s)")
    _add_run_outputs(p, cmd_verify)

    p = subparsers.add_parser("bisect", help="git bisect run automation: the first bad commit")
    p.add_argument("repo", type=existing_dir, help="git repository")
    p.add_argument("--good", required=True, help="a known-good revision")
    p.add_argument("--bad", default="HEAD", help="a known-bad revision (default %(default)s)")
    p.add_argument("--cmd", required=True, help="shell command: exit 0 = good; 125, or 4/5/126/127 (could not "
                                                "run: missing test file, command not found) = skip; else bad")
    _add_interpreter(p)
    p.add_argument("--json", metavar="FILE", help=JSON_OUT)
    p.set_defaults(func=cmd_bisect)

    p = subparsers.add_parser("repomap", help="repo map: tree, README, dependencies, tests, imports")
    p.add_argument("repo", type=existing_dir, help=REPO)
    p.add_argument("--text", action="store_true", help="the compact text form used in prompts")
    p.add_argument("--json", metavar="FILE", help=JSON_OUT)
    p.set_defaults(func=cmd_repomap)

    p = subparsers.add_parser("swe-eval", help="evaluate predictions on SWE-bench-format instances")
    p.add_argument("--instances", required=True, help="instances JSON/JSONL (SWE-bench fields)")
    p.add_argument("--predictions", required=True, help="predictions JSON/JSONL, or 'gold' / 'empty'")
    p.add_argument("--run-id", default="openglm", help="name of this evaluation run (default %(default)s)")
    p.add_argument("--out", default="runs/swe-eval", help="report and logs folder (default %(default)s)")
    p.add_argument("--repos-dir", default=".bench/swe-gen/repos",
                   help="local clones, named owner__name (GitHub repos are cloned here when absent; "
                        "default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="instances evaluated in parallel (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per instance (default %(default)s)")
    p.add_argument("--install-cmd", default="", help="run inside each instance venv, e.g. 'pip install -e .' "
                                                     "(default: none)")
    p.add_argument("--envs-dir", default=".bench/envs",
                   help="shared dependency environments of instances that list requirements (default %(default)s)")
    p.add_argument("--instance-ids", nargs="*", help=INSTANCE_IDS)
    p.add_argument("--keep", action="store_true", help="keep the per-instance work directories")
    p.set_defaults(func=cmd_swe_eval)

    p = subparsers.add_parser("swe-solve", help="run the four-phase SWE policy on instances -> predictions")
    p.add_argument("--instances", required=True, help="instances JSON/JSONL (SWE-bench fields)")
    add_model_flags(p)
    p.add_argument("--out", default="runs/swe-solve", help="predictions and task folders (default %(default)s)")
    p.add_argument("--repos-dir", default=".bench/swe-gen/repos",
                   help="local clones, named owner__name (default %(default)s)")
    p.add_argument("--timeout", default="60m", help="time per instance, e.g. 60m, 2h (default %(default)s)")
    p.add_argument("--envs-dir", default=".bench/envs",
                   help="shared dependency environments of instances that list requirements (default %(default)s)")
    p.add_argument("--reveal-tests", action="store_true", help="tell the agent the FAIL_TO_PASS test ids")
    p.add_argument("--instance-ids", nargs="*", help=INSTANCE_IDS)
    p.set_defaults(func=cmd_swe_solve)

    p = subparsers.add_parser("swe-gen", help="generate instances: injected bugs in pinned PyPI packages, "
                                              "or real bugs from BugsInPy")
    p.add_argument("--from-bugsinpy", metavar="DIR", help="build real-bug instances from this BugsInPy checkout "
                                                          "(soarsmu/BugsInPy; with --repos-dir)")
    p.add_argument("--repos-dir", help="with --from-bugsinpy: clones of the projects, named owner__name")
    p.add_argument("--projects", nargs="*", help="with --from-bugsinpy: BugsInPy project names (default: all)")
    p.add_argument("--bugs", nargs="*", help="with --from-bugsinpy: only these ids, e.g. thefuck-5 (default: all)")
    p.add_argument("--packages", nargs="*", help="subset of the pinned packages (default: all)")
    p.add_argument("--per-package", type=int, default=30,
                   help="instances per package; 30 = the benchmark set (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bug injection (default %(default)s)")
    p.add_argument("--out", default=GEN_OUT, help="instances and repos folder (default %(default)s; "
                                                  "with --from-bugsinpy: .bench/bugsinpy)")
    p.add_argument("--queries", default=".bench/localize/queries.jsonl",
                   help="localisation queries written here (default %(default)s)")
    p.set_defaults(func=cmd_swe_gen)
