"""Kimi Delta Attention (KDA): GLM-5.3-Flash's linear-attention layer, in a chunked and a recurrent form.

Per head, with a state S [d_k, d_v] (zero at the start of a sequence), each token t does
    S <- diag(exp(g_t)) S                 a per-channel forget gate g_t <= 0
    delta_t = beta_t (v_t - S^T k_t)      the delta rule: write what S does not yet predict
    S <- S + k_t delta_t^T
    o_t = S^T q_t
with q, k L2-normalised (q also scaled by d_k^-1/2) after a short causal depthwise conv (+ SiLU) over q, k, v,
g from a low-rank forget gate (bounded below by `linear_lower_bound`), beta = sigmoid(b_proj x); the output goes
through an RMSNorm gated by sigmoid(g_b(g_a x)) and o_proj.

`kda_recurrent` runs that loop (decode: one token costs O(H d_k d_v)). `kda_chunked` computes the same outputs
a chunk of C tokens at a time (prefill, training): inside a chunk, with G the gate's running sum from the chunk
start, the deltas solve a unit lower-triangular system
    (I + A) delta = beta v - beta (exp(G) k) S0,   A_rs = beta_r sum_c k_r[c] k_s[c] exp(G_r[c] - G_s[c])  (s < r)
and o = (exp(G) q) S0 + M delta with M_rs the same form over q_r (s <= r), so the only sequential work is one
small state update per chunk. The exp(G_r - G_s) factors are products exp(G_r - G_b) exp(G_b - G_s) through the
boundary b before r's sub-chunk of 16 tokens, so the pair sums are matmuls; only inside a sub-chunk can a factor
exceed 1 (by at most the sub-chunk's decay, 80 in log at GLM-5.3's gate bound), and where steeper gates could
overflow fp32 those diagonal blocks are computed from the exact pairwise differences.

The layer's state between forwards is explicit (`LinearState`: the recurrent S per head and the conv window, per
sequence); the caller passes it in and gets the new one back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model import fast
from openglm.model.config import ModelConfig
from openglm.model.moe import ACT

CHUNK = 64  # tokens per chunk of `kda_chunked`
SUB_CHUNK = 16  # tokens between the boundaries the decay factors inside a chunk are taken through
RECURRENT_MAX_TOKENS = 4  # a forward of at most this many tokens without autograd (decode) runs the loop
PAIR_BUDGET = 32 << 20  # bytes of intra-chunk intermediates computed at once (a group of chunks)


@dataclass
class LinearState:
    """One KDA layer's state for a batch of sequences: `recurrent` [B, H, d_k, d_v] (fp32) and `conv` [B, 3 H d, K - 1]
    (the last K - 1 inputs of the causal conv over q | k | v, in the model dtype). Row b is sequence b's; an engine
    keeps one row per sequence and batches rows with `cat` / `select`."""
    recurrent: torch.Tensor
    conv: torch.Tensor

    @staticmethod
    def cat(states: list["LinearState"]) -> "LinearState":
        return LinearState(torch.cat([s.recurrent for s in states]), torch.cat([s.conv for s in states]))

    def select(self, index: torch.Tensor) -> "LinearState":
        return LinearState(self.recurrent.index_select(0, index), self.conv.index_select(0, index))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.recurrent, self.conv))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (eps inside the root, as the reference kernels do)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, state=None):
    """The token loop. q, k [B, T, H, d_k] (normalised, q scaled), v [B, T, H, d_v], g [B, T, H, d_k] (log forget
    gates), beta [B, T, H], state [B, H, d_k, d_v] or None (zeros); all fp32. Returns (o [B, T, H, d_v], state).
    Without autograd each step reads and writes the state three times (decay, delta-rule write, output read)."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    grad = torch.is_grad_enabled()
    S, out = state, []
    for t in range(T):
        # A fresh tensor every step (the caller's state is never written), updated in place after
        S = k.new_zeros(B, H, dk, dv) if S is None else S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t].unsqueeze(-2)  # [B, H, 1, d_k]
        delta = (v[:, t].unsqueeze(-2) - kt @ S) * beta[:, t, :, None, None]  # [B, H, 1, d_v]
        S = S + kt.transpose(-1, -2) @ delta if grad else _add_outer_(S, kt, delta)
        out.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(out, 1), S


