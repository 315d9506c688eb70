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
from openglm.engine.grammar import GrammarEngine
from openglm.engine.model_runner import MTPInputs, ModelRunner
from openglm.engine.outputs import CompletionOutput, RequestOutput
from openglm.engine.sampler import Sampler
from openglm.engine.sampling_params import SamplingParams
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence
from openglm.engine.speculative import accept_greedy, accept_sampled, drafts_allowed
from openglm.tokenizer import Tokenizer
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
    draft_tokens: int = 0  # MTP drafts verified (speculative decoding; cumulative)
    accepted_draft_tokens: int = 0  # of those, accepted


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
        if config.num_speculative_tokens and not len(getattr(getattr(model, "model", None), "mtp_layers", ())):
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with a next-n (MTP) layer "
                             "(config num_nextn_predict_layers >= 1); this one has none")
        self.eos_ids = set(getattr(tokenizer, "eos_ids", []) or [])
        self._grammar: GrammarEngine | None = None
        self.requests: dict[str, list[Sequence]] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # seq_id -> (chars, tokens) already reported
        self._ids = itertools.count()
        self.counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0,
                         "draft_tokens": 0, "accepted_draft_tokens": 0}

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> "LLMEngine":
        from openglm.model import load_model  # torch weights: loaded only from a checkpoint

        config = config or EngineConfig()
        path = resolve_checkpoint(path)
        model = load_model(str(path), dtype=getattr(torch, config.dtype))
        if config.quantization:
            from openglm.engine.quant import quantize_model  # optional (--quantization)

            quantize_model(model, config.quantization)
        return cls(model, Tokenizer.from_checkpoint(path), config)

    @property
    def grammar(self) -> GrammarEngine:
        """The constrained-decoding engine for this tokenizer (built on first use)."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: constrained decoding needs one")
            vocab = getattr(self.runner.model.config, "vocab_size", None) or self.tokenizer.vocab_size
            self._grammar = GrammarEngine(self.tokenizer, vocab)
        return self._grammar

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
        if self.config.num_speculative_tokens:
            return self._run_speculative(seqs, num_tokens)
        logits = self.runner.run(seqs, num_tokens)
        rows = [row for row, (seq, n) in enumerate(zip(seqs, num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]  # all inputs computed: gets a new token
        ready = [seqs[row] for row in rows]
        logits = logits[rows]
        if any(s.matcher is not None for s in ready):  # constrained rows only; the others are untouched
            self.grammar.apply_masks(logits, ready)
        tokens, logprobs = self.sampler(logits, ready) if ready else ([], [])
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

    # ---- speculative decoding (engine/speculative.py) -------------------------------------------------
    def _run_speculative(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[Sequence], dict[str, str]]:
        """`_run` with MTP drafts: each decoding row's drafts are verified in the same forward, the accepted
        ones plus one more token are appended (each through the ordinary stop checks), then the MTP layer
        proposes the next drafts. Rows without drafts are sampled exactly as `_run` samples them."""
        logits, hidden = self.runner.run_verify(seqs, num_tokens)
        rows = [row for row, (seq, n) in enumerate(zip(seqs, num_tokens)) if seq.num_computed_tokens + n >= seq.num_tokens]
        plain = [row for row in rows if not seqs[row].draft_token_ids]
        new: dict[int, tuple[list[int], list]] = {}
        if plain:
            last = torch.stack([logits[row][-1] for row in plain])
            ready = [seqs[row] for row in plain]
            if any(s.matcher is not None for s in ready):
                self.grammar.apply_masks(last, ready)
            tokens, logprobs = self.sampler(last, ready)
            new.update({row: ([t], [lp]) for row, t, lp in zip(plain, tokens, logprobs)})
        for row in rows:
            if row not in new:
                tokens = self._verify(seqs[row], logits[row])
                new[row] = (tokens, [None] * len(tokens))
                self.counters["draft_tokens"] += len(seqs[row].draft_token_ids)
                self.counters["accepted_draft_tokens"] += len(tokens) - 1
        kept = []
        for row, (seq, n) in enumerate(zip(seqs, num_tokens)):
            keep = len(new[row][0]) if row in new and seq.draft_token_ids else n  # rejected drafts' KV is overwritten later
            seq.num_computed_tokens += keep
            seq.set_drafts([])
            self.block_manager.commit(seq)
            kept.append(keep)
        failed = {}
        for row in rows:
            seq = seqs[row]
            for token, lp in zip(*new[row]):
                if seq.is_finished:
                    break
                try:
                    self._append(seq, token, lp)
                except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request fails, alone
                    failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
                    break
        try:
            self._propose(seqs, kept, hidden)
        except Exception:  # noqa: BLE001 - drafts only speed decoding up: without them the next step decodes one token
            for seq in seqs:
                seq.set_drafts([])
        return [seqs[row] for row in rows], failed

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        if seq.params.greedy:
            return accept_greedy(seq.draft_token_ids, logits)
        target = self.sampler.probs(logits, [seq] * len(logits))
        return accept_sampled(seq.draft_token_ids, seq.draft_probs, target, self.sampler.generator_for(seq))

    def _may_draft(self, seq: Sequence) -> bool:
        """Drafts are verified without the sampler's per-token state, so rows that need it decode plainly."""
        p = seq.params
        return (not seq.is_finished and seq.matcher is None and p.logprobs is None and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty)

    def _propose(self, seqs: list[Sequence], kept: list[int], hidden: list[torch.Tensor]) -> None:
        """Run the MTP layer over every position the main model just kept (its KV stays in step with the
        main model's), then chain it on its own output for up to k drafts per decoding sequence."""
        todo = [(seq, keep, h) for seq, keep, h in zip(seqs, kept, hidden) if self._may_draft(seq)]
        if not todo:
            return
        rows = [MTPInputs(list(seq.block_table), seq.num_computed_tokens - keep,
                          seq.token_ids[seq.num_computed_tokens - keep + 1 : seq.num_computed_tokens + 1], h[:keep])
                for seq, keep, h in todo]
        logits, x = self.runner.run_mtp(rows)
        k = self.config.num_speculative_tokens
        active = []
        for i, (seq, _, _) in enumerate(todo):
            n = drafts_allowed(k, seq.num_tokens, seq.num_output_tokens, seq.params.max_tokens, self.max_model_len)
            if seq.num_uncomputed_tokens != 1 or n == 0:
                continue  # mid-prefill: this call only filled the MTP layer's KV
            if n > 1 and self.block_manager.can_append(seq, n):
                self.block_manager.append(seq, n)  # chained drafts write MTP KV past the last token
            else:
                n = 1
            active.append((i, seq, n))
        drafts: dict[int, list] = {i: [] for i, _, _ in active}
        probs: dict[int, list] = {i: [] for i, _, _ in active}
        row_of = {i: i for i, _, _ in active}  # row of `logits` / `x` holding sequence i's last MTP output
        for depth in range(k):
            live = [(i, seq) for i, seq, n in active if depth < n]
            if not live:
                break
            if depth:  # chain: the layer's own output at the previous position, the draft it just made
                logits, x = self.runner.run_mtp([MTPInputs(list(seq.block_table), seq.num_computed_tokens + depth - 1,
                                                           [drafts[i][-1]], x[row_of[i] : row_of[i] + 1])
                                                 for i, seq in live])
                row_of = {i: j for j, (i, _) in enumerate(live)}
            for i, seq in live:
                row = logits[row_of[i]]
                if seq.params.greedy:
                    drafts[i].append(int(row.argmax()))
                    continue
                q = self.sampler.probs(row[None], [seq])[0]
                drafts[i].append(int(torch.multinomial(q, 1, generator=self.sampler.generator_for(seq))))
                probs[i].append(q)
        for i, seq, _ in active:
            seq.set_drafts(drafts[i], torch.stack(probs[i]) if probs[i] else None)

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
        if seq.matcher is not None and self.grammar.advance(seq, token) and reason is None:
            reason = "stop"  # the grammar is complete (or, never expected, rejected the token)
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
