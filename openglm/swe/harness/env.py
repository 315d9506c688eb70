"""Prepare an instance: a private checkout at base_commit and a private virtualenv, no Docker.

The checkout is a `git clone --shared` of a cached clone of the instance's repository (a local
mirror under repos_dir, cloned from GitHub once for official SWE-bench instances). The virtualenv
is created with `--without-pip`; a `.pth` file puts the checkout's source root first on sys.path and
then the harness's own site-packages (pytest, coverage), so an instance needs no network unless an
install command (`--install-cmd 'pip install -e .'`) asks for one; that runs inside the venv.
"""

from __future__ import annotations

import os
import site
import subprocess
import sysconfig
import venv
from pathlib import Path

from openglm.swe.gitutil import git
from openglm.swe.testrun import PACKAGE_ROOT, source_paths


def source_repo(instance: dict, repos_dir: Path) -> Path:
    """The local clone to copy from: repos_dir/owner__name, cloned from GitHub when absent."""
    repo = instance["repo"]
    local = repos_dir / repo.replace("/", "__")
    if (local / ".git").exists() or (local / "HEAD").exists():
        return local
    if Path(repo).expanduser().exists():
        return Path(repo).expanduser()
    url = instance.get("repo_url") or f"https://github.com/{repo}.git"
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(local.name + ".partial")
    subprocess.run(["git", "clone", "--quiet", url, str(tmp)], check=True)
    tmp.rename(local)
    return local


def checkout(instance: dict, repos_dir: Path, dest: Path) -> None:
    src = source_repo(instance, repos_dir)
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(src.resolve()), str(dest)],
                   check=True, capture_output=True)
    git(dest, "checkout", "--quiet", "--detach", instance["base_commit"])


def make_venv(env_dir: Path, checkout_dir: Path, pythonpath: list[str] | None = None) -> Path:
    """Create the instance's virtualenv; returns its python."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=os.name != "nt").create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # the venv's site-packages, computed here rather than by asking its python (a process less)
    purelib = sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})
    tools = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    # openglm itself last, for the test plugin
    lines = source_paths(checkout_dir, pythonpath) + tools + [PACKAGE_ROOT]
    (Path(purelib) / "openglm-harness.pth").write_text("\n".join(lines) + "\n")
    return python


def run_in_venv(env_dir: Path, cwd: Path, command: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(command, shell=True, cwd=cwd, env=env, text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def apply_patch(repo: Path, patch: str) -> tuple[bool, str]:
    """git apply, then GNU patch with fuzz (as SWE-bench does); (applied?, log)."""
    if not patch.strip():
        return True, "empty patch: nothing to apply\n"
    attempts = [["git", "apply", "--verbose", "-"],
                ["patch", "--batch", "--fuzz=5", "-p1", "--forward"]]
    log = ""
    for cmd in attempts:
        try:
            proc = subprocess.run(cmd, cwd=repo, input=patch, text=True, capture_output=True)
        except FileNotFoundError:
            continue
        log += f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        if proc.returncode == 0:
            return True, log
        if cmd[0] == "patch":  # a partial GNU patch leaves a mess; undo what it wrote
            git(repo, "checkout", "--", ".", check=False)
    return False, log
