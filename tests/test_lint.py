"""The lint the project keeps: ruff with pyproject.toml's [tool.ruff] rules (line length 120, pycodestyle,
pyflakes, import order) over the package, tests, benchmarks and examples. `ruff check --fix .` sorts imports."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "openglm", "tests", "benchmarks", "examples"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
