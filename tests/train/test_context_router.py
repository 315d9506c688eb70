"""Training with the context-aware router: its parameters learn, and a run stopped and resumed is the uninterrupted
run, step for step."""

import torch

from openglm.model.context_router import ContextRouter
from openglm.train.trainer import train


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_context_router_trains_and_resumes_exactly(tiny_cfg, tmp_path):
    gated = {"router_context": "gated", "router_context_window": 8}
    full = train(tiny_cfg(out_dir=str(tmp_path / "full"), max_steps=8, save_every=100, model_overrides=gated))
    routers = [m for m in full.model.modules() if isinstance(m, ContextRouter)]
    assert len(routers) == 2 and all(r.context_weight.abs().sum() > 0 for r in routers)  # it starts at zero
    part = tiny_cfg(out_dir=str(tmp_path / "part"), max_steps=8, save_every=100, model_overrides=gated)
    assert train(part, stop_at=4).step == 4
    second = train(part, resume=True)
    assert second.step == 8
    for step in range(5, 9):
        assert abs(second.losses[step] - full.losses[step]) <= 1e-6, step
    a, b = _state(full.model), _state(second.model)
    assert any("context_proj" in k for k in a)
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
