import torch

from openglm.train.generate import generate, generate_ids, sample_next


def test_sample_next_greedy_and_top_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
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
