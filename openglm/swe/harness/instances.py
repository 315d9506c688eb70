"""Read SWE-bench-format instances and predictions (JSON list, JSON object or JSONL)."""

from __future__ import annotations

import json
from pathlib import Path

from openglm.agent.llm.replay import load_turns as read_jsonl  # the project's JSONL reader

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")


def _read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # JSONL whose first record is an object
        if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
            return [{"instance_id": k, **v} for k, v in data.items()]  # {instance_id: record}
        if isinstance(data, dict):
            return [data]
    return read_jsonl(path)


def _test_list(value) -> list[str]:
    # SWE-bench ships these lists as JSON strings inside the record.
    return json.loads(value) if isinstance(value, str) else list(value or [])


def load_instances(path: str | Path) -> list[dict]:
    out = []
    for n, rec in enumerate(_read_records(path)):
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}: instance #{n} ({rec.get('instance_id', '?')}) lacks {missing}")
        rec = dict(rec)
        rec["FAIL_TO_PASS"] = _test_list(rec["FAIL_TO_PASS"])
        rec["PASS_TO_PASS"] = _test_list(rec["PASS_TO_PASS"])
        out.append(rec)
    return out


def load_predictions(spec: str, instances: list[dict]) -> dict[str, dict]:
    """`gold` (the instances' own patches), `empty`, or a predictions file."""
    if spec in ("gold", "empty"):
        return {i["instance_id"]: {"instance_id": i["instance_id"], "model_name_or_path": spec,
                                   "model_patch": i["patch"] if spec == "gold" else ""}
                for i in instances}
    preds = {}
    for n, rec in enumerate(_read_records(spec)):
        if "instance_id" not in rec or "model_patch" not in rec:
            raise ValueError(f"{spec}: prediction #{n} lacks instance_id or model_patch")
        rec.setdefault("model_name_or_path", Path(spec).stem)
        preds[rec["instance_id"]] = rec
    return preds
