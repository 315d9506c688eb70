"""Native parameter names <-> Hugging Face checkpoint tensor names, declared as data (`HFNames`) per model family.

Every native name equals its on-disk transformers name, except what a family's `HFNames` lists:
- `stacked`: tensors openglm holds stacked for grouped matmuls, each with the per-expert tensors that make it up on
  disk. GLM's routed experts:
      model.layers.L.mlp.experts.gate_up_proj [E, 2I, H] <-> model.layers.L.mlp.experts.{e}.gate_proj.weight [I, H]
                                                            + model.layers.L.mlp.experts.{e}.up_proj.weight   [I, H]
      model.layers.L.mlp.experts.down_proj    [E, H, I]  <-> model.layers.L.mlp.experts.{e}.down_proj.weight [H, I]
  Checkpoints that already hold the stacked form (transformers' in-memory layout) load as is.
- the next-n (MTP) layers, held as `model.mtp_layers.i.*` and stored as `model.layers.{num_hidden_layers + i}.*`
  (`hf_name`); only the `num_nextn_predict_layers` declared layers may follow the decoder layers on disk
  (`extra_layer`), and `nextn_copies` are tensors some checkpoints keep inside a next-n layer, held as raw tensors
  (`model.mtp_extra`), not parameters.
- `prefixes`: a multimodal checkpoint nests the text model (glm5_next: `model.` -> `model.language_model.`): `disk`
  applies them last, `from_disk` undoes them; `kept`: prefixes of tensors openglm does not run (its vision tower),
  kept as stored and written back unchanged (`model.vision_extra`).
FP8 block scales (`*.weight_scale_inv`) are the business of openglm/model/fp8.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from openglm.model.errors import ShapeMismatchError, UnexpectedTensorError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.")


@dataclass(frozen=True)
class Stacked:
    """A native tensor [E, rows, ...] of each decoder layer that a checkpoint stores as E x len(pieces) tensors:
    piece p of expert e is native[e] rows [p * rows / len(pieces), (p + 1) * rows / len(pieces))."""
    native: str  # the name inside a layer, e.g. "mlp.experts.gate_up_proj"
    pieces: tuple[str, ...]  # the per-expert names inside a layer, with {e} for the expert


@dataclass(frozen=True)
class HFNames:
    stacked: tuple[Stacked, ...] = ()
    nextn_copies: tuple[str, ...] = ()  # names inside a next-n layer
    prefixes: tuple[tuple[str, str], ...] = ()  # (text-model prefix, on-disk prefix), first match wins
    kept: tuple[str, ...] = ()  # on-disk prefixes of tensors kept as stored
    fp8_not_convert: tuple[str, ...] = ()  # modules an FP8 save leaves unquantised beside fp8.DEFAULT_NOT_CONVERT

    def disk(self, name: str) -> str:
        """The on-disk name of a text-model tensor named as `hf_pieces` names it."""
        for text, disk in self.prefixes:
            if name.startswith(text):
                return disk + name[len(text):]
        return name

    def from_disk(self, name: str) -> str:
        """Inverse of `disk`."""
        for text, disk in self.prefixes:
            if name.startswith(disk):
                return text + name[len(disk):]
        return name

    def is_kept(self, name: str) -> bool:
        return bool(self.kept) and name.startswith(self.kept)

    def reading(self, names) -> "HFNames":
        """These names for reading a checkpoint holding tensors `names`: without the prefixes when it does not use
        them (a flat, text-only export of a multimodal model)."""
        if self.prefixes and not any(n.startswith(disk) for n in names for _, disk in self.prefixes):
            return replace(self, prefixes=())
        return self

    def hf_pieces(self, native_name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The HF tensors (name, shape) that make up one native tensor (named as on disk: `hf_name` first):
        itself unless stacked, else expert by expert, piece by piece."""
        found = self._stacked(native_name)
        if found is None:
            return [(native_name, tuple(shape))]
        prefix, st = found
        piece = (shape[1] // len(st.pieces), *shape[2:])
        return [(f"{prefix}.{p.format(e=e)}", piece) for e in range(shape[0]) for p in st.pieces]

    def assemble(self, native_name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One native tensor from its HF pieces (in `hf_pieces` order): the inverse of `to_hf`."""
        found = self._stacked(native_name)
        if found is None:
            return tensors[0]
        n = len(found[1].pieces)
        return torch.stack([torch.cat(tensors[i:i + n]) if n > 1 else tensors[i] for i in range(0, len(tensors), n)])

    def to_hf(self, native_name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A native tensor (named as on disk) -> the (HF name, tensor) pairs transformers saves (views of it)."""
        pieces = self.hf_pieces(native_name, tuple(tensor.shape))
        if self._stacked(native_name) is None:
            yield native_name, tensor
            return
        parts = [part for expert in tensor.unbind(0) for part in expert.chunk(len(pieces) // tensor.shape[0])]
        yield from ((name, part) for (name, _), part in zip(pieces, parts))

    def load_native(self, native_name: str, shape, get: Callable[[str], torch.Tensor], has: Callable[[str], bool]):
        """Read one native tensor (named as on disk) through `get(hf_name)`, stacked or in pieces. Returns (tensor,
        HF names used). Raises KeyError naming the first missing HF tensor, ShapeMismatchError for a wrong shape."""
        if has(native_name):
            return _checked(native_name, get(native_name), tuple(shape)), [native_name]
        pieces = self.hf_pieces(native_name, tuple(shape))
        for name, _ in pieces:
            if not has(name):
                raise KeyError(name)
        tensors = [_checked(name, get(name), piece_shape) for name, piece_shape in pieces]
        return self.assemble(native_name, tensors), [name for name, _ in pieces]

    def _stacked(self, name: str) -> tuple[str, Stacked] | None:
        """(the layer prefix 'model.layers.L', its `Stacked`) for a stacked tensor's name, else None."""
        m = _LAYER.match(name)
        if m is None:
            return None
        inside = name[m.end():]
        st = next((st for st in self.stacked if st.native == inside), None)
        return None if st is None else (m.group(0)[:-1], st)


# The GLM MoE families' names (GLM-5, GLM-4.x, GLM-4.7-Flash): stacked routed experts, next-n layers after the others.
GLM_MOE = HFNames(
    stacked=(Stacked("mlp.experts.gate_up_proj",
                     ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
             Stacked("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",))),
    nextn_copies=("embed_tokens.weight", "shared_head.head.weight"),
)


def hf_name(native_name: str, num_hidden_layers: int) -> str:
    """The on-disk name of a native tensor before expert unstacking: next-n layer i -> layer N + i."""
    m = _MTP.match(native_name)
    if not m:
        return native_name
    return f"model.layers.{num_hidden_layers + int(m.group(1))}." + native_name[m.end():]


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


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ShapeMismatchError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies {shape}")
    return t
