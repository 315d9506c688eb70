"""The Triton kernels compile for Hopper (sm_90: H100, H200) at GLM-5's widths, with the tile sizes their
launchers pick, and fit the device: Triton's compiler and the ptxas bundled with the triton wheel run on the
CPU (tests/kernels/aot_compile.py), so this needs no GPU. It is the check, without a GPU, that what the
interpreter tests verify also builds for one; register and spill counts are printed (`pytest -s`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is a test dependency (pyproject's test extra)")

AOT = Path(__file__).with_name("aot_compile.py")
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90
KERNELS = {"_gate_up_kernel", "_down_kernel", "_index_scores_kernel", "_sparse_mla_kernel"}


@pytest.mark.slow
def test_the_kernels_compile_for_sm90_and_fit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=str(AOT.parents[2]))
    proc = subprocess.run([sys.executable, str(AOT), "90"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["kernel"] for r in results} == KERNELS and len(results) == 9
    for r in results:
        print(f"{r['arch']} {r['kernel']:<22} {r['config']:<34} {r['registers']:>4} regs"
              f"  {r['spill_bytes']:>5} B spilled  {r['shared_bytes'] / 1024:6.1f} KiB shared")
        assert r["registers"] <= 255 and r["shared_bytes"] <= SM90_SHARED_BYTES, r
