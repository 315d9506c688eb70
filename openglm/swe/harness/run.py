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


def test_command(instance: dict) -> str:
    if instance.get("test_cmd"):  # openglm extension: an explicit command wins
        return instance["test_cmd"]
    targets = " ".join(f"'{f}'" for f in test_files(instance))
    return f"python -m pytest -rA -p no:cacheprovider -o addopts= --tb=short {targets}"


def run_instance(instance: dict, pred: dict, config: HarnessConfig) -> dict:
    """Evaluate one prediction; always returns a report (errors are reported, never raised)."""
    model = _model_dir_name(pred)
    log_dir = config.out_dir / "logs" / "run_evaluation" / config.run_id / model / instance["instance_id"]
    log_dir.mkdir(parents=True, exist_ok=True)
    patch = pred.get("model_patch")
    (log_dir / "patch.diff").write_text(patch or "")
    log = []
    work = Path(tempfile.mkdtemp(prefix=f"swe-{instance['instance_id']}-"))
    report: dict
    try:
        repo = work / "repo"
        t0 = time.time()
        checkout(instance, config.repos_dir, repo)
        python = make_venv(work / "venv", repo, instance.get("openglm_pythonpath"))
        log.append(f"checkout + venv ({python}) in {time.time() - t0:.1f}s")
        if config.install_cmd:
            proc = run_in_venv(work / "venv", repo, config.install_cmd, config.timeout)
            log.append(f"$ {config.install_cmd} -> {proc.returncode}\n{proc.stdout[-4000:]}")
        applied, plog = apply_patch(repo, patch or "")
        log.append(plog)
        if not applied:
            log.append(">>>>> Patch Apply Failed")
            report = instance_report(instance, patch, False, None)
        else:
            t_applied, tlog = apply_patch(repo, instance.get("test_patch") or "")
            log.append(tlog)
            if not t_applied:
                raise RuntimeError("the instance's test_patch does not apply")
            cmd = test_command(instance)
            log.append(f"$ {cmd}")
            proc = run_in_venv(work / "venv", repo, cmd, config.timeout)
            (log_dir / "test_output.txt").write_text(proc.stdout)
            status = parse_log(proc.stdout)
            if not status:
                raise RuntimeError("test log could not be parsed (no per-test results)")
            report = instance_report(instance, patch, True, status)
    except Exception as e:  # infrastructure failure: counted as an error, the run goes on
        log.append(f">>>>> Infrastructure failure: {type(e).__name__}: {e}")
        report = instance_report(instance, patch, False, None)
        report[instance["instance_id"]]["error"] = f"{type(e).__name__}: {e}"
    finally:
        if not config.keep_workdirs:
            shutil.rmtree(work, ignore_errors=True)
    (log_dir / "run_instance.log").write_text("\n".join(log) + "\n")
    _write_json(log_dir / "report.json", report)
    return report


def run_evaluation(instances: list[dict], predictions: dict[str, dict], config: HarnessConfig) -> dict:
    todo, reports = [], {}
    for inst in instances:
        pred = predictions.get(inst["instance_id"])
        if pred is None:
            continue
        done = (config.out_dir / "logs" / "run_evaluation" / config.run_id / _model_dir_name(pred)
                / inst["instance_id"] / "report.json")
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


def _model_dir_name(pred: dict) -> str:
    return str(pred.get("model_name_or_path") or "model").replace("/", "__")


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
