"""`openglm serve --num-speculative-tokens`: the served greedy text equals plain greedy decoding of the same
checkpoint, and /metrics counts the MTP drafts it verified and accepted."""

import httpx
from testutil import openglm_serve

from openglm.engine import LLM, SamplingParams

PROMPT = "def main():\n    "


def test_served_speculation_is_exact_and_counted(tmp_path, metric):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    ckpt = build_random_checkpoint(tmp_path / "tiny-mtp", index_n_heads=16, num_nextn_predict_layers=1)
    plain = LLM(str(ckpt)).generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    with openglm_serve(ckpt, "--num-speculative-tokens", "2", "--threads", "1", "--log-level", "warning") as url:
        assert metric(url, "openglm_spec_decode_draft_tokens") == 0
        body = {"model": "tiny-mtp", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] == plain.outputs[0].text
        drafts = metric(url, "openglm_spec_decode_draft_tokens")
        accepted = metric(url, "openglm_spec_decode_accepted_tokens")
    assert drafts > 0 and 0 <= accepted <= drafts
