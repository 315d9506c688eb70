"""Text generation from a trained checkpoint: a sampling loop over the model's KV cache.

Each step feeds only the newest token; the cache holds the past (MLA latents), so a completion of n
tokens costs one prompt forward plus n single-token forwards.
"""

from __future__ import annotations

import torch

from openglm.model.cache import DynamicCache
from openglm.model.sampling import filter_logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 50, top_p: float = 0.95, seed: int = 0, stop_ids=(), on_token=None) -> list[int]:
    """Generated token ids (without the prompt); stops early on any of `stop_ids`."""
    if not prompt_ids:
        raise ValueError("generation needs a non-empty prompt")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    cache = DynamicCache()
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    out: list[int] = []
    stop = set(stop_ids)
    for _ in range(max_new_tokens):
        token = int(sample_next(logits, temperature, top_k, top_p, gen)[0])
        if token in stop:
            break
        out.append(token)
        if on_token is not None:
            on_token(out)
        logits = model(torch.tensor([[token]], device=device), cache=cache).logits[:, -1]
    model.train(was_training)
    return out


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 128, temperature: float = 0.8, top_k: int = 50,
             top_p: float = 0.95, seed: int = 0, stream=None) -> str:
    """Complete `prompt` like a file's beginning (the training data separates files by eos).

    `stream(text_piece)` is called with each new piece of decoded text as it is generated.
    """
    prompt_ids = [tokenizer.eos_id] + tokenizer.encode(prompt)
    shown = [0]

    def on_token(ids):
        text = tokenizer.decode(ids)
        if stream is not None and not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            stream(text[shown[0]:])
            shown[0] = len(text)

    ids = generate_ids(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                       stop_ids=[tokenizer.eos_id], on_token=on_token)
    return tokenizer.decode(ids)
