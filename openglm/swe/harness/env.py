"""Prepare an instance: a private checkout at base_commit and a private virtualenv, no Docker.

The checkout is a `git clone --shared` of a cached clone of the instance's repository (a local
mirror under repos_dir, cloned from GitHub once for official SWE-bench instances).

Dependencies come in two layers, as SWE-bench's environment and instance images: an instance
that lists its requirements (`openglm_env.requirements`, pinned versions as the real-bug builder
resolved them) gets a **dependency environment** shared by every instance with the same list
(a venv with pip, built once under `envs_dir`, the repository's own pytest among them); its own
venv then sees, through a `.pth` file, the checkout's source root first, then that environment's
site-packages. An instance without requirements sees the harness's own site-packages instead
(pytest, coverage). Either way `pip` inside the instance venv installs into the instance venv
(`--install-cmd 'pip install -e .'`), never into a shared or the base interpreter.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import site
import sys
import sysconfig
import venv
from pathlib import Path

from openglm.swe.testrun import run_command, source_paths
from openglm.util.git import GitError, clone, git
from openglm.util.git import apply_patch as git_apply_patch


class EnvBuildError(RuntimeError):
    """The instance's environment could not be built (not the patch's fault)."""


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
    try:
        clone(url, tmp, timeout=1800)
    except GitError as e:
        raise EnvBuildError(str(e)) from None
    tmp.rename(local)
    return local


def checkout(instance: dict, repos_dir: Path, dest: Path) -> None:
    src = source_repo(instance, repos_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        clone(src.resolve(), dest, "--shared", "--no-checkout", timeout=600)
    except GitError as e:
        raise EnvBuildError(str(e)) from None
    git(dest, "checkout", "--quiet", "--detach", instance["base_commit"])


def _python_of(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _site_packages(env_dir: Path) -> str:
    # the venv's site-packages, computed here rather than by asking its python (a process less)
    return sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})


def env_key(requirements: list[str]) -> str:
    """Instances with the same requirements (and interpreter) share one dependency environment."""
    text = json.dumps([sys.version_info[:2], sorted(requirements)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pip_install(python: Path, requirements: list[str], timeout: float) -> tuple[bool, str]:
    """`python -m pip install` the requirements (from PyPI or the pip cache); (ok, log)."""
    if not requirements:
        return True, ""
    cmd = [str(python), "-m", "pip", "install", "--no-input", "--disable-pip-version-check", *requirements]
    rc, out, timed_out = run_command(cmd, python.parent, timeout=timeout, env=_pip_env())
    return rc == 0 and not timed_out, out + ("\n[pip timed out]" if timed_out else "")


def _pip_env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


def dependency_env(requirements: list[str], envs_dir: Path, timeout: float = 1800) -> Path:
    """The shared venv (with pip) holding `requirements`, built on first use under a file lock; a
    failed build raises EnvBuildError with pip's words and is retried by the next caller."""
    envs_dir = envs_dir.resolve()  # instance venvs name it in a .pth file: an absolute path
    envs_dir.mkdir(parents=True, exist_ok=True)
    key = env_key(requirements)
    env_dir, done = envs_dir / key, envs_dir / f"{key}.ok"
    with open(envs_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists() and _python_of(env_dir).exists():
            return env_dir
        shutil.rmtree(env_dir, ignore_errors=True)
        venv.EnvBuilder(with_pip=True, symlinks=os.name != "nt").create(env_dir)
        ok, log = pip_install(_python_of(env_dir), requirements, timeout)
        (envs_dir / f"{key}.log").write_text(json.dumps(requirements) + "\n" + log)
        if not ok:
            raise EnvBuildError(f"installing the requirements failed: {first_error(log)}")
        done.write_text(json.dumps(requirements))
    return env_dir


def first_error(log: str) -> str:
    """The line of an installer's log that says what went wrong (the first `error:` line, else the last)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"(ERROR|error)\b:?", ln) and "See above" not in ln]
    return (errors[0] if errors else lines[-1] if lines else "(no output)")[:300]


def make_venv(env_dir: Path, checkout_dir: Path, pythonpath: list[str] | None = None,
              deps: Path | None = None, stdlib_compat: bool = False) -> Path:
    """Create the instance's virtualenv over `deps` (a dependency environment) or, without one, over
    the harness's own site-packages; returns its python. `stdlib_compat`: restore the standard-library
    names Python 3.10/3.11 removed (`stdlib_compat.py`) for a repository that still imports them."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=os.name != "nt").create(env_dir)
    python = _python_of(env_dir)
    if deps is not None:
        inherited = [_site_packages(deps)]
    else:
        inherited = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    lines = source_paths(checkout_dir, pythonpath) + inherited  # the checkout first
    own = Path(_site_packages(env_dir))
    (own / "openglm-harness.pth").write_text("\n".join(lines) + "\n")
    if stdlib_compat:
        shutil.copy(Path(__file__).with_name("stdlib_compat.py"), own / "openglm_stdlib_compat.py")
        (own / "openglm-stdlib-compat.pth").write_text("import openglm_stdlib_compat\n")
    _pip_launcher(env_dir)
    return python


def _pip_launcher(env_dir: Path) -> None:
    """`pip` on the instance venv's PATH runs the inherited pip under the venv's python, so it
    installs into the instance venv (the venv itself is made without pip: that takes seconds)."""
    if os.name == "nt":
        return
    launcher = env_dir / "bin" / "pip"
    launcher.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    launcher.chmod(0o755)
    shutil.copy(launcher, env_dir / "bin" / "pip3")


def run_in_venv(env_dir: Path, cwd: Path, command: str, timeout: float) -> tuple[int, str, bool]:
    """Run a shell command with the instance venv active; (exit status, output, timed out?). The
    whole process group is killed on timeout."""
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = str(env_dir)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return run_command(command, cwd, env=env, timeout=timeout, shell=True)


def apply_patch(repo: Path, patch: str) -> tuple[bool, str]:
    """git apply, then GNU patch with fuzz (as SWE-bench does); (applied?, log)."""
    if not patch.strip():
        return True, "empty patch: nothing to apply\n"
    return git_apply_patch(repo, patch, fuzz=True)