def _add_outer_(S, k, delta):
    """S += k^T delta in place, S [B, H, d_k, d_v], k [B, H, 1, d_k], delta [B, H, 1, d_v]."""
    B, H, dk, dv = S.shape
    S.view(B * H, dk, dv).baddbmm_(k.reshape(B * H, 1, dk).transpose(1, 2), delta.reshape(B * H, 1, dv))
    return S


def kda_chunked(q, k, v, g, beta, state=None, chunk: int = CHUNK):
    """`kda_recurrent`'s result, a chunk at a time (same arguments; differentiable)."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    sub = min(SUB_CHUNK, chunk)
    C = min(chunk, -(-T // sub) * sub)  # a short sequence is one chunk of whole sub-chunks
    pad = -T % C
    q, k, v, g = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))  # [B, H, T', d]
    beta = F.pad(beta.transpose(1, 2), (0, pad))  # padding: k = 0, g = 0 leaves the state as it is
    n = q.shape[2] // C
    q, k, v, g = (x.reshape(B, H, n, C, -1) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, C, 1)
    G = g.cumsum(-2)  # [B, H, n, C, d_k]: the decay from the chunk start through each token
    S = q.new_zeros(B, H, dk, dv) if state is None else state
    outs = []
    step = max(1, PAIR_BUDGET // max(1, 4 * B * H * C * (6 * dk + 4 * C)))  # chunks whose intermediates fit
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        sl = (slice(None), slice(None), slice(c0, c1))
        U, W, M, Qd, Kd, end = _chunk_terms(q[sl], k[sl], v[sl], G[sl], beta[sl], sub)
        for i in range(c1 - c0):  # the state's way through the chunks: a few small matmuls each
            delta = U[:, :, i] - W[:, :, i] @ S
            outs.append(Qd[:, :, i] @ S + M[:, :, i] @ delta)
            S = end[:, :, i, :, None] * S + Kd[:, :, i].transpose(-1, -2) @ delta
    o = torch.stack(outs, 2).reshape(B, H, n * C, dv)[:, :, :T]
    return o.transpose(1, 2), S


def _chunk_terms(q, k, v, G, beta, sub: int):
    """Everything about a group of chunks that does not depend on the state: U, W [.., C, d] with delta = U - W S0,
    M [.., C, C] (the intra-chunk output weights), exp(G) q, exp(G_end - G) k, exp(G_end).

    The decay factors are taken relative to sub-chunk boundaries so that none exceeds 1 except exp(G_b - G_s)
    inside a sub-chunk (at most exp(the sub-chunk's decay)); each exp is computed once per token and channel."""
    C, d = k.shape[-2:]
    m = C // sub
    Gs, qs, ks = (t.unflatten(-2, (m, sub)) for t in (G, q, k))  # [.., m, sub, d]
    ends = Gs[..., -1, :]  # G at each sub-chunk's last token
    starts = torch.cat([torch.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], -2)  # G_b before each sub-chunk
    left = (Gs - starts.unsqueeze(-2)).exp()  # exp(G_r - G_b) <= 1
    inside = starts.unsqueeze(-2) - Gs  # >= 0
    steep = bool(inside.amax() > SAFE_EXPONENT) if inside.numel() else False
    k_in = ks * inside.clamp(max=SAFE_EXPONENT).exp()  # exp(G_b - G_s), s in the row's own sub-chunk
    k_local = ks * (ends.unsqueeze(-2) - Gs).exp()  # exp(G_e - G_s) <= 1, e the end of s's sub-chunk
    ql, kl = qs * left, ks * left
    Pq, Pk = q.new_zeros(*q.shape[:-1], C), q.new_zeros(*q.shape[:-1], C)
    for j in range(m):
        right = k_in[..., j, :, :]
        if j:  # earlier sub-chunks i: exp(G_b(j) - G_s) = exp(G_b(j) - G_e(i)) exp(G_e(i) - G_s), both <= 1
            cross = (starts[..., j:j + 1, :] - ends[..., :j, :]).exp().unsqueeze(-2)
            right = torch.cat([(k_local[..., :j, :, :] * cross).flatten(-3, -2), right], -2)
        block = torch.cat([ql[..., j, :, :], kl[..., j, :, :]], -2) @ right.transpose(-1, -2)  # [.., 2 sub, (j+1) sub]
        Pq[..., j * sub:(j + 1) * sub, :(j + 1) * sub] = block[..., :sub, :]
        Pk[..., j * sub:(j + 1) * sub, :(j + 1) * sub] = block[..., sub:, :]
    if steep:  # gates steeper than ~ -80 / sub per token: exp(G_b - G_s) could overflow inside a sub-chunk
        _exact_diagonal_blocks(Pq, Pk, q, k, G, sub)
    M, A = Pq.tril_(), (Pk * beta).tril_(-1)  # A: beta_r times the strictly lower triangle
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(A.shape)
    inverse = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # (I + A)^-1
    decay = (left * starts.exp().unsqueeze(-2)).flatten(-3, -2)  # exp(G)
    U, W = inverse @ (v * beta), inverse @ (k * decay * beta)
    G_end = ends[..., -1:, :]
    Kd = (k_local * (G_end - ends).exp().unsqueeze(-2)).flatten(-3, -2)  # exp(G_end - G_s) k_s
    return U, W, M, q * decay, Kd, G_end.squeeze(-2).exp()


# exp() of at most this stays finite in fp32 even summed over a few thousand channels (exp(88.7) overflows)
SAFE_EXPONENT = 80.0


def _exact_diagonal_blocks(Pq, Pk, q, k, G, sub: int) -> None:
    """Overwrites the diagonal sub-chunk blocks with sum_c x_r k_s exp(G_r - G_s) from the pairwise differences."""
    C, d = k.shape[-2:]
    m = C // sub
    qs, ks, Gs = (t.reshape(*t.shape[:-2], m, sub, d) for t in (q, k, G))
    tri = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril_()
    diff = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill_(~tri[..., None], float("-inf")).exp_()
    for P, x in ((Pq, qs), (Pk, ks)):
        blocks = torch.einsum("...rc,...sc,...rsc->...rs", x, ks, diff)
        for j in range(m):
            P[..., j * sub:(j + 1) * sub, j * sub:(j + 1) * sub] = blocks[..., j, :, :]


class LinearAttention(nn.Module):
    """The KDA layer. Parameter names are the checkpoints' (`self_attn.q_conv1d.weight`, `self_attn.f_a_proj`, ...)."""

    kind = "linear"  # beside MLAttention's kinds ("dsa", "dense", ...): never hands a DSA selection on

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        H, d, hidden = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
        self.layer_idx, self.n_heads, self.head_dim, self.width = layer_idx, H, d, H * d
        self.kernel, self.lower_bound = cfg.linear_conv_kernel_dim, cfg.linear_lower_bound
        self.act = ACT[cfg.hidden_act]
        self.q_proj = nn.Linear(hidden, H * d, bias=False)
        self.k_proj = nn.Linear(hidden, H * d, bias=False)
        self.v_proj = nn.Linear(hidden, H * d, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(H * d, H * d, self.kernel, groups=H * d, bias=False) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, H * d, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H * d))
        self.A_log = nn.Parameter(torch.empty(H))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, H * d, bias=False)
        self.o_norm = _GatedRMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * d, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: LinearState | None = None, token_valid: torch.Tensor | None = None,
                return_state: bool = False, ops: fast.Reference | None = None):
        """x [B, T, hidden] (normed); state: the sequences' state before these tokens (None: fresh sequences);
        token_valid [B, T] bool (None: no padding): padding tokens are zeroed, so (left) padding leaves the state
        as it was; ops: the forward's paths (`fast.choose`). Returns (output [B, T, hidden], the state after these
        tokens, or None unless return_state)."""
        ops = ops or fast.choose(x)
        B, T, _ = x.shape
        if token_valid is not None:
            x = x * token_valid[..., None].to(x.dtype)
        qkv = torch.cat(ops.linears(self, "qkv", [self.q_proj, self.k_proj, self.v_proj], x), -1)
        mixed, conv = self._conv(qkv, state)
        g, beta = self._forget_gate(x), torch.sigmoid(self.b_proj(x).float())
        # The delta rule in fp32 even under bf16 autocast (training): its state accumulates every token.
        with torch.autocast(x.device.type, enabled=False):
            q, k, v = (t.view(B, T, self.n_heads, self.head_dim).float() for t in mixed.split(self.width, -1))
            q = l2_normalize(q) * self.head_dim ** -0.5
            k = l2_normalize(k)
            S0 = None if state is None else state.recurrent.float()
            if T <= RECURRENT_MAX_TOKENS and not torch.is_grad_enabled():
                o, S = kda_recurrent(q, k, v, g, beta, S0)
            else:
                o, S = kda_chunked(q, k, v, g, beta, S0)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, self.n_heads, self.head_dim)
        o = self.o_norm(o, gate).to(x.dtype).reshape(B, T, self.width)
        return ops.linear(self.o_proj, o), (LinearState(S, conv) if return_state else None)

    def empty_state(self, batch: int, dtype: torch.dtype, device=None) -> LinearState:
        """The state of `batch` fresh sequences (what `forward` assumes for state=None)."""
        return LinearState(torch.zeros(batch, self.n_heads, self.head_dim, self.head_dim, device=device),
                           torch.zeros(batch, 3 * self.width, self.kernel - 1, dtype=dtype, device=device))

    def _conv(self, qkv: torch.Tensor, state: LinearState | None):
        """The causal depthwise conv (+ activation) over q | k | v, continuing from the state's window. Computed in
        the conv weight's dtype (the checkpoints keep it fp32), returned in qkv's. Returns (out [B, T, 3 H d],
        the new window [B, 3 H d, K - 1])."""
        B, T, width = qkv.shape
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        past = (qkv.new_zeros(B, width, self.kernel - 1) if state is None else state.conv.to(qkv.dtype))
        seq = torch.cat([past, qkv.transpose(1, 2)], -1)  # [B, 3 H d, K - 1 + T]
        out = self.act(F.conv1d(seq.to(w.dtype), w, groups=width)).to(qkv.dtype)
        return out.transpose(1, 2), seq[..., seq.shape[-1] - (self.kernel - 1):]

    def _forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gates [B, T, H, d] (fp32, < 0): lower_bound * sigmoid(exp(A) z), or without a
        bound -exp(A) softplus(z), z = f_b(f_a(x)) + dt_bias."""
        B, T, _ = x.shape
        z = self.f_b_proj(self.f_a_proj(x))
        with torch.autocast(x.device.type, enabled=False):
            z = (z.float() + self.dt_bias.float()).view(B, T, self.n_heads, self.head_dim)
            rate = self.A_log.float().exp().view(1, 1, -1, 1)
            if self.lower_bound is not None:
                return self.lower_bound * torch.sigmoid(rate * z)
            return -rate * F.softplus(z, threshold=20.0)


class _GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output (fp32, weight included) times sigmoid(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return x * torch.sigmoid(gate.float())
