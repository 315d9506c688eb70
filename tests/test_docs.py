"""The docs run: every ```bash / ```python block in README.md and docs/*.md is executed as written.

The rule (BRIEF, "Docs code blocks"): a fenced block whose info string is `bash` or `python` runs from the
repository root with a temporary HOME and output folder, the venv's `openglm` and `python` first on PATH;
it is not run when the line right above it is `<!-- doc: illustrative — REASON -->` (a server, a GPU
cluster, a multi-hour job). Other info strings (text, json, console, none) are output or data.

The blocks of one page run in order in one folder (a later block may use what an earlier one wrote). That
folder is the "repository root" as the block sees it: every top-level entry of the checkout linked in, so
`examples/...`, `openglm/...` resolve and `runs/...`, `ckpt/` land in the temporary folder. A failure names
the page and line. `python tests/test_docs.py` prints the counts (blocks run / illustrative) per page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ("bash", "python")
ILLUSTRATIVE = re.compile(r"^<!--\s*doc:\s*illustrative\s*[—–-]+\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)[^`]*$")  # no backtick after: inline code
BLOCK_TIMEOUT_S = 300  # executed blocks are meant to take seconds; this only stops a runaway


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    info: str
    code: str
    illustrative: str | None  # the reason, when marked

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group("fence"), m.group("info").lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group("indent")):] if lines[i].startswith(m.group("indent")) else lines[i])
            i += 1
        i += 1  # the closing fence
        above = ILLUSTRATIVE.match(lines[start - 1].strip()) if start else None
        blocks.append(Block(path.relative_to(ROOT).as_posix(), start + 1, info, "\n".join(body) + "\n",
                            above.group("reason") if above else None))
    return blocks


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.info in RUN and b.illustrative is None]


def _stage(tmp: Path) -> Path:
    """A folder that looks like the repository root to a block: links to every top-level entry."""
    root = tmp / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "runs", ".pytest_cache"):
            (root / entry.name).symlink_to(entry)
    return root


def _env(tmp: Path) -> dict:
    home = tmp / "home"
    home.mkdir()
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "HOME": str(home), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT), "OPENGLM_DOC_TMP": str(tmp), "MPLBACKEND": "Agg",
            "TMPDIR": str(tmp), "PYTHONDONTWRITEBYTECODE": "1",
            # the examples are tiny models on a shared machine: more threads only spin
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_block(block: Block, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    if block.info == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        script = cwd.parent / f"block_{block.line}.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages()])
def test_page_blocks_run_as_written(page, tmp_path):
    blocks = parse_blocks(ROOT / page)
    for b in blocks:
        if b.illustrative is not None:
            assert b.illustrative, f"{b.where}: an illustrative block needs a reason"
            assert b.info in RUN, f"{b.where}: only bash/python blocks run; a ```{b.info or '(none)'} block " \
                                  "needs no illustrative marker"
    todo = runnable(blocks)
    if not todo:
        return
    cwd, env = _stage(tmp_path), _env(tmp_path)
    for b in todo:
        p = run_block(b, cwd, env)
        assert p.returncode == 0, (f"{b.where} ({b.info} block) exited {p.returncode}; mark it "
                                   f"`<!-- doc: illustrative — REASON -->` only if it cannot run here\n"
                                   f"--- block ---\n{b.code}--- stdout ---\n{p.stdout[-3000:]}\n"
                                   f"--- stderr ---\n{p.stderr[-3000:]}")


def test_the_parser_reads_the_rule():
    text = ("```bash\necho run\n```\n<!-- doc: illustrative — a server -->\n```bash\nserve\n```\n"
            "```text\nout\n```\n  ```python\n  x = 1\n  ```\n")
    page = ROOT / "docs" / ".doc-runner-selftest.md"
    page.write_text(text)
    try:
        blocks = parse_blocks(page)
    finally:
        page.unlink()
    assert [(b.info, b.illustrative) for b in blocks] == [("bash", None), ("bash", "a server"), ("text", None),
                                                         ("python", None)]
    assert [b.code for b in runnable(blocks)] == ["echo run\n", "x = 1\n"]


def counts() -> dict[str, tuple[int, int]]:
    out = {}
    for page in pages():
        blocks = [b for b in parse_blocks(page) if b.info in RUN]
        out[page.relative_to(ROOT).as_posix()] = (len(runnable(blocks)), len(blocks) - len(runnable(blocks)))
    return out


def test_counts_cover_every_page():
    c = counts()
    assert set(c) == {p.relative_to(ROOT).as_posix() for p in pages()} and sum(r for r, _ in c.values()) > 0


if __name__ == "__main__":
    c = counts()
    for page, (run, ill) in c.items():
        print(f"{page:<24} run {run:>3}   illustrative {ill:>3}")
    print(f"{'total':<24} run {sum(r for r, _ in c.values()):>3}   illustrative {sum(i for _, i in c.values()):>3}")
