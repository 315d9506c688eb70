"""CLI of the agent runtime: `openglm task ...`, `openglm agent-server`, `openglm worker`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from openglm.util.ports import AGENT_PORT as DEFAULT_PORT
from openglm.util.ports import AGENT_URL as DEFAULT_URL

TASK_ID = "task id, as printed by `openglm task submit` (t-...)"


def add_model_flags(p) -> None:
    """The flags that choose the model (agent-server, worker, swe-solve); read with `model_spec_from_args`."""
    p.add_argument("--replay", help="a replay model instead of an endpoint: JSONL of scripted assistant turns")
    p.add_argument("--model-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model name at --model-url; without --model-url a preset name "
                                   "(zai-glm-5.1: Z.ai's hosted GLM-5.1, key in $ZAI_API_KEY)")
    p.add_argument("--api-key-env", default="OPENGLM_MODEL_API_KEY",
                   help="env var holding the model API key (default OPENGLM_MODEL_API_KEY)")
    p.add_argument("--fallback-url", help="fallback model base URL (answers when the primary fails)")
    p.add_argument("--fallback-model", help="fallback model name (default: --model)")


def model_spec_from_args(args):
    """The ModelSpec the model flags give, or None when none was given."""
    from openglm.agent.llm import ModelSpec  # httpx: loaded when a command runs, `openglm --help` stays fast

    if args.replay:
        return ModelSpec(replay=args.replay)
    if not args.model_url and args.model:  # a named endpoint (openglm/agent/llm/presets.py)
        from openglm.agent.llm.presets import MODEL_PRESETS, preset_spec

        spec = preset_spec(args.model, os.environ)
        if spec is None:
            raise SystemExit(f"--model {args.model!r} is not a preset ({', '.join(MODEL_PRESETS)}); "
                             "give --model-url for another endpoint")
        spec["api_key"] = os.environ.get(args.api_key_env) or spec["api_key"]
        return ModelSpec.from_dict(spec)
    if not args.model_url:
        return None
    if not args.model:
        raise SystemExit("--model-url needs --model")
    key = os.environ.get(args.api_key_env)
    fallback = ModelSpec(base_url=args.fallback_url, model=args.fallback_model or args.model,
                         api_key=key) if args.fallback_url else None
    return ModelSpec(base_url=args.model_url, model=args.model, api_key=key, fallback=fallback)


def _config_args(p):
    p.add_argument("--config", help="agent config JSON (keys of AgentConfig)")
    p.add_argument("--data-dir", help="snapshots and created workspaces (default runs/agent)")
    p.add_argument("--store", help="sqlite path or redis://host:port/db (default <data-dir>/agent.db)")
    add_model_flags(p)
    p.add_argument("--lease-ttl", type=float, help="seconds a silent worker keeps its lease")


def _load_config(args):
    from openglm.agent.config import AgentConfig  # (as above)

    config = AgentConfig.load(args.config, data_dir=args.data_dir, store=args.store, model=model_spec_from_args(args),
                              lease_ttl=args.lease_ttl)
    config.workspace_roots += getattr(args, "workspace_root", None) or []
    config.public_names += getattr(args, "public_name", None) or []
    if getattr(args, "unsafe_no_sandbox", False):
        config.sandbox.enabled = False
    return config


def _sandbox_flag(p) -> None:
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run tasks' commands unconfined, as this server's user (only for trusted tasks; without it, "
                        "where bubblewrap cannot run, commands are refused)")


def _tokens(args) -> tuple[str | None, str | None]:
    """The bearer tokens from --token-file / --view-token-file or the environment (never argv)."""
    from openglm.util.auth import read_token  # (as above)

    for flag, given in (("--token", args.token), ("--view-token", args.view_token)):
        if given is not None:
            raise ValueError(f"{flag} on the command line is visible to every user of this machine (ps): put it in a "
                             f"file and pass {flag}-file PATH, or set the environment variable")
    return (read_token(args.token_file, "OPENGLM_AGENT_TOKEN", "--token-file"),
            read_token(args.view_token_file, "OPENGLM_AGENT_VIEW_TOKEN", "--view-token-file"))


def _client(args):
    from openglm.client import GLMClient  # httpx: loaded when a command runs

    return GLMClient(args.server, api_key=args.token)


def _print(obj):
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _reporting_api_errors(func):
    """Run a `task` action; an error answer from the task API is one line on stderr and exit 2."""

    def run(args):
        import httpx  # (as above)

        from openglm.client import GLMClientError  # (as above)

        try:
            return func(args)
        except GLMClientError as e:
            print(f"error: {e.detail}", file=sys.stderr)
            return 2
        except httpx.TransportError as e:  # no server there, or it hung up
            print(f"error: cannot reach the task API at {args.server}: {e}", file=sys.stderr)
            return 2

    return run


def cmd_submit(args):
    try:
        constraints = json.loads(args.constraints) if args.constraints else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--constraints is not valid JSON: {e}") from None
    if not isinstance(constraints, dict):
        raise SystemExit("--constraints must be a JSON object")
    if args.timeout:
        constraints["timeout"] = args.timeout
    if args.resource:
        constraints["resource"] = args.resource
    extra = list(args.deliverable or []) + [{"run": cmd} for cmd in args.deliverable_run or []]
    if extra:  # added to the deliverables given in --constraints, never replacing them
        given = constraints.get("deliverables", [])
        if not isinstance(given, list):
            raise SystemExit("--constraints: deliverables must be a list")
        constraints["deliverables"] = given + extra
    print(_client(args).submit_long_task(args.objective, constraints or None, workspace=args.workspace,
                                         repo=args.repo))


def cmd_status(args):
    _print(_client(args).get_task_status(args.task_id))


EVENTS_PAGE = 1000  # the most events the task API returns in one answer


def cmd_events(args):
    """Print the events as JSON lines: a page of `--limit` (with a hint on stderr when more follow), all of
    them with `--all`, or a live stream with `--follow`."""
    client = _client(args)
    if args.follow:
        for e in client.stream_events(args.task_id, args.after):
            print(json.dumps(e, ensure_ascii=False), flush=True)
        return
    after, left = args.after, None if args.all else args.limit
    while left is None or left > 0:
        want = EVENTS_PAGE if left is None else min(left, EVENTS_PAGE)
        page = client.get_events(args.task_id, after, want)
        for e in page:
            print(json.dumps(e, ensure_ascii=False), flush=True)
        after = page[-1]["seq"] if page else after
        left = None if left is None else left - len(page)
        if len(page) < want:
            return
    if client.get_events(args.task_id, after, 1):  # the page is full: say so when more follow
        print(f"-- more events after seq {after}: openglm task events {args.task_id} --after {after} "
              "(or --all for every event)", file=sys.stderr)


def cmd_action(args):
    client = _client(args)
    if args.action == "answer":
        _print(client.answer(args.task_id, args.text))
    else:
        _print(getattr(client, args.action)(args.task_id))


def cmd_snapshots(args):
    """The task's snapshots, one line each: step, id, whether the step changed files, when; which one the
    workspace is at, and which a rollback discarded (they cannot be rolled back to)."""
    client = _client(args)
    snaps = client.snapshots(args.task_id)
    if args.json:
        _print(snaps)
        return
    current = client.get_task_status(args.task_id)["snapshot"]
    print(f"{'step':>5}  {'snapshot':<12}  {'files':<9}  time (local)")
    for s in snaps:
        note = "  <- the workspace (last committed)" if s["snapshot"] == current and s.get("kept", True) else ""
        note += "" if s.get("kept", True) else "  (discarded by a rollback)"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["ts"]))
        changed = "changed" if s["changed"] else "unchanged"
        print(f"{s['step']:>5}  {s['snapshot'][:12]:<12}  {changed:<9}  {when}{note}")
    if snaps:
        print(f"roll back with: openglm task rollback {args.task_id} STEP", file=sys.stderr)


ROLLBACK_VERBS = {"A": "delete", "M": "overwrite", "T": "overwrite", "D": "restore"}


def rollback_plan(preview: dict) -> list[tuple[str, str]]:
    """[(verb, path)] of what rolling back does to the workspace, from the snapshot -> workspace name-status
    (a file the snapshot lacks is deleted, a changed one overwritten, a missing one restored)."""
    plan = []
    for line in preview.get("name_status", []):
        status, _, path = line.partition("\t")
        if path:
            plan.append((ROLLBACK_VERBS.get(status[:1], "change"), path))
    return plan


def cmd_rollback(args):
    """Show what the rollback changes; in a folder the task uses in place (the user's own files), ask first
    (or --yes), since files created after the snapshot are deleted."""
    from openglm.client import GLMClientError  # (as above)

    client = _client(args)
    try:
        preview = client.rollback_preview(args.task_id, args.step)
    except GLMClientError as e:
        if e.status_code in (404, 422):
            raise
        preview = {"error": e.detail}
    plan = rollback_plan(preview)
    in_place = preview.get("in_place", True)
    where = preview.get("workspace", "the workspace")
    if "error" in preview:
        print(f"cannot tell what rolling back changes ({preview['error']})", file=sys.stderr)
    elif not plan:
        print(f"{where} already equals the snapshot of step {args.step}", file=sys.stderr)
    else:
        kind = "your folder, used in place" if in_place else "the task's own workspace"
        print(f"rolling back {args.task_id} to step {args.step} changes {where} ({kind}):", file=sys.stderr)
        for verb, path in plan[:ROLLBACK_LISTED]:
            print(f"  {verb:<9} {path}" + ("  (not in that snapshot)" if verb == "delete" else ""), file=sys.stderr)
        if len(plan) > ROLLBACK_LISTED:
            print(f"  ... and {len(plan) - ROLLBACK_LISTED} more", file=sys.stderr)
    if in_place and (plan or "error" in preview) and not args.yes:
        if not sys.stdin.isatty():
            print("error: not rolled back: confirm with --yes (files listed above would be lost)", file=sys.stderr)
            return 2
        if input("roll back? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not rolled back", file=sys.stderr)
            return 1
    _print(client.rollback(args.task_id, args.step))


ROLLBACK_LISTED = 50  # paths listed before "... and N more"


def cmd_export_html(args):
    from openglm.agent.dashboard.export import render  # (as above)

    out = Path(args.out or f"{args.task_id}.html")
    try:
        out.write_text(render(_client(args).trajectory(args.task_id)), encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"cannot write {out}: {e.strerror}") from None
    print(out)


def cmd_list(args):
    for t in _client(args).list_tasks():
        print(f"{t['id']}  {t['state']:<12} step {t['step']:<4} {t['objective'][:60]}")


def _reporting_store_errors(func):
    """A corrupt or unreadable store is one line on stderr (with the recovery command) and exit 2."""

    def run(args):
        from openglm.agent.store import StoreCorrupt, StoreUnavailable  # sqlite/redis: loaded when a command runs

        try:
            return func(args)
        except (StoreCorrupt, StoreUnavailable) as e:
            print(f"openglm: {e}", file=sys.stderr)
            return 2

    return run


def _sqlite_path(args) -> str:
    config = _load_config(args)
    if config.store_url.startswith(("redis://", "rediss://", "unix://")):
        raise SystemExit("backup/restore work on a SQLite store; back Redis up with its own BGSAVE / AOF")
    return config.store_url.removeprefix("sqlite://")


def cmd_backup(args):
    from openglm.agent.store.sqlite_store import SQLiteStore  # (as above)

    store = SQLiteStore(_sqlite_path(args))
    try:
        store.backup(args.dest)
    finally:
        store.close()
    print(f"backed up {store.path} to {args.dest}")


def cmd_restore(args):
    from openglm.agent.store.sqlite_store import SQLiteStore  # (as above)

    path = _sqlite_path(args)
    SQLiteStore.restore(args.src, path)
    print(f"restored {path} from {args.src} (start the workers again)")


def cmd_agent_server(args):
    from openglm.agent.server import serve  # uvicorn + FastAPI: loaded when the command runs

    if args.replay and not os.path.isfile(args.replay):  # say so now, not in every task's failure later
        raise SystemExit(f"--replay {args.replay}: no such file (a JSONL of scripted assistant turns, "
                         "e.g. examples/turns.jsonl)")
    config = _load_config(args)
    try:
        token, view_token = _tokens(args)
    except ValueError as e:  # a token on the command line, an unreadable token file: one line
        raise SystemExit(f"error: {e}") from None

    def announce(port: int) -> None:
        from openglm.agent.banner import banner  # (as above)

        print(banner(config, args.host, port, args.workers, token, view_token, args.log_level), file=sys.stderr,
              flush=True)

    try:
        serve(config, host=args.host, port=args.port, workers=args.workers, token=token, view_token=view_token,
              log_level=args.log_level, on_listening=announce)
    except ValueError as e:  # refused configuration (non-loopback without a token, a port in use, ...): one line
        raise SystemExit(f"error: {e}") from None


def cmd_worker(args):
    from openglm.agent.server import run_worker  # the whole runtime: loaded when the command runs

    run_worker(_load_config(args), max_tasks=1 if args.once else None)


def register(subparsers):
    task = subparsers.add_parser("task", help="submit and manage long-horizon agent tasks")
    task.set_defaults(func=lambda a: task.print_help() or 2)
    sub = task.add_subparsers(dest="task_command", metavar="ACTION")

    def add(name, help, func):
        p = sub.add_parser(name, help=help)
        p.add_argument("--server", default=os.environ.get("OPENGLM_AGENT_URL", DEFAULT_URL),
                       help="task API URL (default: $OPENGLM_AGENT_URL, else %(default)s)")
        p.add_argument("--token", default=os.environ.get("OPENGLM_AGENT_TOKEN"),
                       help="bearer token (default: $OPENGLM_AGENT_TOKEN, else none)")
        p.set_defaults(func=_reporting_api_errors(func), action=name)
        return p

    p = add("submit", "submit a task; prints its id", cmd_submit)
    p.add_argument("objective", help="what the agent should achieve, in words")
    p.add_argument("--workspace", help="local folder the agent works in (default: a fresh empty one)")
    p.add_argument("--repo", help="git URL or path to clone as the workspace")
    p.add_argument("--constraints", help='JSON, e.g. \'{"timeout": "8h", "resource": "16CPU/64GB"}\'')
    p.add_argument("--timeout", help="e.g. 8h, 90m")
    p.add_argument("--resource", help="e.g. 16CPU/64GB")
    p.add_argument("--deliverable", action="append", metavar="PATH",
                   help="a path that must exist in the workspace at the end (repeatable; added to --constraints')")
    p.add_argument("--deliverable-run", action="append", metavar="COMMAND",
                   help="a command that must exit 0 in the workspace at the end, e.g. 'pytest -q' (repeatable)")
    add("list", "list tasks", cmd_list)
    add("status", "state, phase, progress, recent events", cmd_status).add_argument("task_id", help=TASK_ID)
    p = add("events", "the task's event log (JSON lines)", cmd_events)
    p.add_argument("task_id", help=TASK_ID)
    p.add_argument("--after", type=int, default=0, help="only events with a larger sequence number (default 0)")
    p.add_argument("--limit", type=_positive, default=100,
                   help="at most this many events; when more follow, stderr says how to get them (default %(default)s)")
    p.add_argument("--all", action="store_true", help="every event (paged from the server), not only --limit")
    p.add_argument("--follow", "-f", action="store_true", help="stream new events (SSE) until the task ends")
    p = add("snapshots", "the task's workspace snapshots (the steps `rollback` can go back to)", cmd_snapshots)
    p.add_argument("task_id", help=TASK_ID)
    p.add_argument("--json", action="store_true", help="the API's list as JSON instead of a table")
    for name in ("pause", "resume", "cancel"):
        add(name, f"{name} a task", cmd_action).add_argument("task_id", help=TASK_ID)
    p = add("answer", "answer a task waiting in NEEDS_INPUT", cmd_action)
    p.add_argument("task_id", help=TASK_ID)
    p.add_argument("text", help="the answer to the task's question")
    p = add("rollback", "restore the workspace to an earlier step's snapshot (lists what it changes first)",
            cmd_rollback)
    p.add_argument("task_id", help=TASK_ID)
    p.add_argument("step", type=int, help="a committed step (see `openglm task snapshots`)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="do not ask before changing a folder the task uses in place (--workspace)")

    for name, func, arg, help in (("backup", cmd_backup, "dest",
                                   "copy the SQLite store to DEST (online: workers may run)"),
                                  ("restore", cmd_restore, "src", "replace the SQLite store with the backup SRC "
                                                                  "(stop the workers first)")):
        p = sub.add_parser(name, help=help)
        _config_args(p)
        p.add_argument(arg, help="backup file path")
        p.set_defaults(func=_reporting_store_errors(func), action=name)
    p = add("export-html", "write a task's trajectory as one self-contained (offline) HTML file", cmd_export_html)
    p.add_argument("task_id", help=TASK_ID)
    p.add_argument("--out", "-o", help="output file (default: <task_id>.html in the current folder)")

    p = subparsers.add_parser("agent-server", help="serve the task API with embedded workers")
    _config_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; "
                                                        "off loopback a --token is required)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: a free one, "
                                                                 "named in the start-up banner)")
    p.add_argument("--workers", type=int, default=1, help="embedded workers; 0 = API only (default %(default)s)")
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the bearer token (or $OPENGLM_AGENT_TOKEN); required off loopback")
    p.add_argument("--view-token-file", metavar="PATH",
                   help="file holding a read-only bearer token (or $OPENGLM_AGENT_VIEW_TOKEN): GET routes and the "
                        "dashboard without its controls (default: none)")
    p.add_argument("--token", help=argparse.SUPPRESS)  # refused with a pointer to --token-file
    p.add_argument("--view-token", help=argparse.SUPPRESS)
    p.add_argument("--workspace-root", action="append", metavar="DIR",
                   help="a folder under which API clients may name a workspace or local repo (repeatable; the data "
                        "dir always is one)")
    p.add_argument("--public-name", action="append", metavar="NAME",
                   help="a host name clients reach this server by, besides loopback's (repeatable; requests with "
                        "another Host header are refused)")
    _sandbox_flag(p)
    # what the server tells its operator
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info: an access log line per request (default); warning: only problems")
    p.set_defaults(func=_reporting_store_errors(cmd_agent_server))

    p = subparsers.add_parser("worker", help="an extra worker for a shared store (e.g. redis://...)")
    _config_args(p)
    _sandbox_flag(p)
    p.add_argument("--once", action="store_true", help="run one task, then exit")
    p.set_defaults(func=_reporting_store_errors(cmd_worker))


def main(argv: list[str] | None = None) -> int:
    """`python -m openglm.agent ...`: the agent commands alone (starts without importing other areas)."""
    parser = argparse.ArgumentParser(prog="python -m openglm.agent")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
