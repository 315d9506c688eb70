"""A checkpoint's tensor layout around the native names: prefix renames and tensors kept as stored.

Native parameter names equal transformers' on-disk names for the text model (see weights.py for the routed experts
and next-n layers). A multimodal checkpoint nests them (glm5_next: `model.` -> `model.language_model.`) and holds
tensors openglm does not run (its vision tower): those are kept as stored and written back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointLayout:
    prefixes: tuple[tuple[str, str], ...] = ()  # (native prefix, on-disk prefix), first match wins
    kept: tuple[str, ...] = ()  # on-disk prefixes of tensors kept as stored (not part of the model)
    fp8_not_convert: tuple[str, ...] = ()  # modules left unquantised on an FP8 save, beside fp8.DEFAULT_NOT_CONVERT

    def disk(self, name: str) -> str:
        """The on-disk name of a tensor named as transformers' text model names it."""
        for native, disk in self.prefixes:
            if name.startswith(native):
                return disk + name[len(native):]
        return name

    def native(self, name: str) -> str:
        """Inverse of `disk`."""
        for native, disk in self.prefixes:
            if name.startswith(disk):
                return native + name[len(disk):]
        return name

    def is_kept(self, name: str) -> bool:
        return name.startswith(self.kept)

    def nests(self, names) -> bool:
        """Whether a checkpoint with these tensor names uses the prefixes (else it is flat: names as native)."""
        return any(name.startswith(disk) for name in names for _, disk in self.prefixes)


FLAT = CheckpointLayout()
