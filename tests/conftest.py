"""Suite-wide: where the Triton kernels run, and the `gpu` marker (docs/gpu.md, "Tests").

- Without a CUDA device, TRITON_INTERPRET=1 is set here, before any test imports `openglm.kernels` (Triton
  reads it when a kernel module is imported), so the kernel tests run the kernels in Triton's interpreter on
  CPU tensors. With a CUDA device the same tests run the compiled kernels on CUDA tensors.
- Tests marked `gpu` check the CUDA paths end to end (the model and the engine with the kernels, against the
  PyTorch ops) and need a CUDA device. Without one they are deselected (pytest reports them as deselected,
  never as passed or skipped) unless `-m` names the marker: `pytest -m gpu` on a machine without CUDA runs
  them, and they fail on the missing device.
"""

from __future__ import annotations

import os


def _cuda() -> bool:
    import torch  # the suite imports it anyway; here only to ask for a device

    return torch.cuda.is_available()


if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _cuda() or "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
