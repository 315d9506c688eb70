"""A weight held quantised: int8 (or fp8 e4m3) values plus one fp32 scale per output row, or int4 values packed two
to a byte plus one bf16 scale per group of input columns.

`QuantizedWeight` is a tensor subclass that stands in for a floating weight of the model dtype (same shape
and dtype to the code that reads it), so the model runs unchanged on quantised weights:
- the decode kernels (`native.py`) read its int8 values and scales in place (no dequantised copy);
- views that keep the reduced last dimension (indexing or slicing an expert stack, a per-head view, a
  `torch.cat` of projections into one fused weight) stay quantised;
- any other op sees the dequantised tensor, built for that op and dropped after it (a prefill matmul, a
  transpose), so no full-precision copy of the model is held.
The scale of row `i` multiplies `qdata[..., i, :]`: the last dimension is the one each scale covers, so a
`[out, in]` Linear weight and an `[E, out, in]` expert stack both get one scale per output channel.

int4 (`quantize_int4`): symmetric, group-wise along the input dimension (GGML's Q4_0 rule): each group of
`group` (a multiple of 32) weights has the scale s = v / -8 of its value v of largest magnitude, rounded to bf16,
and codes c = clamp(round(w / s) + 8, 0, 15), so w ~ (c - 8) * s and v itself is exact. `qdata` is uint8
[..., out, in / 2], `scale` bf16 [..., out, in / group]. Packing (`pack_int4`), per row: blocks of 64 codes in 32
bytes, byte j holding code j in its low nibble and code 32 + j in its high nibble; a row whose width is an odd
multiple of 32 ends with a block of 32 codes in 16 bytes (byte j: codes j and 16 + j). A block's low nibbles are
then 32 (or 16) consecutive codes, which the decode kernels widen to one vector without shuffling.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


INT4_GROUPS = (32, 64, 128)  # the group sizes the int4 kernels take


class QuantizedWeight(torch.Tensor):
    qdata: torch.Tensor  # int8 or float8_e4m3fn, the weight's shape; or uint8, int4 codes packed (`pack_int4`)
    scale: torch.Tensor  # fp32, the weight's shape with a last dimension of 1; int4: bf16 [..., out, in / group]

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        shape = (*qdata.shape[:-1], 2 * qdata.shape[-1]) if qdata.dtype == torch.uint8 else qdata.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        if qdata.dtype == torch.uint8:
            check_int4(qdata, scale)
        elif scale.shape != (*qdata.shape[:-1], 1) or scale.dtype != torch.float32:
            raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype} does not fit quantised values "
                             f"{tuple(qdata.shape)}: one fp32 scale per row is expected")
        self.qdata, self.scale = qdata, scale

    @property
    def group(self) -> int:
        """Input columns per scale: the row width for per-row scales, the group size for int4."""
        return self.shape[-1] // self.scale.shape[-1] if self.scale.shape[-1] else 0

    @property
    def is_int4(self) -> bool:
        return self.qdata.dtype == torch.uint8

    def dequantize(self) -> torch.Tensor:
        if self.is_int4:
            codes = unpack_int4(self.qdata).float() - 8.0
            return (codes * self.scale.float().repeat_interleave(self.group, dim=-1)).to(self.dtype)
        return (self.qdata.float() * self.scale).to(self.dtype)

    def nbytes_stored(self) -> int:
        return self.qdata.numel() * self.qdata.element_size() + self.scale.numel() * self.scale.element_size()

    def data_ptr(self) -> int:  # what `weights.derived_weight` keys its cache on
        return self.qdata.data_ptr()

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.qdata.dtype} {tuple(self.shape)} as {self.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        view = _VIEWS.get(func)
        out = view(*args, **kwargs) if view is not None else None
        if out is not None:
            return out
        if func.is_view:  # a view of the dequantised copy, made as a normal tensor for the reason in `_same`
            with torch.inference_mode(False):
                return func(*_dequantized(args), **_dequantized(kwargs))
        return func(*_dequantized(args), **_dequantized(kwargs))


def _dequantized(tree):
    if isinstance(tree, QuantizedWeight):
        return tree.dequantize()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_dequantized(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _dequantized(v) for k, v in tree.items()}
    return tree


def _keeps_rows(t: torch.Tensor, dim: int) -> bool:
    """Whether an op along `dim` leaves each scale's row (the last dimension) whole."""
    return dim % t.dim() != t.dim() - 1


