"""llama.cpp's greedy continuation of an openglm checkpoint (converted by its own convert_hf_to_gguf.py) equals
openglm's, for glm4_moe, glm4_moe_lite and glm_moe_dsa (DSA with index_topk >= the sequence: llama.cpp runs the
indexer densely). Opt-in: `make interop` builds llama-cpp-python first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type", ["glm4_moe", "glm4_moe_lite", "glm_moe_dsa"])
def test_greedy_tokens_equal(model_type, request, tmp_path):
    cache = request.config.getoption("--llama-cache")
    r = subprocess.run([sys.executable, str(ROOT / "interop" / "llama_cpp_check.py"), "--cache", cache,
                        "--types", model_type, "--keep", str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    result = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    assert result is not None, r.stderr[-4000:]
    assert len(result["openglm"]) == 16 and result["openglm"] == result["llama.cpp"], result
