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

from openglm.swe.harness.env import apply_patch, checkout, make_venv, run_in_venv
from openglm.swe.harness.grading import instance_report
from openglm.swe.logparse import parse_log
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


def test_files(instance: dict) -> list[str]:
    """What to run: files touched by the test patch plus the files named by the graded tests."""
    files = re.findall(r"^diff --git a/\S+ b/(\S+)", instance.get("test_patch") or "", re.M)
    for t in instance["FAIL_TO_PASS"] + instance["PASS_TO_PASS"]:
        if "::" in t:
            files.append(t.split("::")[0])
    return sorted(set(files))


def pytest_command(files: list[str] | tuple[str, ...]) -> str:
    targets = " ".join(f"'{f}'" for f in files)
    return f"python -m pytest -rA -p no:cacheprovider -o addopts= --tb=short {targets}"


def test_command(instance: dict) -> str:
    if instance.get("test_cmd"):  # openglm extension: an explicit command wins
        return instance["test_cmd"]
    return pytest_command(test_files(instance))


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
            python = make_venv(self.venv, self.repo, instance.get("openglm_pythonpath"))
            self.log.append(f"checkout + venv ({python}) in {time.time() - t0:.1f}s")
            if config.install_cmd:
                proc = run_in_venv(self.venv, self.repo, config.install_cmd, config.timeout)
                self.log.append(f"$ {config.install_cmd} -> {proc.returncode}\n{proc.stdout[-4000:]}")
        except BaseException:
            self.close()
            raise

    def apply(self, patch: str) -> bool:
        """Apply a model patch; False (and the log says why) when it does not apply."""
        applied, plog = apply_patch(self.repo, patch)
        self.log.append(plog)
        return applied

    def run_tests(self) -> tuple[dict[str, str], str]:
        """Apply the test patch, run the instance's test command; ({test: status}, output).
        Raises RuntimeError when the test patch does not apply or the log has no per-test result."""
        t_applied, tlog = apply_patch(self.repo, self.instance.get("test_patch") or "")
        self.log.append(tlog)
        if not t_applied:
            raise RuntimeError("the instance's test_patch does not apply")
        cmd = test_command(self.instance)
        self.log.append(f"$ {cmd}")
        proc = run_in_venv(self.venv, self.repo, cmd, self.config.timeout)
        status = parse_log(proc.stdout)
        if not status:
            raise RuntimeError("test log could not be parsed (no per-test results)")
        return status, proc.stdout

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
    except Exception as e:  # infrastructure failure: counted as an error, the run goes on
        log.append(f">>>>> Infrastructure failure: {type(e).__name__}: {e}")
        report = instance_report(instance, patch, False, None)
        report[instance["instance_id"]]["error"] = f"{type(e).__name__}: {e}"
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
