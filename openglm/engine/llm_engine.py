"""LLMEngine: requests in, one scheduled model step at a time, outputs out.

`add_request` checks the prompt and queues one Sequence per choice. `step` is schedule -> run ->
postprocess: the scheduler picks the batch (`scheduler.py`), the model runner computes it and the sampler
draws each finished row's token (`model_runner.py`, `sampler.py`; with MTP drafts on, `speculative.py`
verifies them instead), and the postprocessor appends the tokens through the stop checks
(`postprocess.py`). Not thread-safe: the server drives it from a single thread (`check_prompt` alone
reads nothing that changes, so any thread may call it).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from openglm.engine.block_manager import BlockManager
from openglm.engine.config import EngineConfig, resolve_device
from openglm.engine.grammar import GrammarEngine
from openglm.engine.model_runner import ModelRunner
from openglm.engine.outputs import EngineStats, RequestOutput
from openglm.engine.postprocess import Postprocessor, RowResult, request_output
from openglm.engine.sampler import Sampler
from openglm.engine.sampling_params import SamplingParams
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence
from openglm.engine.speculative import SpeculativeDecoder
from openglm.engine.state_cache import StateSlots, hybrid_engine_config
from openglm.engine.thinking import ThinkingBudget
from openglm.model.checkpoint import resolve_checkpoint  # a checkpoint, or a run folder's latest one
from openglm.tokenizer import Tokenizer
from openglm.util.threads import ThreadGovernor


class PromptError(ValueError):
    """A prompt the engine cannot take: empty, a token id outside the vocabulary, or no room left for output.
    `code` is the OpenAI error code where one applies (the server answers 400 with it)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 runner: ModelRunner | None = None):  # runner: e.g. tensor-parallel rank 0's, which broadcasts
        # a hybrid model (linear-attention state per sequence): no prefix caching; `notes` say what changed
        config, self.notes = hybrid_engine_config(model, config or EngineConfig())
        self.config = config
        self.tokenizer = tokenizer
        device = resolve_device(config.device)
        if next(model.parameters()).device != device:  # the runner allocates its KV pool where the model is
            model = model.to(device)
        model_len = getattr(model.config, "max_position_embeddings", None) or 4096
        pool_len = config.num_kv_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model_len, model_len, pool_len)
        self.vocab_size: int = model.config.vocab_size
        self.counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0,
                         "draft_tokens": 0, "accepted_draft_tokens": 0}
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, config.session_ttl)
        self.runner = runner or ModelRunner(model, config.num_kv_blocks, config.block_size,
                                            getattr(tokenizer, "pad_id", 0) if tokenizer is not None else 0,
                                            num_state_slots=config.max_num_seqs)
        states = getattr(self.runner, "states", None)
        self.scheduler = Scheduler(config, self.block_manager, None if states is None else StateSlots(states.num_slots))
        self.sampler = Sampler(config.seed)
        self.postprocess = Postprocessor(self.scheduler, tokenizer, self.max_model_len, self.counters)
        self.speculator = None if not config.num_speculative_tokens else SpeculativeDecoder(
            self.runner, self.sampler, self.block_manager, config.num_speculative_tokens, self.max_model_len,
            self.counters)
        self._grammar: GrammarEngine | None = None
        # CPU threads follow the cores other processes leave free (util/threads.py), polled from the thread that steps
        self.threads = ThreadGovernor.for_torch() if device.type == "cpu" else None
        self.thinking = ThinkingBudget(tokenizer.decode if tokenizer is not None else lambda ids: "")
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None,
                        tokenizer: str | Path | None = None) -> "LLMEngine":
        """The engine of a checkpoint folder (or a run folder's latest checkpoint); `tokenizer`: another folder to
        read the tokenizer from (a checkpoint saved without one)."""
        from openglm.model import load_model  # torch weights: loaded only from a checkpoint

        config = config or EngineConfig()
        path = resolve_checkpoint(path)
        model = load_model(str(path), dtype=getattr(torch, config.dtype), device=str(resolve_device(config.device)))
        if config.quantization:
            from openglm.engine.quant import quantize_model  # optional (--quantization)

            quantize_model(model, config.quantization)
        return cls(model, Tokenizer.from_checkpoint(tokenizer or path), config)

    @property
    def grammar(self) -> GrammarEngine:
        """The constrained-decoding engine for this tokenizer (built on first use)."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: constrained decoding needs one")
            self._grammar = GrammarEngine(self.tokenizer, self.vocab_size)
        return self._grammar

    # ---- what the server reads ------------------------------------------------------------------
    @property
    def model_config(self):
        """The served model's config (vocab_size, max_position_embeddings, ...)."""
        return self.runner.model.config

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(running=len(sched.running), waiting=sched.num_waiting, kv_blocks_used=bm.num_used_blocks,
                           kv_blocks_total=bm.num_blocks, kv_blocks_cached=bm.num_cached_blocks,
                           prefix_hit_blocks=bm.stats["prefix_hits"], prefix_query_blocks=bm.stats["prefix_queries"],
                           preemptions=sched.num_preemptions, **self.counters)

    # ---- requests -----------------------------------------------------------------------------
    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, or PromptError naming what is wrong: the one check of a prompt."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            if len(prompt) > self.max_model_len * self.tokenizer.max_token_chars:  # refused before tokenising
                raise PromptError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                  f"has {len(prompt)} characters, more than that many tokens",
                                  code="context_length_exceeded")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise PromptError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                              f"{len(ids)} tokens, leaving no room for output", code="context_length_exceeded")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, group: str | None = None) -> str:
        """Queue a request; `group` names the client request it belongs to (the scheduler shares the batch fairly
        between groups; default: the request itself)."""
        params = params or SamplingParams()
        ids = self.check_prompt(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [Sequence(ids, params, request_id, index=i, group=group) for i in range(params.n)]
        if params.grammar is not None:
            for seq in seqs:
                seq.matcher = self.grammar.matcher(params.grammar)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and return its blocks to the pool. False if it is unknown or done."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def abort_all(self) -> None:
        """Abort every request (after a failed step nothing may hold blocks)."""
        for request_id in list(self.requests):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step (by several tokens where MTP drafts are accepted)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if self.threads is not None:
            self.threads.poll()
        results, failed = self._run_isolated(batch.seqs, batch.num_tokens)
        failed |= self.postprocess(results)
        if self.speculator is not None:
            self.speculator.propose(results)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += batch.total_tokens
        return self._outputs(results, failed)

    def _run_isolated(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[RowResult], dict[str, str]]:
        """`_run`; if the batched run raises, the batch is run again one sequence at a time: the sequences that
        still fail are reported in {request id: why} (their requests alone fail), the others go on."""
        try:
            return self._run(seqs, num_tokens), {}
        except Exception:  # noqa: BLE001 - find the sequence(s) at fault instead of failing the batch
            pass
        results, failed = [], {}
        for seq, n in zip(seqs, num_tokens):
            if seq.request_id in failed:
                continue
            try:
                results += self._run([seq], [n])
            except Exception as exc:  # noqa: BLE001 - this sequence's request fails, alone
                failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
        return results, failed

    def _run(self, seqs: list[Sequence], num_tokens: list[int]) -> list[RowResult]:
        """One model call and the sampling of every row whose inputs are then all computed. Changes no state,
        so a failed run can be repeated."""
        if self.speculator is not None:
            return self.speculator.run(seqs, num_tokens, self._sample)
        logits = self.runner.run(seqs, num_tokens)
        ready = [row for row, (seq, n) in enumerate(zip(seqs, num_tokens))
                 if seq.num_computed_tokens + n == seq.num_tokens]
        tokens, logprobs = self._sample(logits[ready], [seqs[row] for row in ready]) if ready else ([], [])
        new = {row: ([token], [lp]) for row, token, lp in zip(ready, tokens, logprobs)}
        return [RowResult(seq, n, *new.get(row, ([], []))) for row, (seq, n) in enumerate(zip(seqs, num_tokens))]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        if any(s.matcher is not None for s in seqs):  # constrained rows only; the others are untouched
            self.grammar.apply_masks(logits, seqs)
        if any(s.params.thinking_budget is not None for s in seqs):  # after the masks: it forces what they allow
            self.thinking.apply(logits, seqs)
        return self.sampler(logits, seqs)

    def _outputs(self, results: list[RowResult], failed: dict[str, str]) -> list[RequestOutput]:
        """The failed requests (finished with "error") first, then every request with a new token."""
        failed = {request_id: why for request_id, why in failed.items() if request_id in self.requests}
        for request_id in failed:
            for seq in self.requests[request_id]:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error")
        advanced = dict.fromkeys(r.seq.request_id for r in results if r.tokens and r.seq.request_id not in failed)
        return ([self._output(request_id, why) for request_id, why in failed.items()]
                + [self._output(request_id) for request_id in advanced if request_id in self.requests])

    def _output(self, request_id: str, error: str | None = None) -> RequestOutput:
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        out = request_output(request_id, self.requests[request_id], error, decode)
        if out.finished:
            del self.requests[request_id]
        return out
