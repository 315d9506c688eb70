"""A weight held quantised: int8 (or fp8 e4m3) values plus one fp32 scale per output row.

`QuantizedWeight` is a tensor subclass that stands in for a floating weight of the model dtype (same shape
and dtype to the code that reads it), so the model runs unchanged on quantised weights:
- the decode kernels (`native.py`) read its int8 values and scales in place (no dequantised copy);
- views that keep the reduced last dimension (indexing or slicing an expert stack, a per-head view, a
  `torch.cat` of projections into one fused weight) stay quantised;
- any other op sees the dequantised tensor, built for that op and dropped after it (a prefill matmul, a
  transpose), so no full-precision copy of the model is held.
The scale of row `i` multiplies `qdata[..., i, :]`: the last dimension is the one each scale covers, so a
`[out, in]` Linear weight and an `[E, out, in]` expert stack both get one scale per output channel.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class QuantizedWeight(torch.Tensor):
    qdata: torch.Tensor  # int8 or float8_e4m3fn, the weight's shape
    scale: torch.Tensor  # fp32, the weight's shape with a last dimension of 1

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        if scale.shape != (*qdata.shape[:-1], 1) or scale.dtype != torch.float32:
            raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype} does not fit quantised values "
                             f"{tuple(qdata.shape)}: one fp32 scale per row is expected")
        self.qdata, self.scale = qdata, scale

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.float() * self.scale).to(self.dtype)

    def nbytes_stored(self) -> int:
        return self.qdata.numel() * self.qdata.element_size() + self.scale.numel() * 4

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
    return _same(t, aten.slice.Tensor(t.qdata, dim, start, end, step), aten.slice.Tensor(t.scale, dim, start, end, step))


def _view(t, size):
    size = list(size)
    if -1 in size or size[-1] != t.shape[-1]:
        return None
    try:
        return _same(t, t.qdata.view(size), t.scale.view(size[:-1] + [1]))
    except RuntimeError:  # a view the strides do not allow: the dequantised path copies
        return None


def _cat(tensors, dim=0):
    if not all(isinstance(t, QuantizedWeight) and t.qdata.dtype == tensors[0].qdata.dtype for t in tensors):
        return None
    if not _keeps_rows(tensors[0], dim):
        return None
    return _same(tensors[0], torch.cat([t.qdata for t in tensors], dim), torch.cat([t.scale for t in tensors], dim))


def _detach(t):
    return _same(t, t.qdata, t.scale)


_VIEWS = {aten.select.int: _select, aten.slice.Tensor: _slice, aten.view.default: _view, aten.cat.default: _cat,
          aten.detach.default: _detach, aten.alias.default: _detach}
