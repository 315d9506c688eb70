"""Git, run one way: every git command openglm runs goes through `run_git` (a `util.proc` command, so a
timeout kills git and whatever it started), `git()` returns its output or raises `GitError` in git's
own words, and `apply_patch` is the one way a patch is applied. Plus the few repository builders the
SWE harness, bisect and the benchmark generator share.

Git is not an execution surface: a repository's files and config are untrusted (an agent's commands
write them), so `run_git` gives git an environment without secrets (no agent token, no model key),
reads neither the system's nor the user's config, and turns off every program a config could start:
hooks, the fsmonitor daemon, the `ext::` transport, credential helpers.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from openglm.util import proc

# A fixed author, committer and date: the commits openglm makes (benchmark instances) are reproducible.
IDENTITY = {"GIT_AUTHOR_NAME": "openglm", "GIT_AUTHOR_EMAIL": "openglm@localhost",
            "GIT_COMMITTER_NAME": "openglm", "GIT_COMMITTER_EMAIL": "openglm@localhost",
            "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z"}
NO_PROMPT = {"GIT_TERMINAL_PROMPT": "0"}  # a clone that needs credentials fails instead of waiting for them
SEALED_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
SEALED_CONFIG = ("core.hooksPath=/dev/null", "core.fsmonitor=false", "protocol.ext.allow=never", "credential.helper=")


class GitError(RuntimeError):
    """A git command failed (not a repository, an unknown revision, ...): the message has git's own words,
    `reason` has only them."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


def _failed(command: str, result: proc.Result, timeout: float | None) -> GitError:
    why = result.stderr.strip() or (f"timed out after {timeout:g}s" if result.timed_out else "no message")
    return GitError(f"{command} failed: {why}", why)


def run_git(args, cwd, *, env: dict | None = None, input: str | bytes | None = None,
            timeout: float | None = None, text: bool = False) -> proc.Result:
    """`git ARGS` in `cwd` with CRLF conversion off, sealed (see above). `env` is the whole environment
    (None: this process's, with openglm's identity and no credential prompts); secrets are dropped from it."""
    env = {**os.environ, **IDENTITY, **NO_PROMPT} if env is None else env
    sealed = [arg for setting in SEALED_CONFIG for arg in ("-c", setting)]
    return proc.run(["git", *sealed, "-c", "core.autocrlf=false", *args], cwd=cwd,
                    env=proc.scrubbed_env(env, SEALED_ENV), input=input, timeout=timeout, text=text)


def git(repo, *args: str, input: str | None = None, check: bool = True, env: dict | None = None,
        timeout: float | None = None) -> str:
    """git's stdout as text; `env` adds to the environment. GitError when it fails (unless not `check`)."""
    result = run_git(args, repo, env={**os.environ, **IDENTITY, **NO_PROMPT, **(env or {})}, input=input,
                     timeout=timeout, text=True)
    if check and not result.ok:
        raise _failed(f"git {' '.join(args)} in {repo}", result, timeout)
    return result.stdout


def clone(source, dest, *options: str, timeout: float | None = None) -> None:
    """`git clone --quiet OPTIONS -- SOURCE DEST` (a source starting with '-' is never an option); GitError
    (git's message) when it fails."""
    result = run_git(["clone", "--quiet", *options, "--", os.fspath(source), os.fspath(dest)], None,
                     timeout=timeout, text=True)
    if not result.ok:
        raise _failed(f"git clone {os.fspath(source)}", result, timeout)


def apply_patch(repo, patch: str, fuzz: bool = False) -> tuple[bool, str]:
    """`git apply`; with `fuzz`, GNU patch with fuzz after it when git refuses (as SWE-bench does).
    Returns (applied?, the commands' log). A GNU patch that half applies is undone."""
    log = ""
    attempts = [["git", "apply", "--verbose", "-"]] + ([["patch", "--batch", "--fuzz=5", "-p1", "--forward"]]
                                                         if fuzz else [])
    for cmd in attempts:
        try:
            result = run_git(cmd[1:], repo, input=patch, text=True) if cmd[0] == "git" else \
                proc.run(cmd, cwd=repo, input=patch)
        except FileNotFoundError:  # GNU patch is not installed
            continue
        log += f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}"
        if result.ok:
            return True, log
        if cmd[0] == "patch":
            git(repo, "checkout", "--", ".", check=False)
    return False, log


def init_repo(path, message: str = "initial") -> str:
    """git init + commit everything; returns the commit sha."""
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-q", "--no-verify", "-m", message)
    return git(path, "rev-parse", "HEAD").strip()


def commit_file_change(repo, parent: str, rel: str, text: str, message: str, ref: str) -> str:
    """Make a commit = parent with `rel` replaced by `text`, without touching the work tree or HEAD;
    `ref` keeps it reachable. Returns its sha."""
    blob = git(repo, "hash-object", "-w", "--stdin", input=text).strip()
    index = Path(repo) / ".git" / f"tmp-index-{os.getpid()}"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(repo, "read-tree", parent, env=env)
        git(repo, "update-index", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
    finally:
        index.unlink(missing_ok=True)
    sha = git(repo, "commit-tree", tree, "-p", parent, "-m", message).strip()
    git(repo, "update-ref", ref, sha)
    return sha


def unified_diff(rel: str, before: str, after: str) -> str:
    """A git-style patch turning `before` into `after` for file `rel` ("" when equal)."""
    if before == after:
        return ""
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{rel}", f"b/{rel}", n=3)
    lines = []
    for line in body:
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{rel} b/{rel}\n" + "".join(lines)
