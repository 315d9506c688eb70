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
import sysconfig
import venv
from pathlib import Path

from openglm.swe.testrun import PACKAGE_ROOT, source_paths
from openglm.util import proc
from openglm.util.git import apply_patch as git_apply_patch
from openglm.util.git import clone, git


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
    clone(url, tmp)
    tmp.rename(local)
    return local


def checkout(instance: dict, repos_dir: Path, dest: Path) -> None:
    src = source_repo(instance, repos_dir)
    clone(src.resolve(), dest, "--shared", "--no-checkout")
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


def run_in_venv(env_dir: Path, cwd: Path, command: str, timeout: float) -> proc.Result:
    """`sh -c command` with the venv active; output and errors together in `stdout`. A command past
    `timeout` is killed with everything it started, and raises TimeoutError."""
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    result = proc.run(["sh", "-c", command], cwd=cwd, env=env, timeout=timeout, merge_stderr=True)
    if result.timed_out:
        raise TimeoutError(f"`{command}` did not finish in {timeout:g}s (killed)")
    return result


def apply_patch(repo: Path, patch: str) -> tuple[bool, str]:
    """git apply, then GNU patch with fuzz (as SWE-bench does); (applied?, log)."""
    if not patch.strip():
        return True, "empty patch: nothing to apply\n"
    return git_apply_patch(repo, patch, fuzz=True)
