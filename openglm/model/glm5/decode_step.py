"""A decode step's MLA decoder layers through `decode_kernels.c`: three native calls per layer.

A decode step of a few rows reads little but runs ~95 ATen ops per layer, and their dispatch is the step's cost on a
small model (figures in docs/model.md). For up to `native.max_rows()` new tokens without autograd, `DecodePlan` runs
each MLA layer (kinds `dsa` and `dense`, own or shared indexer; dense MLP or MoE) as
  mla_decode_select: input norm, projections, q/kv norms, RoPE, the new cache entries written in place, the absorbed
                     queries, and with an own indexer its scores and top-k;
  mla_decode_attend: attention over the selected latent rows where the cache holds them, W_uv, o_proj, residual,
                     post-attention norm;
  ffn_decode:        router and routed experts, shared experts (or the dense MLP), residual.
The caches provide the rows (`decode_layout`: DynamicCache's buffers, the engine's paged pool without its gather).
Exact ties at an indexer's k-th score are left to torch.topk, as on the torch path. Anything else (training,
statistics, GQA, sparse patterns, capacity limits, context-aware routers, fp8 or fp16 weights, no C compiler)
takes the torch path.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module  # its registry of hooks on every module

from openglm.model.cache import DecodeRows
from openglm.model.derived import derived_weight, fused_rows
from openglm.model.glm5.sparse_dsa import topk_slots
from openglm.model.moe import MLP, Experts, MoE
from openglm.model.native import W_I4, check, decode_kernels, decode_limits, kernel_weight
from openglm.model.quantized import QuantizedWeight

_I64, _F32, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Mat(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P)] + [(n, _I64) for n in ("type", "rows", "cols", "head_stride",
                                                                 "scale_head_stride", "group")]


class MlaLayerC(ctypes.Structure):
    _fields_ = ([(n, _I64) for n in ("hidden", "q_lora", "rank", "rope", "nope", "v_dim", "heads", "idx_heads",
                                     "idx_dim", "topk", "own_indexer", "act_bf16", "vec_bf16")]
                + [(n, _F32) for n in ("eps", "eps_q", "eps_kv", "eps_idx", "scale", "idx_weight_scale")]
                + [(n, Mat) for n in ("w_in", "w_iw", "w_q", "w_uk", "w_uv", "w_o")]
                + [(n, _P) for n in ("n_in", "n_q", "n_kv", "n_post", "ln_w", "ln_b")])


class FfnLayerC(ctypes.Structure):
    _fields_ = ([(n, _I64) for n in ("hidden", "n_experts", "top_k", "n_group", "topk_group", "inter", "norm_topk",
                                     "softmax_router", "act_bf16", "wtype", "group")]
                + [("scaling", _F32), ("router", Mat), ("bias", _P), ("gate_up", _P), ("down", _P),
                   ("gu_scale", _P), ("down_scale", _P), ("s_gu", Mat), ("s_down", Mat)])


class CacheRowsC(ctypes.Structure):
    _fields_ = ([(n, _P) for n in ("kv", "pe", "ik")]
                + [(n, _I64) for n in ("kv_stride", "pe_stride", "ik_stride", "kv_bf16", "ik_bf16")]
                + [(n, _P) for n in ("table", "row_base", "row_keys", "write", "ik8", "ik8_scale")])


class Unsupported(Exception):
    """This layer or weight has no native decode form (the caller takes the torch path)."""


def _mat(w: torch.Tensor, heads: int = 1) -> Mat:
    """A weight [rows, cols] (or [heads, rows, cols], heads apart by its stride) as decode_kernels.c reads it."""
    kw = kernel_weight(w)
    if kw is None:
        raise Unsupported(f"weight {w.dtype}")
    values, scale, wtype = kw
    rows, cols = w.shape[-2:]
    if (values.stride(-1) != 1 or values.stride(-2) != values.shape[-1] or cols % 16
            or (scale is not None and (scale.stride(-1) != 1 or scale.stride(-2) != scale.shape[-1]))):
        raise Unsupported("weight layout")
    head = values.stride(0) if values.dim() == 3 else 0
    if kw.wtype == W_I4:  # the kernels step heads in codes, two a byte
        head *= 2
    scale_head = scale.stride(0) if scale is not None and scale.dim() == 3 else 0
    return Mat(values.data_ptr(), None if scale is None else scale.data_ptr(), wtype, rows, cols, head, scale_head,
               kw.group)


def _vec(t: torch.Tensor, dtype: torch.dtype, size: int) -> int:
    if t.dtype != dtype or not t.is_contiguous() or t.numel() != size:
        raise Unsupported("norm weight")
    return t.data_ptr()


def _mla_params(layer) -> tuple[MlaLayerC, list[torch.Tensor]]:
    """The attention half's weights and sizes (and the tensors they point into, kept alive by the caller)."""
    attn, dtype = layer.self_attn, layer.input_layernorm.weight.dtype
    if attn.kind not in ("dsa", "dense") or attn.q_a_proj.bias is not None or attn.o_proj.bias is not None:
        raise Unsupported(f"attention kind {attn.kind}")
    H, nope, v, rank = attn.n_heads, attn.nope, attn.v_dim, attn.rank
    w_in, w_q = fused_rows(attn, "input", attn.input_linears()), attn.query_weight()
    kv_b = attn.kv_b_proj.weight
    w_uk = attn.w_uk_t()
    if w_in is None or w_q is None or w_uk is None:
        raise Unsupported("no fused weights")
    w_uv = kv_b.view(H, nope + v, rank)[:, nope:]
    ix = attn.indexer
    fused_iw = ix is not None and ix.weights_proj in attn.input_linears()
    hidden, q_lora = attn.q_a_proj.in_features, attn.q_a_proj.out_features
    p = MlaLayerC(
        hidden=hidden, q_lora=q_lora, rank=rank, rope=attn.rope,
        nope=nope, v_dim=v, heads=H, idx_heads=ix.n_heads if ix else 0, idx_dim=ix.head_dim if ix else 0,
        topk=ix.topk if ix else 0, own_indexer=int(ix is not None), act_bf16=int(dtype == torch.bfloat16),
        vec_bf16=int(dtype == torch.bfloat16), eps=layer.input_layernorm.eps, eps_q=attn.q_a_layernorm.eps,
        eps_kv=attn.kv_a_layernorm.eps, eps_idx=ix.k_norm.eps if ix else 0.0, scale=attn.scale,
        idx_weight_scale=(ix.n_heads ** -0.5 * ix.softmax_scale) if ix else 0.0,
        w_in=_mat(w_in), w_iw=_mat(ix.weights_proj.weight) if ix and not fused_iw else Mat(),
        w_q=_mat(w_q), w_uk=_mat(w_uk, H), w_uv=_mat(w_uv, H), w_o=_mat(attn.o_proj.weight),
        n_in=_vec(layer.input_layernorm.weight, dtype, hidden), n_q=_vec(attn.q_a_layernorm.weight, dtype, q_lora),
        n_kv=_vec(attn.kv_a_layernorm.weight, dtype, rank),
        n_post=_vec(layer.post_attention_layernorm.weight, dtype, hidden),
        ln_w=_vec(ix.k_norm.weight, dtype, ix.head_dim) if ix else None,
        ln_b=_vec(ix.k_norm.bias, dtype, ix.head_dim) if ix else None)
    if attn.rope % 2 or (ix is not None and (ix.head_dim < attn.rope or not ix.k_norm.elementwise_affine)):
        raise Unsupported("rope width")
    in_rows = q_lora + rank + attn.rope + (p.idx_dim + (p.idx_heads if fused_iw else 0) if ix else 0)
    _expect(p.w_in, in_rows, hidden), _expect(p.w_q, H * (nope + attn.rope) + p.idx_heads * p.idx_dim, q_lora)
    _expect(p.w_uk, rank, nope), _expect(p.w_uv, v, rank), _expect(p.w_o, hidden, H * v)
    if ix is not None and not fused_iw:
        _expect(p.w_iw, p.idx_heads, hidden)
    return p, [w_in, w_q, w_uk, kv_b]


