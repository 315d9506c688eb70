"""A trained checkpoint is a Hugging Face checkpoint: transformers loads model and tokenizer from it."""

import torch

from openglm.train.trainer import train


def test_trained_checkpoint_loads_in_transformers_with_same_logits(tiny_cfg):
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

    res = train(tiny_cfg(max_steps=6, save_every=6, seq_len=32))
    ckpt = res.checkpoint
    hf = GlmMoeDsaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(ckpt))
    text = "def add(a, b):\n    return a + b\n" * 3
    ids = torch.tensor([hf_tok.encode(text, add_special_tokens=False)])
    assert ids.shape[1] > res.model_config.index_topk  # long enough for DSA to select a subset of keys
    assert ids.tolist()[0] == res.tokenizer.encode(text)
    # the router bias was trained (aux-loss-free balancing), so the export must carry it
    bias = res.model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0
    res.model.eval()
    with torch.no_grad():
        ours = res.model(ids).logits
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
