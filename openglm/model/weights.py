"""The one place that maps native parameter names to Hugging Face checkpoint tensor names.

Every native name equals its on-disk transformers name, except the routed experts, which openglm
stores stacked for grouped matmuls:
    model.layers.L.mlp.experts.gate_up_proj  [E, 2I, H]  <->  model.layers.L.mlp.experts.{e}.gate_proj.weight [I, H]
                                                            + model.layers.L.mlp.experts.{e}.up_proj.weight   [I, H]
    model.layers.L.mlp.experts.down_proj     [E, H, I]  <->  model.layers.L.mlp.experts.{e}.down_proj.weight [H, I]
Checkpoints that already hold the stacked form (transformers' in-memory layout) load as is.
The next-n (MTP) layers are held as `model.mtp_layers.i.*` and stored as `model.layers.{num_hidden_layers + i}.*`
(`hf_name`); only the `num_nextn_predict_layers` declared layers may follow the decoder layers on disk
(`extra_layer`). FP8 block scales (`*.weight_scale_inv`) are the business of openglm/model/fp8.py.

It also holds `derived_weight` / `fused_rows`: inference-only tensors built from parameters (e.g. the
stacked weights of projections that read the same input), cached outside the state_dict and rebuilt
whenever a source parameter changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from openglm.model.errors import ShapeMismatchError, UnexpectedTensorError
from openglm.model.quantized import QuantizedWeight

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.")
# Copies some checkpoints keep inside a next-n layer; held as raw tensors (model.mtp_extra), not parameters.
MTP_OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")


def hf_name(native_name: str, num_hidden_layers: int) -> str:
    """The on-disk name of a native tensor before expert unstacking: next-n layer i -> layer N + i."""
    m = _MTP.match(native_name)
    if not m:
        return native_name
    return f"model.layers.{num_hidden_layers + int(m.group(1))}." + native_name[m.end():]


def hf_pieces(native_name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The per-expert HF tensors (name, shape) that make up one native tensor (itself if not stacked)."""
    m = _STACKED.match(native_name)
    if not m:
        return [(native_name, tuple(shape))]
    prefix, which = m.groups()
    E = shape[0]
    if which == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tuple(shape[1:])) for e in range(E)]
    piece = (shape[1] // 2, shape[2])
    return [(f"{prefix}.{e}.{p}.weight", piece) for e in range(E) for p in ("gate_proj", "up_proj")]


def assemble(native_name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `to_hf`: build one native tensor from its HF pieces (in `hf_pieces` order)."""
    m = _STACKED.match(native_name)
    if not m:
        return tensors[0]
    if m.group(2) == "down_proj":
        return torch.stack(tensors)
    return torch.stack([torch.cat(tensors[i:i + 2]) for i in range(0, len(tensors), 2)])


def to_hf(native_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Native tensor -> (HF name, tensor) pairs as transformers saves them."""
    pieces = hf_pieces(native_name, tuple(tensor.shape))
    if len(pieces) == 1 and pieces[0][0] == native_name:
        yield native_name, tensor
        return
    if native_name.endswith("down_proj"):
        for (name, _), t in zip(pieces, tensor.unbind(0)):
            yield name, t
        return
    inter = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        yield pieces[2 * e][0], tensor[e, :inter]
        yield pieces[2 * e + 1][0], tensor[e, inter:]


def load_native(native_name: str, shape, get: Callable[[str], torch.Tensor], has: Callable[[str], bool]):
    """Read one native tensor through `get(hf_name)`, accepting stacked or per-expert layouts.
    Returns (tensor, hf names used). Raises KeyError naming the first missing HF tensor."""
    if has(native_name):
        names = [native_name]
        tensors = [_checked(native_name, get(native_name), tuple(shape))]
        return tensors[0], names
    pieces = hf_pieces(native_name, tuple(shape))
    for name, _ in pieces:
        if not has(name):
            raise KeyError(name)
    tensors = [_checked(name, get(name), piece_shape) for name, piece_shape in pieces]
    return assemble(native_name, tensors), [name for name, _ in pieces]


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ShapeMismatchError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
    return t


def extra_layer(name: str, num_hidden_layers: int, num_nextn: int) -> int | None:
    """For a checkpoint tensor of a layer past the decoder layers: its next-n index (0 for layer N). None for
    other tensors. A layer past the declared next-n layers raises UnexpectedTensorError naming the tensor:
    such a checkpoint holds more layers than its config says, and loading it would truncate the model."""
    m = _LAYER.match(name)
    if not m or int(m.group(1)) < num_hidden_layers:
        return None
    i = int(m.group(1)) - num_hidden_layers
    if i >= num_nextn:
        raise UnexpectedTensorError(
            f"tensor {name!r} belongs to layer {m.group(1)}, but the config has num_hidden_layers="
            f"{num_hidden_layers} and num_nextn_predict_layers={num_nextn} (a config with fewer layers than the "
            "checkpoint would load a truncated model)")
    return i


# ---- Derived inference weights ------------------------------------------------------------------
# Inference fuses projections that read the same input into one matmul (and the like). The fused
# tensors are derived from the parameters, so they are cached and rebuilt whenever a source changes.


def derived_weight(module: torch.nn.Module, name: str, sources: list[torch.Tensor],
                   build: Callable[..., torch.Tensor]) -> torch.Tensor | None:
    """`build(*sources)`, cached on `module` under `name` until a source changes: another tensor, new
    storage (`module.to(...)`, `p.data = ...`) or an in-place update (optimizer steps, load_state_dict
    and init all bump the parameter's version counter). Writes through `p.data` bypass that counter and
    are not seen. Sources are Parameters or `QuantizedWeight`s (the engine's quantised weights; a stacking
    `build` keeps them quantised). Returns None, meaning "use the unfused path", for any other source
    (an inference tensor has no version counter). Never part of state_dict: the cache is a plain
    attribute, not a parameter or buffer."""
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
