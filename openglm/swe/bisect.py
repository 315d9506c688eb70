"""`openglm bisect`: find the first bad commit with `git bisect run` between a known-good
revision and a bad one (default HEAD), using a shell test command (exit 0 = good, 125 = skip).

Before bisecting, both ends are run: the command must pass at `good` and fail at `bad`, else the
bisect is refused in one line (`BisectRefused`), never answered with a wrong commit. An exit that
means "the test could not run here" rather than "the test failed" counts as skip, not bad: pytest's
4 (usage error: a missing test file or test id) and 5 (no tests collected), the shell's 126 (not
executable) and 127 (command not found).

The command runs in a private worktree. Files it names that are not committed in the caller's checkout
(a new regression test, an edited test file) are copied in before each run and taken out after it, so
every revision is judged by the same test.

With `python` (`--python` / `--venv`), `python` and `python3` in the command are that interpreter
(a folder of links first on PATH), so `python -m pytest ...` runs in the repository's environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from openglm.util import proc
from openglm.util.git import git, run_git

SKIP_CODES = {4: "pytest usage error, e.g. a test file or test id that does not exist",
              5: "pytest collected no tests", 126: "the command is not executable", 127: "command not found"}
MAX_CARRIED_FILES, MAX_CARRIED_BYTES = 200, 50 << 20
_SKIPPED = re.compile(r"^\[openglm bisect\] exit (\d+)", re.M)


class BisectRefused(ValueError):
    """The bisect cannot give a trustworthy answer (an end does not behave, a named file cannot be
    carried): one line saying why."""


def command_env(work: Path, python: str | None) -> dict | None:
    """The command's environment: `python`/`python3` resolve to `python` when one is given (None: this
    process's own)."""
    env = None
    if python:
        env = dict(os.environ)
        bin_dir = work / "bin"
        bin_dir.mkdir()
        for name in ("python", "python3"):
            os.symlink(python, bin_dir / name)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        venv = Path(python).parent.parent
        if (venv / "pyvenv.cfg").exists():
            env["VIRTUAL_ENV"] = str(venv)
    return env