def _same(t: QuantizedWeight, qdata: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    # A view of a weight made outside inference mode must not be an inference tensor (autograd's view
    # tracking sets its version counter to the base's), so the wrapper is made as a normal tensor.
    with torch.inference_mode(False):
        return QuantizedWeight(qdata, scale, t.dtype)


def _select(t, dim, index):
    return _same(t, t.qdata.select(dim, index), t.scale.select(dim, index)) if _keeps_rows(t, dim) else None


def _slice(t, dim=0, start=None, end=None, step=1):
    if not _keeps_rows(t, dim):
        return None
    return _same(t, aten.slice.Tensor(t.qdata, dim, start, end, step),
                 aten.slice.Tensor(t.scale, dim, start, end, step))


def _view(t, size):
    size = list(size)
    if -1 in size or size[-1] != t.shape[-1]:
        return None
    try:
        return _same(t, t.qdata.view(size[:-1] + [t.qdata.shape[-1]]), t.scale.view(size[:-1] + [t.scale.shape[-1]]))
    except RuntimeError:  # a view the strides do not allow: the dequantised path copies
        return None


def _cat(tensors, dim=0):
    if not all(isinstance(t, QuantizedWeight) and t.qdata.dtype == tensors[0].qdata.dtype
               and t.scale.shape[-1] == tensors[0].scale.shape[-1] for t in tensors):
        return None
    if not _keeps_rows(tensors[0], dim):
        return None
    return _same(tensors[0], torch.cat([t.qdata for t in tensors], dim), torch.cat([t.scale for t in tensors], dim))


def _detach(t):
    return _same(t, t.qdata, t.scale)


def _stack(tensors, dim=0):  # a stack of expert weights as a checkpoint loads them
    if not tensors or dim % (tensors[0].dim() + 1) == tensors[0].dim():
        return None
    return _cat([_view(t, [*t.shape[:dim], 1, *t.shape[dim:]]) if isinstance(t, QuantizedWeight) else t
                 for t in tensors], dim)


_VIEWS = {aten.select.int: _select, aten.slice.Tensor: _slice, aten.view.default: _view, aten.cat.default: _cat,
          aten.stack.default: _stack, aten.detach.default: _detach, aten.alias.default: _detach}


# ---- int4: the packed layout and the quantiser ----------------------------------------------------------------

def check_int4(qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError in one line unless qdata (uint8 [..., out, in / 2]) and scale (bf16 [..., out, in / group]) are
    an int4 weight the kernels take: in a multiple of 32, group one of INT4_GROUPS dividing it."""
    width = 2 * qdata.shape[-1] if qdata.dim() else 0
    groups = scale.shape[-1] if scale.dim() else 0
    group = width // groups if groups else 0
    if (qdata.dtype != torch.uint8 or scale.dtype != torch.bfloat16 or qdata.dim() < 2
            or scale.shape[:-1] != qdata.shape[:-1] or width % 32 or group not in INT4_GROUPS
            or group * groups != width):
        raise ValueError(f"int4 weight: codes {tuple(qdata.shape)} {qdata.dtype} and scales {tuple(scale.shape)} "
                         f"{scale.dtype} do not fit (expected uint8 [..., out, in/2] and bf16 [..., out, in/group], "
                         f"in a multiple of 32, group one of {INT4_GROUPS})")


def _blocks(width: int) -> list[int]:
    """The block widths of a packed row: 64 codes each, then 32 when the width is an odd multiple of 32."""
    return [64] * (width // 64) + ([32] if width % 64 else [])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., in] (in a multiple of 32) -> [..., in / 2] in the layout above."""
    width = codes.shape[-1]
    if width % 32 or codes.dtype != torch.uint8:
        raise ValueError(f"pack_int4: codes {tuple(codes.shape)} {codes.dtype}: uint8 rows a multiple of 32 wide")
    out, at = [], 0
    for b in _blocks(width):
        lo, hi = codes[..., at:at + b // 2], codes[..., at + b // 2:at + b]
        out.append(lo | (hi << 4))
        at += b
    return torch.cat(out, dim=-1)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [..., in / 2] -> codes [..., in]."""
    out, at = [], 0
    for b in _blocks(2 * packed.shape[-1]):
        byte = packed[..., at:at + b // 2]
        out += [byte & 15, byte >> 4]
        at += b // 2
    return torch.cat(out, dim=-1)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, bf16 scales) of a floating weight [..., out, in] (in a multiple of `group`, one of
    INT4_GROUPS); see the module docstring for the rule."""
    if group not in INT4_GROUPS or w.shape[-1] % group:
        raise ValueError(f"int4: group {group} does not divide the weight's width {w.shape[-1]} (groups: "
                         f"{', '.join(map(str, INT4_GROUPS))})")
    g = w.detach().float().reshape(*w.shape[:-1], w.shape[-1] // group, group)
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    scale = (extreme / -8.0).to(torch.bfloat16)  # rounded first: the codes are chosen for the stored scale
    s = scale.float()
    codes = torch.round(g / torch.where(s == 0, torch.ones_like(s), s)) + 8
    codes = codes.clamp_(0, 15).to(torch.uint8).reshape(w.shape)
    return pack_int4(codes), scale.squeeze(-1)
