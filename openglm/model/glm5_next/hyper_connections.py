"""Manifold-constrained hyper-connections: GLM-5.3's residual stream is n = hc_mult streams [B, T, n, hidden].

Around each block (attention, MLP) one small projection of the RMS-normalised streams gives, per token,
    pre  [n]    = sigmoid(.) + eps          weights that collapse the n streams into the block's input
    post [n]    = 2 sigmoid(.)              weights that spread the block's output back over the streams
    comb [n, n] = softmax(.) + eps, made doubly stochastic by Sinkhorn iterations (column, then row and column
                  normalisations): how the n input streams mix into the n output streams
and the block's result is streams_out[i] = post[i] * block(collapsed) + sum_j comb[j, i] streams_in[j].
The embeddings enter as n copies; after the last layer the streams' plain mean goes to the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HyperConnection:
    """The parameters of one block's mixing, under the checkpoints' names: `{prefix}_fn` [(2 + n) n, n hidden],
    `{prefix}_base` [(2 + n) n], `{prefix}_scale` [3] (for pre, post, comb). They are registered on `owner` (the
    decoder layer: the checkpoints hold `layers.L.hc_attn_fn`, ...); this object only computes with them."""

    def __init__(self, owner: nn.Module, prefix: str, n: int, hidden: int, iters: int, eps: float, norm_eps: float):
        width = (2 + n) * n
        owner.register_parameter(f"{prefix}_fn", nn.Parameter(torch.empty(width, n * hidden)))
        owner.register_parameter(f"{prefix}_base", nn.Parameter(torch.empty(width)))
        owner.register_parameter(f"{prefix}_scale", nn.Parameter(torch.empty(3)))
        self.prefix, self.n, self.iters, self.eps, self.norm_eps = prefix, n, iters, eps, norm_eps

    def weights(self, owner: nn.Module, streams: torch.Tensor):
        """(post [B, T, n], comb [B, T, n, n], the collapsed block input [B, T, hidden]) of streams [B, T, n, hidden]:
        `owner`'s parameters applied."""
        with torch.autocast(streams.device.type, enabled=False):  # fp32 weights, as the reference computes them
            return self._weights(owner, streams)

    def _weights(self, owner: nn.Module, streams: torch.Tensor):
        fn, base, scale = (getattr(owner, f"{self.prefix}_{s}") for s in ("fn", "base", "scale"))
        B, T, n, _ = streams.shape
        flat = streams.reshape(B, T, -1).float()
        flat = F.rms_norm(flat, (flat.shape[-1],), eps=self.norm_eps)
        mixed = F.linear(flat, fn.float())
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], -1)
        pre_b, post_b, comb_b = base.float().split([n, n, n * n])
        s = scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.view(B, T, n, n) * s[2] + comb_b.view(n, n), -1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(2).to(streams.dtype)
        return post, comb, collapsed


def merge(block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post[i] * block_out + sum_j comb[j, i] streams[j]; [B, T, n, hidden]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed
