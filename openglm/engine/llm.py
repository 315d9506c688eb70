"""Offline batch generation: `LLM(path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import replace

from openglm.engine.config import EngineConfig
from openglm.engine.llm_engine import LLMEngine
from openglm.engine.outputs import RequestOutput
from openglm.engine.sampling_params import SamplingParams
from openglm.util.strict import check_keys


class LLM:
    """A checkpoint loaded into the paged-KV engine. Keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str, **engine_args):
        check_keys(engine_args, EngineConfig, "engine option(s)", TypeError)
        self.engine = LLMEngine.from_pretrained(model, EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to chat conversations rendered with the checkpoint's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.render_chat(c) for c in conversations]
        base = sampling_params or SamplingParams()
        stop_ids = sorted(set(base.stop_token_ids) | set(self.tokenizer.chat_stop_ids))
        params = replace(base, stop_token_ids=stop_ids)
        return self.generate(prompts, params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm  # only for a progress bar

        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in request_ids:  # an interrupted run must not leave sequences holding blocks
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in request_ids]
