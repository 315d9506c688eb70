"""Derived inference weights: tensors built from parameters (the stacked weights of projections that read the same
input, a transposed or fp32 copy), cached on the module outside the state_dict and rebuilt whenever a source
changes. The inference paths (`fast.py`, `decode_step.py`) and the engine's int8 draft head use them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from openglm.model.quantized import QuantizedWeight


def derived_weight(module: torch.nn.Module, name: str, sources: list[torch.Tensor],
                   build: Callable[..., torch.Tensor]) -> torch.Tensor | None:
    """`build(*sources)`, cached on `module` under `name` until a source changes: another tensor, new
    storage (`module.to(...)`, `p.data = ...`) or an in-place update (optimizer steps, load_state_dict
    and init all bump the parameter's version counter). Writes through `p.data` bypass that counter and
    are not seen. Sources are Parameters or `QuantizedWeight`s (the engine's quantised weights; a stacking
    `build` keeps them quantised). Returns None, meaning "use the unfused path", for any other source
    (an inference tensor has no version counter). Never part of state_dict: the cache is a plain
    attribute (`_derived_weights`), not a parameter or buffer."""
    cache = module.__dict__.setdefault("_derived_weights", {})
    hit = cache.get(name)
    # A cast or a move to another device gives new storage, hence a new data_ptr. (Checked on every decode
    # step, so the key holds only attributes that are cheap to read.)
    if hit is not None and len(hit[0]) == len(sources) and all(
            a is b and b._version == v and b.data_ptr() == p and b.dtype == d
            for a, b, (p, v, d) in zip(hit[0], sources, hit[1])):
        return hit[2]
    if not all(isinstance(t, (torch.nn.Parameter, QuantizedWeight)) and not t.is_inference() for t in sources):
        return None
    key = [(t.data_ptr(), t._version, t.dtype) for t in sources]
    with torch.no_grad():
        value = build(*sources)
    cache[name] = (list(sources), key, value)
    return value


def fused_rows(module: torch.nn.Module, name: str, linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The weights of bias-free Linears that read the same input, stacked on the output dim, so one
    matmul gives all their outputs side by side (None if any has a bias, or see `derived_weight`)."""
    if any(lin.bias is not None for lin in linears):
        return None
    return derived_weight(module, name, [lin.weight for lin in linears], lambda *ws: torch.cat(ws, 0))