def bisect(repo: str | Path, good: str, command: str, bad: str = "HEAD", timeout: float = 1800,
           python: str | None = None) -> dict:
    """Runs in a private worktree so the caller's checkout and bisect state are untouched."""
    repo = Path(repo).resolve()
    good_sha = git(repo, "rev-parse", good).strip()
    bad_sha = git(repo, "rev-parse", bad).strip()
    top = Path(git(repo, "rev-parse", "--show-toplevel").strip())  # the command runs at the worktree's top
    carried = uncommitted_files(top, command)
    work = Path(tempfile.mkdtemp(prefix="openglm-bisect-"))
    tree = work / "tree"
    step = _step_script(work, command, _stash(top, carried, work / "carried"))
    deadline = time.monotonic() + timeout
    env = command_env(work, python)
    git(repo, "worktree", "add", "--quiet", "--detach", str(tree), bad_sha)
    try:
        ends = _check_ends(tree, step, (good, good_sha), (bad, bad_sha), deadline, env)
        git(tree, "bisect", "start", bad_sha, good_sha)
        proc = run_git(["bisect", "run", "sh", str(step)], tree, env=env, timeout=_left(deadline, timeout), text=True)
        if proc.timed_out:
            raise TimeoutError(f"git bisect run `{command}` did not finish in {timeout:g}s (killed)")
        log = proc.stdout + proc.stderr
        m = re.search(r"^([0-9a-f]{40}) is the first bad commit", log, re.M)
        result = {"repo": str(repo), "good": good_sha, "bad": bad_sha, "command": command,
                  "first_bad_commit": m.group(1) if m else None, "log": log[-4000:],
                  "ends": ends, "carried": carried}
        if not m and "only 'skip'ped commits left" in log:  # every revision in between could not run the test
            result["candidates"] = re.findall(r"^([0-9a-f]{40})$", log.split("could be any of:", 1)[-1], re.M)
        if m:
            result["subject"] = git(repo, "log", "-1", "--format=%s", m.group(1)).strip()
            result["files"] = git(repo, "show", "--name-only", "--format=", m.group(1)).split()
        git(tree, "bisect", "reset", check=False)
        return result
    finally:
        git(repo, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(work, ignore_errors=True)
        git(repo, "worktree", "prune", check=False)


# ---- the ends ------------------------------------------------------------------------------------
def _left(deadline: float, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"bisect did not finish in {timeout:g}s")
    return left


def _check_ends(tree: Path, step: Path, good: tuple[str, str], bad: tuple[str, str], deadline: float,
                env: dict | None) -> dict:
    """Run the command at `bad` (where the worktree starts), then at `good`: it must fail, then pass."""
    ends = {}
    for (name, sha), end in ((bad, "bad"), (good, "good")):
        if end == "good":
            git(tree, "checkout", "--quiet", "--detach", sha)
        at = f"--{end} {name}" + ("" if sha.startswith(name) else f" ({sha[:10]})")
        r = proc.run(["sh", str(step)], cwd=tree, env=env, timeout=max(0.0, deadline - time.monotonic()),
                     merge_stderr=True)
        if r.timed_out:
            raise BisectRefused(f"the command did not finish in time at {at} (raise the timeout)")
        out = r.stdout
        skipped = _SKIPPED.search(out)
        if skipped:
            code = int(skipped.group(1))
            raise BisectRefused(f"the command cannot run at {at}: exit {code} ({SKIP_CODES[code]}){_last_line(out)}; "
                                "does every file it needs exist at that revision? (uncommitted files it names "
                                "are copied in)")
        if end == "bad" and r.returncode == 0:
            raise BisectRefused(f"the command passes at {at}: nothing to bisect (it must fail at the bad end)")
        if end == "good" and r.returncode != 0:
            raise BisectRefused(f"the command fails at {at} too (exit {r.returncode}){_last_line(out)}: "
                                "give a --good revision where it passes")
        ends[end] = {"revision": sha, "exit": r.returncode}
    return ends


def _last_line(output: str) -> str:
    """The output's last error line (else its last line), to say in the refusal what went wrong."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.startswith("[openglm bisect]")]
    errors = [ln for ln in lines if re.search(r"error|not found", ln, re.I)]
    return f"; last output: {(errors or lines)[-1][:200]!r}" if lines else ""


# ---- files the command names that are not committed ----------------------------------------------
def _named_paths(command: str) -> list[str]:
    """The words of `command` that could be paths: `tests/test_x.py::test_y` -> `tests/test_x.py`,
    `--file=a.txt` -> `a.txt`; options and shell operators are not."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # unbalanced quotes: the shell will say so at the first run
        words = command.split()
    out = []
    for word in words:
        if word.startswith("-"):
            if "=" not in word:
                continue
            word = word.split("=", 1)[1]
        word = word.split("::", 1)[0]
        if word and not set(word) <= set("|&;<>()!{}"):
            out.append(word)
    return out


def uncommitted_files(repo: Path, command: str) -> list[str]:
    """Paths (relative to `repo`) of the files `command` names, or that lie in folders it names, that are
    not committed: untracked (a named file even if ignored), or changed since HEAD."""
    untracked = set(_z(git(repo, "ls-files", "-z", "--others", "--exclude-standard")))
    changed = {p for p in _z(git(repo, "diff", "--name-only", "-z", "HEAD")) if os.path.lexists(repo / p)}
    tracked = set(_z(git(repo, "ls-files", "-z")))
    pending = untracked | changed
    found: list[str] = []
    for word in _named_paths(command):
        path = Path(word) if os.path.isabs(word) else repo / word
        if not os.path.lexists(path):
            continue
        rel = os.path.relpath(os.path.abspath(path), repo)
        if rel == ".." or rel.startswith(".." + os.sep):
            if not os.path.isabs(word):  # a relative path out of the repo means another file in the worktree
                raise BisectRefused(f"the command names {word}, outside the repository: bisect runs it in a "
                                    "private worktree elsewhere, so give that path as an absolute one")
            continue
        if rel == ".":
            continue
        if path.is_dir() and not path.is_symlink():
            found += sorted(p for p in pending if p.startswith(rel.rstrip(os.sep) + "/"))
        elif rel in pending or rel not in tracked:
            found.append(rel)
    found = list(dict.fromkeys(found))
    size = sum(os.lstat(repo / p).st_size for p in found)
    if len(found) > MAX_CARRIED_FILES or size > MAX_CARRIED_BYTES:
        raise BisectRefused(f"the command names {len(found)} uncommitted file(s) ({size >> 20} MB; at most "
                            f"{MAX_CARRIED_FILES} files, {MAX_CARRIED_BYTES >> 20} MB are copied into each "
                            "revision): name the test files themselves, or commit them")
    return found


def _z(output: str) -> list[str]:
    return [p for p in output.split("\0") if p]


def _stash(repo: Path, files: list[str], dest: Path) -> list[str]:
    """Copy `files` (as they are now) out of the caller's checkout, so that each step puts back the same bytes."""
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target, follow_symlinks=False)
    return files


def _step_script(work: Path, command: str, carried: list[str]) -> Path:
    """One bisect step as a shell script: carried files in, the command, carried files out (the revision's
    own version back where it has one), its exit code with the could-not-run codes turned into skip."""
    quoted = " ".join(shlex.quote(p) for p in carried)
    stash = shlex.quote(str(work / "carried"))
    codes = "|".join(str(c) for c in SKIP_CODES)
    put = (f'for f in {quoted}; do mkdir -p "$(dirname "$f")" && rm -f "$f" && cp -pP {stash}/"$f" "$f" || exit 128; '
           'done')
    take = f'for f in {quoted}; do git checkout --quiet HEAD -- "$f" 2>/dev/null || rm -f "$f"; done'
    script = f"""\
{put if carried else ":"}
sh -c {shlex.quote(command)}
rc=$?
{take if carried else ":"}
case $rc in {codes}) echo "[openglm bisect] exit $rc: the command could not run at this revision (skipped)" >&2
    exit 125;;
esac
exit $rc
"""
    path = work / "step.sh"
    path.write_text(script)
    return path
