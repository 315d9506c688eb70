"""AdamW with weight decay only on matrices, global-norm clipping, and optional optimizer-state offload."""

from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D+ weights (projections, embeddings, experts); never norms, biases or scalar gains."""
    decay, no_decay = [], []
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class OffloadedAdamW:
    """AdamW whose fp32 master weights and moment buffers live in CPU memory.

    On an accelerator the optimizer state (2x the weights) then costs no device memory: each step
    copies gradients to the CPU, updates there, and copies the new weights back. On a CPU-only run it
    behaves exactly like AdamW (useful to test; no memory saved).
    """

    def __init__(self, model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float):
        self.groups = param_groups(model, weight_decay)
        self.device_params = [p for g in self.groups for p in g["params"]]
        pin = torch.cuda.is_available()
        master_groups = []
        for g in self.groups:
            masters = [p.detach().to("cpu", torch.float32, copy=True) for p in g["params"]]
            if pin:
                masters = [m.pin_memory() for m in masters]
            for m in masters:
                m.requires_grad_(True)
            master_groups.append({"params": masters, "weight_decay": g["weight_decay"]})
        self.masters = [m for g in master_groups for m in g["params"]]
        self.inner = torch.optim.AdamW(master_groups, lr=lr, betas=betas)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self) -> None:
        for p, m in zip(self.device_params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.device_params, self.masters):
                p.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        with torch.no_grad():  # masters follow the (already restored) model weights
            for p, m in zip(self.device_params, self.masters):
                m.copy_(p.detach().float().cpu())


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float,
                    offload: bool = False):
    if offload:
        return OffloadedAdamW(model, lr, betas, weight_decay)
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, fused=fused or None)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm` (0 = only measure). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.nn.utils.get_total_norm(grads))
