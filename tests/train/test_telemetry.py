import numpy as np
import pytest

from openglm.train.schedule import lr_at
from openglm.train.telemetry import CollapseDetector, load_cv, token_shares


def _counts(hot_share: float, layers: int = 2, experts: int = 8, tokens: int = 1000, top_k: int = 2, hot_layer=1,
            hot_expert=5):
    """Balanced counts, except `hot_expert` of `hot_layer` takes `hot_share` of the tokens."""
    counts = np.full((layers, experts), tokens * top_k / experts)
    hot = hot_share * tokens
    counts[hot_layer] = (tokens * top_k - hot) / (experts - 1)
    counts[hot_layer, hot_expert] = hot
    return counts


def test_shares_and_cv():
    balanced = _counts(0.25)
    assert np.allclose(token_shares(balanced, 2), 0.25)
    assert np.allclose(load_cv(balanced), 0)
    skewed = _counts(0.95)
    assert token_shares(skewed, 2)[1, 5] == pytest.approx(0.95)
    assert load_cv(skewed)[1] > 1.0 and load_cv(skewed)[0] == pytest.approx(0)


def test_collapse_detector_needs_consecutive_checks_and_names_layer_expert_remedies():
    det = CollapseDetector(top_k=2, share_threshold=0.9, patience=3, layer_names=["layer 1", "layer 2"])
    collapsed = _counts(0.97)
    moved = collapsed[1, [0, 1]].sum()
    collapsed[1, [0, 1]] = 0  # two starved experts; their tokens go to experts 2-4
    collapsed[1, [2, 3, 4]] += moved / 3
    assert det.update(collapsed, step=10) == []
    assert det.update(_counts(0.5), step=20) == []  # streak broken
    assert det.update(collapsed, step=30) == [] and det.update(collapsed, step=40) == []
    (warning,) = det.update(collapsed, step=50)
    assert "layer 2" in warning and "expert 5 (97% of tokens)" in warning and "step 50" in warning
    assert "starved: experts 0, 1" in warning
    for remedy in ("balance-loss weight", "capacity factor", "router's gradients"):
        assert remedy in warning
    assert det.update(collapsed, step=60) == []  # said once per episode ...
    det.update(_counts(0.3), step=70)
    for s in (80, 90):
        det.update(collapsed, step=s)
    assert len(det.update(collapsed, step=100)) == 1  # ... and again after a recovery


def test_balanced_routing_never_warns():
    det = CollapseDetector(top_k=2, patience=1)
    rng = np.random.default_rng(0)
    for step in range(20):
        assert det.update(rng.multinomial(2000, [1 / 8] * 8, size=3).astype(float), step) == []


def test_warmup_then_cosine():
    lrs = [lr_at(s, 1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # half way through the cosine
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_step_tracker_names_moe_layers_by_model_index_when_dense_layers_interleave():
    from openglm.model import ModelConfig
    from openglm.train.config import TrainConfig
    from openglm.train.dist import DistInfo
    from openglm.train.tracker import StepTracker

    mcfg = ModelConfig.from_preset("tiny", first_k_dense_replace=1, mlp_layer_types=["sparse", "dense", "sparse"])
    tracker = StepTracker(mcfg, TrainConfig(out_dir="unused"), DistInfo())
    assert tracker.detector.layer_names == ["layer 0 (MoE layer 0)", "layer 2 (MoE layer 1)"]
