"""Run predictions against SWE-bench-format instances and write SWE-bench-compatible reports.

Layout (as SWE-bench's): <out>/logs/run_evaluation/<run_id>/<model>/<instance_id>/ holds
patch.diff, run_instance.log, test_output.txt and report.json; <out>/<model>.<run_id>.json is the
run report. An instance whose report.json exists is skipped on a rerun (resumable).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from openglm.swe.harness.env import (
    EnvBuildError,
    apply_patch,
    checkout,
    dependency_env,
    first_error,
    make_venv,
    run_in_venv,
)
from openglm.swe.harness.grading import instance_report
from openglm.swe.logparse import parse_log
from openglm.swe.testrun import is_test_module
from openglm.util.files import write_atomic
from openglm.util.git import git


@dataclass
class HarnessConfig:
    run_id: str = "openglm"
    out_dir: Path = Path("runs/swe-eval")
    repos_dir: Path = Path(".bench/swe-gen/repos")
    workers: int = 2
    timeout: float = 900  # seconds for the test command of one instance
    install_cmd: str = ""  # e.g. "pip install -e ." (runs inside the instance venv)
    keep_workdirs: bool = False
    envs_dir: Path = Path(".bench/envs")  # shared dependency environments (instances with requirements)
    env_timeout: float = 1800  # seconds to build one dependency environment


def test_files(instance: dict, repo: Path | None = None) -> list[str]:
    """What to run: the test modules the test patch touches (not its data files: `tests/data/x.py`
    is input, not a test module) plus the files named by the graded tests. Which files are test
    modules follows the repository's pytest configuration (`repo`, the checkout) when given."""
    touched = re.findall(r"^diff --git a/\S+ b/(\S+)", instance.get("test_patch") or "", re.M)
    files = [f for f in touched if f.endswith(".py") and is_test_module(f, repo)]
    for t in instance["FAIL_TO_PASS"] + instance["PASS_TO_PASS"]:
        if "::" in t:
            files.append(t.split("::")[0])
    return sorted(set(files))


def pytest_command(files: list[str] | tuple[str, ...], args: list[str] | tuple[str, ...] = ()) -> str:
    """pytest with both per-test reports: the `-rA` summary and, for pytest < 4.4 that has none,
    the verbose `file::test PASSED` lines. A module that does not import does not stop the others."""
    targets = " ".join(f"'{f}'" for f in files)
    extra = "".join(f" '{a}'" for a in args)
    return (f"python -m pytest -rA -v -p no:cacheprovider -o addopts= --tb=short "
            f"--continue-on-collection-errors{extra} {targets}")


def test_command(instance: dict, repo: Path | None = None) -> str:
    if instance.get("test_cmd"):  # openglm extension: an explicit command wins
        return instance["test_cmd"]
    args = (instance.get("openglm_env") or {}).get("pytest_args", [])
    return pytest_command(test_files(instance, repo), args)


def instance_venv(instance: dict, repo: Path, venv_dir: Path, config: HarnessConfig, log: list[str]) -> Path:
    """The instance's venv for the checkout `repo`: over its dependency environment (built if needed),
    the install commands run inside it; returns its python. Raises EnvBuildError."""
    env = instance.get("openglm_env") or {}
    deps = dependency_env(env["requirements"], config.envs_dir, config.env_timeout) if env.get("requirements") else None
    python = make_venv(venv_dir, repo, instance.get("openglm_pythonpath"), deps,
                       stdlib_compat=bool(env.get("stdlib_compat")))
    log.append(f"venv {python} over {deps or 'the harness packages'}")
    for cmd in filter(None, [env.get("install_cmd"), config.install_cmd]):
        rc, out, timed_out = run_in_venv(venv_dir, repo, cmd, config.timeout)
        log.append(f"$ {cmd} -> {rc}\n{out[-4000:]}")
        if rc != 0:
            raise EnvBuildError(f"`{cmd}` failed (exit {rc}{', timed out' if timed_out else ''}): {first_error(out)}")
    return python


