"""Native CPU kernels for DSA (`dsa_kernels.c`), compiled on first use and loaded with ctypes.

Two steps of gather-based DSA have no efficient form as torch ops on the CPU: the lightning indexer's per-row
top-k (as torch ops, 6-8 passes over each score row: relu, head sum, mask, sample top-k, compare, nonzero,
gathers) and the scores / weighted sums of the selected (query, key) pairs (`sampled_addmm` runs at ~5 GFLOP/s,
`embedding_bag` reads each query's rows at random). The C does each in one or two passes over cache-resident
data. It is compiled once (~0.3 s) with the system C compiler (`cc`, or $CC) into ~/.cache/openglm (or
$OPENGLM_CACHE), keyed by the source, flags and CPU (`-march=native`). Without a compiler, or with
OPENGLM_DSA_NATIVE=0, `dsa_kernels()` returns None and `sparse_dsa` runs its torch-op paths; a compiler whose
build fails gives a warning with its error, then the same fallback.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("dsa_kernels.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {  # argument and result types of each exported function (see dsa_kernels.c)
    "dsa_pairs_by_key": ([_P, _I, _I, _I, _P, _P], _I),
    "dsa_pair_scores": ([_P, _I, _P, _I, _I, _I, _F, _P, _P, _P, _P, _I], None),
    "dsa_pair_values": ([_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I], None),
    "dsa_pair_exp": ([_P, _P, _P, _I], None),
    "dsa_head_sum": ([_P, ctypes.c_int, _I, _I, _I, _P, _P, _I, _P, _I], None),
    "dsa_rows_topk": ([_P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P], None),
}


def _cpu_id() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=1)
def dsa_kernels():
    """The compiled kernels (a ctypes library), or None: disabled, no compiler, or the build failed."""
    if os.environ.get("OPENGLM_DSA_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    source = SOURCE.read_text()
    key = hashlib.sha256("\n".join([source, cc, *FLAGS, platform.machine(), _cpu_id()]).encode())
    cache = os.environ.get("OPENGLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "openglm")
    path = os.path.join(cache, f"dsa_{key.hexdigest()[:16]}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: atomic for others
                lib = os.path.join(tmp, "dsa.so")
                subprocess.run([cc, *FLAGS, str(SOURCE), "-o", lib], check=True, capture_output=True, timeout=120)
                os.replace(lib, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-300:]
        warnings.warn(f"openglm: DSA native kernels unavailable ({e} {detail}); using the torch-op path")
        return None
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def ptr(t: torch.Tensor) -> int:
    """A tensor's data address for a kernel argument (callers pass contiguous tensors of the right dtype)."""
    return t.data_ptr()
