import torch

from openglm.train.generate import filter_logits, generate, generate_ids, sample_next


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[False, True, False, True]]
    probs = logits.softmax(-1)[0]  # 0.03, 0.64, 0.09, 0.24
    assert probs[1] < 0.7
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))  # 0.64 < 0.7 so the second token is needed too
    assert kept.tolist() == [[False, True, False, True]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum() == 1  # the top token always survives
    assert sample_next(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, temperature=1.0, top_k=2, generator=gen).item() for _ in range(50)}
    assert draws == {1, 3}


def test_cached_greedy_generation_equals_full_recompute(tiny_cfg):
    from openglm.train.trainer import Trainer

    trainer = Trainer(tiny_cfg())
    trainer.run(stop_at=4)
    model, tok = trainer.model, trainer.tokenizer
    prompt = [tok.eos_id] + tok.encode("def fibonacci(n):")
    cached = generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    ids = list(prompt)
    model.eval()
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached == ids[len(prompt):]
    pieces = []
    text = generate(model, tok, "def fibonacci(n):", max_new_tokens=12, temperature=0, stream=pieces.append)
    assert text == tok.decode(cached) and "".join(pieces) == text
