"""`openglm swe-solve`: run the four-phase policy on SWE-bench-format instances and write
predictions (instance_id, model_name_or_path, model_patch) for `openglm swe-eval`.

Each instance is checked out at its base_commit (as the harness does), submitted to the agent
runtime as a task with the problem statement as objective, and run to the end by an in-process
worker with the SWE policy. The prediction is `git diff base_commit` of the workspace, test files
left out by default (the instance's test_patch brings the official tests). An instance with its own
environment (`openglm_env`) gets a venv built as the harness builds it, and the policy's checks run
the repository's tests under it (OPENGLM_TEST_PYTHON). Finished instances are
skipped on a rerun; PAUSED ones (model unavailable, context overflow) are run again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from openglm.agent import service
from openglm.agent.config import AgentConfig
from openglm.agent.llm import ModelSpec
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker
from openglm.retrieval.spans import is_test_path
from openglm.swe.harness.env import checkout
from openglm.swe.harness.instances import load_predictions
from openglm.swe.harness.run import HarnessConfig, instance_venv
from openglm.swe.policy import factory
from openglm.util.git import git


@dataclass
class SolveConfig:
    out_dir: Path = Path("runs/swe-solve")
    repos_dir: Path = Path(".bench/swe-gen/repos")
    model: ModelSpec | None = None
    model_name: str = "openglm-swe-policy"
    timeout: str = "60m"
    reveal_tests: bool = False  # tell the agent the FAIL_TO_PASS ids (off: SWE-bench does not)
    keep_tests: bool = False
    envs_dir: Path = Path(".bench/envs")  # dependency environments of instances that list requirements


def objective(instance: dict, reveal_tests: bool, workspace) -> str:
    """The task's objective names the checkout the agent works in (not the source it was cloned from)."""
    text = (f"Resolve this issue in the repository at {workspace} (a checkout of {instance['repo']}):\n\n"
            f"{instance['problem_statement']}")
    if reveal_tests:
        text += "\n\nTests that must pass afterwards: " + ", ".join(instance["FAIL_TO_PASS"])
    return text


def prediction_patch(workspace: Path, base: str, keep_tests: bool) -> str:
    git(workspace, "add", "-A")
    files = [f for f in git(workspace, "diff", "--cached", "--name-only", base).split()
             if keep_tests or not is_test_path(f)]
    return git(workspace, "diff", "--cached", base, "--", *files) if files else ""


def solve_instance(instance: dict, config: SolveConfig, policy_factory=None) -> dict:
    root = config.out_dir / instance["instance_id"]
    workspace = root / "repo"
    if not workspace.exists():
        checkout(instance, config.repos_dir, workspace)
    test_python = _instance_python(instance, workspace, root, config)
    agent_config = AgentConfig(data_dir=str(root / "agent"), model=config.model)
    store = SQLiteStore(str(root / "agent.db"))
    try:
        tasks = store.list_tasks()  # a rerun after an interruption continues the same task
        task = tasks[0] if tasks else service.submit(
            store, agent_config, objective(instance, config.reveal_tests, workspace.resolve()), str(workspace),
            {"timeout": config.timeout})
        worker = Worker(agent_config, store=store, policy_factory=policy_factory or (lambda: factory(agent_config)))
        saved = os.environ.get(TEST_PYTHON)
        if test_python:  # the policy's checks run the repository's tests under the instance's interpreter
            os.environ[TEST_PYTHON] = str(test_python)
        try:
            if store.get_task(task.id).state == "QUEUED":
                worker.run_one()
        finally:
            if test_python and saved is None:
                os.environ.pop(TEST_PYTHON, None)
            elif test_python:
                os.environ[TEST_PYTHON] = saved
        final = store.get_task(task.id)
    finally:
        store.close()
    return {"instance_id": instance["instance_id"], "model_name_or_path": config.model_name,
            "model_patch": prediction_patch(workspace, instance["base_commit"], config.keep_tests),
            "openglm_state": final.state, "openglm_reason": final.reason}


TEST_PYTHON = "OPENGLM_TEST_PYTHON"  # the interpreter openglm.swe.testrun runs tests under


def _instance_python(instance: dict, workspace: Path, root: Path, config: SolveConfig) -> Path | None:
    """An instance with its own environment (`openglm_env`, as real-bug instances have) gets its venv
    beside the workspace, built as the harness builds it; None: openglm's own interpreter."""
    if "openglm_env" not in instance:
        return None
    venv_dir = root / "venv"
    python = venv_dir / "bin" / "python"
    if not python.exists():
        harness = HarnessConfig(repos_dir=config.repos_dir, envs_dir=config.envs_dir)
        instance_venv(instance, workspace, venv_dir, harness, [])
    return python


UNFINISHED = ("PAUSED", "NEEDS_INPUT")  # a task stopped for now (model down, context, a question): rerun it


def finished_ids(preds_path: Path) -> set[str]:
    """Instances whose latest prediction ended the task (a rerun skips them; a PAUSED one is run again,
    its new line superseding the old, since the last prediction of an instance wins)."""
    if not preds_path.exists():
        return set()
    preds = load_predictions(str(preds_path), [])
    return {iid for iid, rec in preds.items() if rec.get("openglm_state") not in UNFINISHED}


def solve(instances: list[dict], config: SolveConfig, policy_factory=None) -> Path:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    preds_path = config.out_dir / "predictions.jsonl"
    done = finished_ids(preds_path)
    with preds_path.open("a") as f:
        for inst in tqdm([i for i in instances if i["instance_id"] not in done], desc="swe-solve", unit="inst"):
            f.write(json.dumps(solve_instance(inst, config, policy_factory)) + "\n")
            f.flush()
    return preds_path
