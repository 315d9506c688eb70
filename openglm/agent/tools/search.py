"""The search tool: ripgrep when installed, else GNU grep with Perl regexes (close to ripgrep's syntax)."""

from __future__ import annotations

import shutil

from openglm.agent.tools.files import confine
from openglm.agent.tools.shell import truncate
from openglm.util import proc

SEARCH_TIMEOUT_S = 120


def search(workspace, pattern: str, path: str = ".", glob: str | None = None, max_chars: int = 20000) -> str:
    target = confine(workspace, path)
    if shutil.which("rg"):
        cmd = ["rg", "-n", "--no-heading", "--color=never", "-e", pattern]
        cmd += ["-g", glob] if glob else []
    else:
        cmd = ["grep", "-rnIP", "--exclude-dir=.git", "-e", pattern] + ([f"--include={glob}"] if glob else [])
    p = proc.run(cmd + [str(target)], cwd=workspace, timeout=SEARCH_TIMEOUT_S)
    if p.timed_out:
        return f"search stopped after {SEARCH_TIMEOUT_S}s: narrow the path or the pattern"
    root = str(confine(workspace, ".")) + "/"
    out = p.stdout.replace(root, "")
    if p.returncode == 1:
        return "no matches"
    if p.returncode not in (0, 1):
        return f"search failed: {p.stderr.strip()}"
    return truncate(out, max_chars)
