import torch

from openglm.model.sampling import filter_logits


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[False, True, False, True]]
    probs = logits.softmax(-1)[0]  # 0.03, 0.64, 0.09, 0.24
    assert probs[1] < 0.7
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))  # 0.64 < 0.7 so the second token is needed too
    assert kept.tolist() == [[False, True, False, True]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum() == 1  # the top token always survives