def _expect(m: Mat, rows: int, cols: int) -> None:
    """The kernels index by the config's sizes: a weight of any other shape never reaches them."""
    if (m.rows, m.cols) != (rows, cols):
        raise Unsupported(f"weight of shape {(m.rows, m.cols)}, expected {(rows, cols)}")


def _ffn_params(layer) -> tuple[FfnLayerC, list[torch.Tensor]]:
    """The MLP half's weights and sizes: a MoE (router, stacked experts, shared experts) or a dense MLP."""
    mlp, dtype = layer.mlp, layer.input_layernorm.weight.dtype
    dense = mlp if isinstance(mlp, MLP) else mlp.shared_experts
    keep = []
    p = FfnLayerC(hidden=layer.input_layernorm.weight.numel(), act_bf16=int(dtype == torch.bfloat16), scaling=1.0)
    if dense is not None:
        if dense.act is not F.silu:
            raise Unsupported("activation")
        gu = fused_rows(dense, "gate_up", [dense.gate_proj, dense.up_proj])
        if gu is None:
            raise Unsupported("no fused gate_up")
        p.s_gu, p.s_down = _mat(gu), _mat(dense.down_proj.weight)
        _expect(p.s_gu, 2 * p.s_down.cols, p.hidden), _expect(p.s_down, p.hidden, p.s_down.cols)
        keep.append(gu)
    if isinstance(mlp, MoE):
        gate, experts = mlp.gate, mlp.experts
        if type(experts) is not Experts or mlp.capacity_factor is not None or experts.act is not F.silu:
            raise Unsupported("capacity or activation")
        if gate.has_context:
            raise Unsupported("context-aware router")
        gu, dn = kernel_weight(experts.gate_up_proj), kernel_weight(experts.down_proj)
        if gu is None or dn is None or gu.wtype != dn.wtype or gu.group != dn.group or not (gu.contiguous()
                                                                                             and dn.contiguous()):
            raise Unsupported("expert weights")
        if experts.down_proj.shape[-1] % 16:
            raise Unsupported("expert width")
        p.n_experts, p.top_k, p.n_group, p.topk_group = gate.n_experts, gate.top_k, gate.n_group, gate.topk_group
        p.inter, p.norm_topk, p.softmax_router = (experts.down_proj.shape[-1], int(gate.norm_topk_prob),
                                                  int(gate.kind == "softmax"))
        p.scaling, p.wtype, p.group, p.router = gate.scaling, gu.wtype, gu.group, _mat(gate.weight)
        E, D, inter = gate.n_experts, p.hidden, p.inter
        _expect(p.router, E, D)
        groups_ok = gate.n_group <= 1 or (E % gate.n_group == 0 and E // gate.n_group >= 2
                                          and gate.top_k <= E // gate.n_group * gate.topk_group)
        if (experts.gate_up_proj.shape != (E, 2 * inter, D) or experts.down_proj.shape != (E, D, inter)
                or gate.top_k > E or not groups_ok):
            raise Unsupported("expert shapes or groups")
        p.gate_up, p.down = gu[0].data_ptr(), dn[0].data_ptr()
        p.gu_scale = gu[1].data_ptr() if gu[1] is not None else None
        p.down_scale = dn[1].data_ptr() if dn[1] is not None else None
    return p, keep


def layer_params(layer) -> tuple[MlaLayerC, FfnLayerC] | None:
    """The layer's native parameters, or None: no native decode form. Rebuilt when a weight changes: a tensor
    assigned anywhere (`_registrations`), new storage (`.to()`, `.data =`) or an in-place update (version)."""
    state = layer.__dict__.get("_decode_state")
    if state is None or state.registrations != _registrations:
        state = layer.__dict__["_decode_state"] = _LayerState(layer)
    if _global_hooks() or any(m._forward_hooks or m._forward_pre_hooks for m in state.modules):
        return None  # hooks (tensor-parallel all-reduces, user probes) need the module calls of the torch path
    built = derived_weight(layer, "decode_step", state.sources, lambda *_: _built_or_none(layer))
    return None if built is None else built[:2]


class _LayerState:
    """A layer's modules and weight tensors as of `registrations` (walking the module tree every step cost ~20 us a
    layer)."""

    def __init__(self, layer):
        self.registrations = _registrations
        self.modules = list(layer.modules())
        # Quantised weights are buffers; the router's correction bias (a plain buffer) is passed on every call.
        self.sources = [t for m in self.modules for t in m._parameters.values() if t is not None]
        self.sources += [t for m in self.modules for t in m._buffers.values() if isinstance(t, QuantizedWeight)]


_registrations = 0  # parameters, buffers and submodules assigned on any module since import


def _count_registration(*_) -> None:
    global _registrations
    _registrations += 1


torch_module.register_module_parameter_registration_hook(_count_registration)
torch_module.register_module_buffer_registration_hook(_count_registration)
torch_module.register_module_module_registration_hook(_count_registration)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _built_or_none(layer):
    """`_build`, or None (cached by `derived_weight` like a build: no retry until a weight changes)."""
    try:
        return _build(layer)
    except Unsupported:
        return None


def _build(layer):
    if (layer.input_layernorm.weight.dtype not in (torch.float32, torch.bfloat16)
            or not hasattr(layer.self_attn, "rank")):
        raise Unsupported("dtype or attention type")
    mla, keep_a = _mla_params(layer)
    ffn, keep_f = _ffn_params(layer)
    widest = max(mla.hidden, mla.rank, mla.q_lora, ffn.n_experts, mla.idx_heads * mla.idx_dim)
    if widest > decode_limits().step_max_width:
        raise Unsupported("widths beyond the native step's stack buffers")  # a checkpoint's config is untrusted
    return mla, ffn, keep_a + keep_f


class DecodePlan:
    """One forward's native decode: the rows' layout in the cache and the buffers every layer shares."""

    def __init__(self, layout, n_rows: int, hidden: int, heads: int, latent: int):
        self.layout, self.n = layout, n_rows
        self.x = torch.empty(n_rows, hidden)  # post-attention norm, fp32
        self.state = torch.empty(n_rows, heads, latent)  # absorbed queries, fp32
        self.tied = torch.empty(n_rows, dtype=torch.uint8)
        self.scores = self.rot = None
        self.params: dict[int, tuple[MlaLayerC, FfnLayerC]] = {}

    @classmethod
    def create(cls, layers, cache, input_ids: torch.Tensor, attention_mask, dtype: torch.dtype) -> "DecodePlan | None":
        """A plan when the step's rows fit the kernels, every layer has a native form for a residual stream of
        `dtype` and the cache can lay out the rows; else None. (`fast.choose` asks for one only without autograd
        and without statistics.)"""
        B, T = input_ids.shape
        if (not 0 < B * T <= decode_limits().max_rows or cache is None or not hasattr(cache, "decode_layout")
                or input_ids.device.type != "cpu" or decode_kernels() is None):
            return None
        params = [layer_params(layer) for layer in layers]
        if any(p is None or p[0].act_bf16 != (dtype == torch.bfloat16) for p in params):
            return None
        layout = cache.decode_layout(B, T, attention_mask)
        if layout is None:
            return None
        mla = params[0][0]
        plan = cls(layout, B * T, mla.hidden, mla.heads, mla.rank + mla.rope)
        plan.params = {id(layer): p for layer, p in zip(layers, params)}
        return plan

    def run_layers(self, layers, h: torch.Tensor, rot: torch.Tensor) -> None:
        """`run` each layer in turn over h [B, T, hidden] (updated in place)."""
        if not h.is_contiguous() or h.numel() != self.n * self.x.shape[1]:  # before any layer's cache rows move
            raise ValueError(f"hidden states {tuple(h.shape)}: the native decode step needs {self.n} contiguous rows")
        selection = None
        for layer in layers:
            selection = self.run(layer, h, rot, selection)

    def run(self, layer, h: torch.Tensor, rot: torch.Tensor, selection):
        """Layer `layer` over h [B, T, hidden] (updated in place); rot: the forward's `Rotation.rope`. Returns the
        selection a following 'shared' DSA layer reads ([n, topk] int64), else the one it was given."""
        lib, (mla, ffn) = decode_kernels(), self.params[id(layer)]
        attn = layer.self_attn
        rows = self.layout.rows(attn.layer_idx, _entry_specs(attn, h.dtype))
        c_rows = _cache_rows(rows)
        if self.rot is None or self.rot[0] is not rot:  # the same rotations for every layer of the step
            self.rot = (rot, torch.view_as_real(rot).reshape(self.n, -1))
        rot_rows = self.rot[1]
        hp, cp = h.data_ptr(), ctypes.addressof(c_rows)
        if isinstance(layer.mlp, MoE):
            ffn.bias = layer.mlp.gate.e_score_correction_bias.data_ptr()
        if attn.indexer is not None:
            selection = torch.empty(self.n, attn.indexer.topk, dtype=torch.long)
            if self.scores is None:
                self.scores = torch.empty(self.n, self.layout.max_keys)
            tied = lib.mla_decode_select(ctypes.addressof(mla), cp, self.n, hp, rot_rows.data_ptr(),
                                         self.state.data_ptr(), selection.data_ptr(), self.scores.data_ptr(),
                                         self.scores.shape[1], self.tied.data_ptr())
        else:
            tied = lib.mla_decode_select(ctypes.addressof(mla), cp, self.n, hp, rot_rows.data_ptr(),
                                         self.state.data_ptr(), None, None, 0, None)
        if check(tied, "mla_decode_select"):
            self._break_ties(selection, attn.indexer.topk)
        slots = selection if attn.kind == "dsa" else None
        check(lib.mla_decode_attend(ctypes.addressof(mla), cp, self.n, hp, self.state.data_ptr(),
                                    None if slots is None else slots.data_ptr(), 0 if slots is None else slots.shape[1],
                                    self.x.data_ptr()), "mla_decode_attend")
        check(lib.ffn_decode(ctypes.addressof(ffn), self.n, hp, self.x.data_ptr()), "ffn_decode")
        return selection

    def _break_ties(self, selection: torch.Tensor, topk: int) -> None:
        """Rows whose k-th index score is tied beyond the places left: torch.topk's choice among the tied keys, as
        the torch path (`sparse_dsa`) makes it."""
        for r in self.tied.nonzero().flatten().tolist():
            n_keys = self.layout.keys_of(r)
            selection[r] = topk_slots(self.scores[r, :n_keys].unsqueeze(0), topk)[0]


def _entry_specs(attn, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
    """The cache entries of an MLA layer, as the torch path writes them: (width, dtype) by name."""
    specs = {"kv": (attn.rank, dtype), "k_pe": (attn.rope, dtype)}
    if attn.indexer is not None:
        specs["index_k"] = (attn.indexer.head_dim, dtype)
    return specs


def _cache_rows(rows: DecodeRows) -> CacheRowsC:
    """The C view of a layer's `DecodeRows` (the caller keeps `rows` alive while the kernels run)."""
    kv, pe, ik = rows.entries["kv"], rows.entries["k_pe"], rows.entries.get("index_k")
    for t in (kv, pe) + ((ik,) if ik is not None else ()):
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"cache rows {tuple(t.shape)} {t.dtype}: expected 2-D fp32 or bf16 rows")
    if kv.dtype != pe.dtype:
        raise ValueError(f"cache entries kv ({kv.dtype}) and k_pe ({pe.dtype}) must share a dtype")
    return CacheRowsC(kv=kv.data_ptr(), pe=pe.data_ptr(), ik=None if ik is None else ik.data_ptr(),
                      kv_stride=kv.stride(0), pe_stride=pe.stride(0), ik_stride=0 if ik is None else ik.stride(0),
                      kv_bf16=int(kv.dtype == torch.bfloat16),
                      ik_bf16=int(ik is not None and ik.dtype == torch.bfloat16),
                      table=None if rows.table is None else rows.table.data_ptr(), row_base=rows.row_base.data_ptr(),
                      row_keys=rows.row_keys.data_ptr(), write=rows.write.data_ptr(),
                      ik8=None if rows.shadow is None else rows.shadow.codes.data_ptr(),
                      ik8_scale=None if rows.shadow is None else rows.shadow.scale.data_ptr())
