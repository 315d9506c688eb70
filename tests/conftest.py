"""Markers every test folder uses.

`@pytest.mark.needs_native`: the test exercises openglm's native kernels (openglm/model/native.py), which need a C
compiler; without one (or with OPENGLM_NATIVE=0) it is skipped, saying why. `@pytest.mark.needs_native("vnni")`:
also an int8 path compiled with AVX512-VNNI (this CPU's)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("needs_native") is not None]
    if not marked:
        return
    from openglm.model.native import decode_kernels, dsa_kernels  # torch: imported only when a test needs it

    built = decode_kernels() is not None and dsa_kernels() is not None
    vnni = built and bool(decode_kernels().decode_features() & 2)
    for item in marked:
        features = item.get_closest_marker("needs_native").args
        if not built:
            item.add_marker(pytest.mark.skip(reason="no C compiler (or OPENGLM_NATIVE=0): the native kernels "
                                                    "cannot be built; the torch-op paths are all there is"))
        elif "vnni" in features and not vnni:
            item.add_marker(pytest.mark.skip(reason="this CPU (or build) has no AVX512-VNNI int8 path"))
