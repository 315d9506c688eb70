"""Activation checkpointing in segments of k decoder layers (write-up: "save full activations every 4 layers").

Only the input of each segment is kept during the forward; the k layers inside are recomputed during the
backward. The model's layer loop and parameter names are untouched: the first layer of a segment (the
leader) runs the whole segment under `torch.utils.checkpoint` and stashes its followers' outputs, which
they return in place of running again. The forwards are patched per instance, so state_dict keys (and
save_pretrained) are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _follower_forward(layer: nn.Module):
    original = layer.forward

    def forward(*args, **kwargs):
        stash = layer.__dict__.pop("_segment_output", None)
        return original(*args, **kwargs) if stash is None else stash

    return original, forward


def _leader_forward(layer: nn.Module, followers: list[tuple[nn.Module, callable]]):
    original = layer.forward

    def forward(h, rot, key_valid, past, cache, selection, token_mask, with_stats, ops):
        if not (layer.training and torch.is_grad_enabled()) or cache is not None:
            return original(h, rot, key_valid, past, cache, selection, token_mask, with_stats, ops)
        members = [(layer, original)] + followers

        def run_segment(h, rot, selection):
            outs = []
            for module, fwd in members:
                h, sel, stats = fwd(h, rot, key_valid, past, None, selection, token_mask, with_stats, ops)
                if module.self_attn.kind == "dsa":  # the same hand-over as the model's loop
                    selection = sel
                outs.append((h, sel, stats))
            return outs

        outs = checkpoint(run_segment, h, rot, selection, use_reentrant=False)
        for (module, _), out in zip(followers, outs[1:]):
            module.__dict__["_segment_output"] = out
        return outs[0]

    return forward


def enable_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Checkpoint `model.model.layers` in segments of `every` layers; returns the number of segments."""
    if every < 1:
        raise ValueError(f"activation_checkpointing must be >= 1 (layers per segment), got {every}")
    layers = list(model.model.layers)
    n_segments = 0
    for start in range(0, len(layers), every):
        followers = []
        for layer in layers[start + 1:start + every]:
            original, patched = _follower_forward(layer)
            layer.forward = patched
            followers.append((layer, original))
        layers[start].forward = _leader_forward(layers[start], followers)
        n_segments += 1
    return n_segments
