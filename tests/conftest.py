"""Suite-wide: where the Triton kernels run, and the markers every test folder uses.

- Without a CUDA device, TRITON_INTERPRET=1 is set here, before any test imports `openglm.kernels` (Triton
  reads it when a kernel module is imported), so the kernel tests run the kernels in Triton's interpreter on
  CPU tensors. With a CUDA device the same tests run the compiled kernels on CUDA tensors.
- Tests marked `gpu` check the CUDA paths end to end (the model and the engine with the kernels, against the
  PyTorch ops) and need a CUDA device. Without one they are deselected (pytest reports them as deselected,
  never as passed or skipped) unless `-m` names the marker: `pytest -m gpu` on a machine without CUDA runs
  them, and they fail on the missing device. (docs/gpu.md, "Tests")
- Tests marked `amx` check the Intel AMX paths (`model/isa.py`: a prefill's experts on oneDNN's AMX tiles) and need
  a CPU with AMX; on other CPUs they are deselected the same way (`pytest -m amx` runs them anyway, and they fail).
- Tests marked `needs_native` exercise openglm's native CPU kernels (openglm/model/native.py), which need a C
  compiler; without one (or with OPENGLM_NATIVE=0) they are skipped, saying why. `needs_native("vnni")`: also
  the int8 path compiled with AVX512-VNNI (this CPU's).
"""

from __future__ import annotations

import os

import pytest


def _cuda() -> bool:
    import torch  # the suite imports it anyway; here only to ask for a device

    return torch.cuda.is_available()


if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _amx() -> bool:
    from openglm.model.isa import cpu_features  # torch's cpuid reading

    return cpu_features().amx


def pytest_collection_modifyitems(config, items):
    _deselect_without(config, items, "gpu", _cuda)
    _deselect_without(config, items, "amx", _amx)
    _skip_without_native(items)


def _deselect_without(config, items, marker: str, present) -> None:
    """Deselect the tests marked `marker` when the hardware it names is absent, unless -m names the marker."""
    wanted = [item for item in items if item.get_closest_marker(marker)]
    if not wanted or marker in (config.getoption("markexpr") or "") or present():
        return
    config.hook.pytest_deselected(items=wanted)
    items[:] = [item for item in items if not item.get_closest_marker(marker)]


def _skip_without_native(items) -> None:
    marked = [item for item in items if item.get_closest_marker("needs_native") is not None]
    if not marked:
        return
    from openglm.model.native import decode_kernels, dsa_kernels  # the model: imported only when a test needs it

    built = decode_kernels() is not None and dsa_kernels() is not None
    vnni = built and bool(decode_kernels().decode_features() & 2)
    for item in marked:
        features = item.get_closest_marker("needs_native").args
        if not built:
            item.add_marker(pytest.mark.skip(reason="no C compiler (or OPENGLM_NATIVE=0): the native kernels "
                                                    "cannot be built; the torch-op paths are all there is"))
        elif "vnni" in features and not vnni:
            item.add_marker(pytest.mark.skip(reason="this CPU (or build) has no AVX512-VNNI int8 path"))