class Sandbox:
    """Where an instance's tests run: a private checkout at base_commit and a private venv.

    Used by run_instance and by the benchmark generator, so a mutant is validated exactly as it
    will be graded. `reset` brings the checkout back to base_commit, so several patches can be
    tried in one sandbox."""

    def __init__(self, instance: dict, config: HarnessConfig):
        self.instance, self.config = instance, config
        self.work = Path(tempfile.mkdtemp(prefix=f"swe-{instance['instance_id']}-"))
        self.repo, self.venv = self.work / "repo", self.work / "venv"
        self.log: list[str] = []
        try:
            t0 = time.time()
            checkout(instance, config.repos_dir, self.repo)
            self.python = instance_venv(instance, self.repo, self.venv, config, self.log)
            self.log.append(f"checkout + environment in {time.time() - t0:.1f}s")
        except BaseException:
            self.close()
            raise

    def apply(self, patch: str) -> bool:
        """Apply a model patch; False (and the log says why) when it does not apply."""
        applied, plog = apply_patch(self.repo, patch)
        self.log.append(plog)
        return applied

    def run_tests(self) -> tuple[dict[str, str], str]:
        """Apply the test patch, run the instance's test command; ({test: status}, output). A run
        that crashed, timed out or reported no test gives an empty status (every graded test then
        fails); raises RuntimeError only when the test patch does not apply."""
        t_applied, tlog = apply_patch(self.repo, self.instance.get("test_patch") or "")
        self.log.append(tlog)
        if not t_applied:
            raise RuntimeError("the instance's test_patch does not apply")
        cmd = test_command(self.instance, self.repo)
        self.log.append(f"$ {cmd}")
        t0 = time.time()
        rc, output, timed_out = run_in_venv(self.venv, self.repo, cmd, self.config.timeout)
        status = parse_log(output)
        self.log.append(f"exit {rc} in {time.time() - t0:.1f}s, {len(status)} test results"
                        + (f"; timed out after {self.config.timeout:.0f}s" if timed_out else ""))
        if not status:
            self.log.append(">>>>> Tests Errored: the run reported no per-test result (a crash of the runner?)")
        return status, output

    def reset(self) -> None:
        git(self.repo, "checkout", "--quiet", "--force", "--detach", self.instance["base_commit"])
        git(self.repo, "clean", "-q", "-fdx")

    def close(self) -> None:
        if not self.config.keep_workdirs:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_instance(instance: dict, pred: dict, config: HarnessConfig) -> dict:
    """Evaluate one prediction; always returns a report (errors are reported, never raised)."""
    log_dir = _log_dir(config, pred, instance["instance_id"])
    log_dir.mkdir(parents=True, exist_ok=True)
    patch = pred.get("model_patch")
    (log_dir / "patch.diff").write_text(patch or "")
    log: list[str] = []
    report: dict
    try:
        with Sandbox(instance, config) as box:
            log = box.log
            if not box.apply(patch or ""):
                log.append(">>>>> Patch Apply Failed")
                report = instance_report(instance, patch, False, None)
            else:
                status, output = box.run_tests()
                (log_dir / "test_output.txt").write_text(output)
                report = instance_report(instance, patch, True, status)
    except EnvBuildError as e:  # the environment, not the patch: an error, apart from patch failures
        log.append(f">>>>> Environment build failed: {e}")
        report = instance_report(instance, patch, False, None)
        report[instance["instance_id"]].update(error=f"environment: {e}", error_kind="environment")
    except Exception as e:  # infrastructure failure: counted as an error, the run goes on
        log.append(f">>>>> Infrastructure failure: {type(e).__name__}: {e}")
        report = instance_report(instance, patch, False, None)
        report[instance["instance_id"]].update(error=f"{type(e).__name__}: {e}", error_kind="infrastructure")
    (log_dir / "run_instance.log").write_text("\n".join(log) + "\n")
    _write_json(log_dir / "report.json", report)
    return report


def run_evaluation(instances: list[dict], predictions: dict[str, dict], config: HarnessConfig) -> dict:
    todo, reports = [], {}
    for inst in instances:
        pred = predictions.get(inst["instance_id"])
        if pred is None:
            continue
        done = _log_dir(config, pred, inst["instance_id"]) / "report.json"
        if done.exists():
            reports.update(json.loads(done.read_text()))  # resumable: finished instances are skipped
        else:
            todo.append((inst, pred))
    with ThreadPoolExecutor(max_workers=max(1, config.workers)) as pool:
        futures = [pool.submit(run_instance, inst, pred, config) for inst, pred in todo]
        for fut in tqdm(as_completed(futures), total=len(futures), desc="swe-eval", unit="inst"):
            reports.update(fut.result())
    return write_run_report(instances, predictions, reports, config)


def write_run_report(instances, predictions, reports, config: HarnessConfig) -> dict:
    """The run report, with SWE-bench's keys (schema_version 2)."""
    ids = [i["instance_id"] for i in instances]
    submitted = [i for i in ids if i in predictions]
    empty = [i for i in submitted if not (predictions[i].get("model_patch") or "").strip()]
    errors = [i for i in submitted if reports.get(i, {}).get("error")]
    completed = [i for i in submitted if i in reports and i not in errors]
    resolved = [i for i in completed if reports[i]["resolved"]]
    report = {
        "total_instances": len(ids), "submitted_instances": len(submitted),
        "completed_instances": len(completed), "resolved_instances": len(resolved),
        "unresolved_instances": len(completed) - len(resolved), "empty_patch_instances": len(empty),
        "error_instances": len(errors),
        "completed_ids": completed, "incomplete_ids": [i for i in ids if i not in completed and i not in errors],
        "empty_patch_ids": empty, "submitted_ids": submitted, "resolved_ids": resolved,
        "unresolved_ids": [i for i in completed if i not in resolved], "error_ids": errors,
        "env_error_ids": [i for i in errors if reports[i].get("error_kind") == "environment"],
        "schema_version": 2,
    }
    model = _model_dir_name(next(iter(predictions.values()))) if predictions else "none"
    _write_json(config.out_dir / f"{model}.{config.run_id}.json", report)
    return report


def _log_dir(config: HarnessConfig, pred: dict, instance_id: str) -> Path:
    return config.out_dir / "logs" / "run_evaluation" / config.run_id / _model_dir_name(pred) / instance_id


def _model_dir_name(pred: dict) -> str:
    return str(pred.get("model_name_or_path") or "model").replace("/", "__")


def _write_json(path: Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=2))
