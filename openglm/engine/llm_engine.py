"""LLMEngine: requests in, one scheduled model step at a time, outputs out.

`add_request` tokenizes and queues; `step` schedules, runs the model on the paged cache, samples,
detokenizes, applies stop conditions and returns the outputs of the requests that advanced.
Not thread-safe: the server drives it from a single thread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from openglm.engine.block_manager import BlockManager
from openglm.engine.config import EngineConfig
from openglm.engine.detokenizer import streamable_length, update_text
from openglm.engine.model_runner import ModelRunner
from openglm.engine.outputs import CompletionOutput, RequestOutput
from openglm.engine.sampler import Sampler
from openglm.engine.sampling_params import SamplingParams
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence
from openglm.model.checkpoint import resolve_checkpoint  # a checkpoint, or a run folder's latest one


@dataclass
class EngineStats:
    """A snapshot of the engine's load and counters (the server's metrics read these)."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int  # free blocks still holding a prefix-cache entry
    prefix_hit_blocks: int  # prompt blocks served from the prefix cache (cumulative)
    prefix_query_blocks: int  # prompt blocks looked up (cumulative)
    preemptions: int
    steps: int
    prompt_tokens: int
    generation_tokens: int
    computed_tokens: int


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        model_len = getattr(model.config, "max_position_embeddings", None) or 4096
        pool_len = config.num_kv_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model_len, model_len, pool_len)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, config.session_ttl)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size,
                                  getattr(tokenizer, "pad_id", 0) if tokenizer is not None else 0)
        self.sampler = Sampler(config.seed)
        self.eos_ids = set(getattr(tokenizer, "eos_ids", []) or [])
        self.requests: dict[str, list[Sequence]] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # seq_id -> (chars, tokens) already reported
        self._ids = itertools.count()
        self.counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0}

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        from openglm.engine.tokenizing import EngineTokenizer  # tokenizers + weights: loaded only from a checkpoint
        from openglm.model import load_model

        config = config or EngineConfig()
        path = resolve_checkpoint(path)
        model = load_model(str(path), dtype=getattr(torch, config.dtype))
        if config.quantization:
            from openglm.engine.quant import quantize_model  # optional (--quantization)

            quantize_model(model, config.quantization)
        return cls(model, EngineTokenizer(path), config)

    # ---- what the server reads ------------------------------------------------------------------
    @property
    def model_config(self):
        """The served model's config (vocab_size, max_position_embeddings, ...)."""
        return self.runner.model.config

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting), kv_blocks_used=bm.num_used_blocks,
                           kv_blocks_total=bm.num_blocks, kv_blocks_cached=bm.num_cached_blocks,
                           prefix_hit_blocks=bm.stats["prefix_hits"], prefix_query_blocks=bm.stats["prefix_queries"],
                           preemptions=sched.num_preemptions, **self.counters)

    # ---- requests -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "tokens including the output")
        vocab = getattr(self.model_config, "vocab_size", None)
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [Sequence(ids, params, request_id, index=i) for i in range(params.n)]
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
            self.sent.pop(seq.seq_id, None)
        return True

    def abort_all(self) -> None:
        """Abort every request (after a failed step nothing may hold blocks)."""
        for request_id in list(self.requests):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step. If the batched step raises, the batch is
        re-run one sequence at a time: the sequences that still fail finish with "error" (their
        requests alone), the others advance as if nothing had happened."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        try:
            ready, failed = self._run(batch.seqs, batch.num_tokens)
        except Exception:  # noqa: BLE001 - find the sequence(s) at fault instead of failing the batch
            ready, failed = self._run_one_by_one(batch.seqs, batch.num_tokens)
        self.counters["steps"] += 1
        self.counters["computed_tokens"] += batch.total_tokens
        outputs = [self._fail(rid, why) for rid, why in failed.items() if rid in self.requests]
        touched = dict.fromkeys(s.request_id for s in ready if s.request_id not in failed)
        return outputs + [self._output(rid) for rid in touched if rid in self.requests]

    def _run(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[Sequence], dict[str, str]]:
        """One model call and sampling for `seqs`; state changes only once both succeeded. Returns the
        sequences that got a token and {request id: why} for those whose token could not be applied."""
        logits = self.runner.run(seqs, num_tokens)
        rows = [row for row, (seq, n) in enumerate(zip(seqs, num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]  # all inputs computed: gets a new token
        ready = [seqs[row] for row in rows]
        tokens, logprobs = self.sampler(logits[rows], ready) if ready else ([], [])
        for seq, n in zip(seqs, num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        failed = {}
        for seq, token, lp in zip(ready, tokens, logprobs):
            try:
                self._append(seq, token, lp)
            except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request fails, alone
                failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
        return ready, failed

    def _run_one_by_one(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[Sequence], dict[str, str]]:
        ready, failed = [], {}
        for seq, n in zip(seqs, num_tokens):
            if seq.request_id in failed or seq.is_finished:
                continue
            try:
                got, why = self._run([seq], [n])
                ready += got
                failed.update(why)
            except Exception as exc:  # noqa: BLE001 - this sequence's request fails, alone
                failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
        return ready, failed

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        """Finish a request with "error" (all its choices) and free its blocks."""
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
        out = self._output(request_id)
        out.error = why
        return out

    def _append(self, seq: Sequence, token: int, logprob: dict | None) -> None:
        if seq.num_output_tokens == 0:
            self.counters["prompt_tokens"] += seq.num_prompt_tokens
        seq.append_token(token)
        self.counters["generation_tokens"] += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        reason = None
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif may_stop and token in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        if self.tokenizer is not None and update_text(seq, self.tokenizer.decode) and reason is None:
            reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        outs = []
        for seq in seqs:
            chars, toks = self.sent.get(seq.seq_id, (0, 0))
            n_chars = streamable_length(seq)
            out_ids = seq.output_token_ids
            outs.append(CompletionOutput(
                index=seq.index, text=seq.output_text, token_ids=out_ids, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                delta_text=seq.output_text[chars:n_chars], delta_token_ids=out_ids[toks:],
                delta_logprobs=seq.logprobs[toks:]))
            self.sent[seq.seq_id] = (max(chars, n_chars), len(out_ids))
        finished = all(s.is_finished for s in seqs)
        first = [s.first_token_time for s in seqs if s.first_token_time is not None]
        out = RequestOutput(request_id, seqs[0].token_ids[: seqs[0].num_prompt_tokens], outs, finished,
                            num_cached_tokens=seqs[0].num_cached_prompt_tokens,
                            metrics={"arrival_time": seqs[0].arrival_time,
                                     "first_token_time": min(first) if first else None,
                                     "finished_time": time.monotonic() if finished else None})
        if finished:
            self.requests.pop(request_id)
            for s in seqs:
                self.sent.pop(s.seq_id, None)
        return out
