"""Which checks a target gets: a path is a run folder (telemetry + its latest checkpoint) or a checkpoint; a URL is a
running server; nothing is this machine alone. Path targets also get the machine's checks, with the model's weights
against the memory."""

from __future__ import annotations

from pathlib import Path

from openglm.doctor.checkpoint import check_checkpoint
from openglm.doctor.machine import check_machine, probe
from openglm.doctor.report import Report, info
from openglm.doctor.run import check_run
from openglm.doctor.server import check_server
from openglm.model.checkpoint import resolve_checkpoint
from openglm.model.errors import CheckpointError
from openglm.model.params import parameter_report


def target_kind(path: Path) -> str:
    """'run' (metrics.jsonl or a checkpoints/latest pointer), 'checkpoint' (config.json); ValueError otherwise."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder (give a checkpoint, a run folder, or --url URL)")
    if (path / "metrics.jsonl").is_file() or (path / "checkpoints" / "latest").is_file():
        return "run"
    if (path / "config.json").is_file() or (path / "latest").is_file():
        return "checkpoint"
    raise ValueError(f"{path} is neither a checkpoint (config.json) nor a training run (metrics.jsonl, "
                     "checkpoints/latest)")


def diagnose(target: str | None = None, url: str | None = None, tokenizer: str | None = None,
             api_key: str | None = None, watch_s: float = 5.0, machine=None) -> Report:
    """The report for `target` (a checkpoint or run folder), `url` (a server), or neither (this machine).
    `machine`: the MachineFacts to judge (default: this machine's, probed now)."""
    if url is not None:
        return Report({"kind": "server", "url": url}, check_server(url, api_key, watch_s))
    facts = machine or probe()
    if target is None:
        return Report({"kind": "machine"}, check_machine(facts))
    path = Path(target)
    kind = target_kind(path)
    checks, cfg = [], None
    if kind == "run":
        checks += check_run(path)
        try:
            ckpt = resolve_checkpoint(path)
        except CheckpointError as e:
            checks.append(info("checkpoint.found", f"no checkpoint to check yet ({e})"))
        else:
            found, cfg = check_checkpoint(ckpt, tokenizer)
            checks += [info("checkpoint.found", f"latest checkpoint: {ckpt}")] + found
    else:
        found, cfg = check_checkpoint(resolve_checkpoint(path), tokenizer)
        checks += found
    params = parameter_report(cfg)["total_params"] if cfg is not None else None
    return Report({"kind": kind, "path": str(path)}, check_machine(facts, params, "the model's") + checks)
