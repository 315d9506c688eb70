"""Sampling parameters: each filter and penalty changes the distribution as specified."""

import math

import pytest
import torch

from openglm.engine.sampler import Sampler, apply_penalties, filter_logits
from openglm.engine.sampling_params import SamplingParams
from openglm.engine.sequence import Sequence


def seqs_with(n=1, prompt=(0,), **kw):
    return [Sequence(list(prompt), SamplingParams(**kw), index=i) for i in range(n)]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9], [5.0, 0.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, seqs_with(2, temperature=0))
    assert tokens == [1, 0]


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = filter_logits(logits.clone(), seqs_with(top_k=2))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    out = filter_logits(logits.clone(), seqs_with(top_p=0.7))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()  # 0.5 < 0.7 so the 0.3 stays
    out = filter_logits(logits.clone(), seqs_with(top_p=0.5))
    assert torch.isfinite(out[0, 0]) and torch.isinf(out[0, 1:]).all()
    out = filter_logits(logits.clone(), seqs_with(min_p=0.5))  # keep p >= 0.25
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()


def test_penalties():
    s = Sequence([1], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    s.append_token(2)
    s.append_token(2)
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    out = apply_penalties(logits.clone(), [s])
    assert out[0, 0] == 1.0  # unseen
    assert out[0, 1] == 0.5  # prompt token: repetition penalty only (positive logit divided)
    assert math.isclose(float(out[0, 2]), 0.5 - 0.5 - 2 * 0.25)  # divided, then presence + 2x frequency
    s2 = Sequence([3], SamplingParams(repetition_penalty=2.0))
    assert apply_penalties(logits.clone(), [s2])[0, 3] == -2.0  # negative logit multiplied


def test_seed_makes_sampling_reproducible_and_distribution_matches():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    draws = []
    for _ in range(2):
        s = Sequence([0], SamplingParams(temperature=1.0, seed=123))
        draws.append([Sampler(seed=99)(logits, [s])[0][0] for _ in range(50)])
    assert draws[0] == draws[1]
    s = Sequence([0], SamplingParams(temperature=1.0))
    sampler = Sampler(seed=0)
    counts = torch.bincount(torch.tensor([sampler(logits, [s])[0][0] for _ in range(2000)]), minlength=3)
    freq = counts.float() / 2000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)


def test_low_temperature_concentrates_mass():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    s = Sequence([0], SamplingParams(temperature=0.05))
    picks = [Sampler(seed=i)(logits, [s])[0][0] for i in range(50)]
    assert picks.count(0) >= 45


def test_logprobs_are_raw_log_softmax_with_top_alternatives():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, lps = Sampler()(logits, seqs_with(temperature=0, logprobs=2))
    expected = torch.log_softmax(logits[0], -1)
    assert tokens == [0]
    assert math.isclose(lps[0]["logprob"], float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in lps[0]["top"]] == [0, 1]


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0),
                                         ("n", 0), ("min_p", 2.0), ("top_k", -2), ("logprobs", 50)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
