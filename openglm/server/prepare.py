"""Preparing a request where it cannot stall the server: rendering the chat template, tokenising a prompt and
compiling an output grammar run in worker processes (`server/prepare_worker.py`), each job within a budget.

Why processes: a checkpoint's chat template and a request's JSON schema are the input of strangers, and the work
they ask for is not bounded by the request's size (a template can loop 10^10 times, a schema of 10,000 optional
properties compiles for half a minute). A thread cannot be stopped and shares the GIL with the event loop and the
engine thread; a process can be interrupted (a template: a timer in the worker stops its render, and a worker
that does not answer in time is killed), is capped in memory (a 300 MB render or a tokeniser abort ends a worker,
not the server), and burns its own CPU. The server process never tokenises a string a client sent.

What it costs: a job is a message to a warm worker and one back (JSON, token ids as a binary array): a fraction
of a millisecond next to the render and tokenisation themselves (benchmarks/bench_abuse.py measures it). A new
grammar is compiled once in a worker (the budget) and then, within that bound, once more in a server thread
(at low CPU priority) that keeps the compiled grammar for every sequence that uses it (`GrammarEngine.compile`);
grammars that passed are remembered.

Slow jobs cannot take the places of quick ones. `prepare_workers` workers take jobs; a job still running after
SLOW_S (a chat renders and tokenises in milliseconds: a slow job is a template that loops, a schema that
compiles for seconds, a very long prompt) drops its worker to a low CPU priority, so that the engine thread and
the quick jobs get the cores first, and a spare worker (about 25 MB, a tenth of a second to start) is started in
its place, up to SPARES_PER_WORKER per worker; a worker that ran a slow job leaves the pool after it (its
priority cannot be raised again without privileges). Only when more slow jobs run at once than there are
workers and spares do others wait their turn (each for at most its budget). A client that disconnects frees its
worker: a render is interrupted (SIGUSR1), a grammar's worker is killed; a worker that does not answer in time
is killed and another started.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection

from openglm.server.limits import ServerLimits
from openglm.util import proc

log = logging.getLogger("openglm.server")

TEXT_DEADLINE_S = 60.0  # a tokenisation job (bounded by the text's size) that has not answered by now is killed
CANCEL_GRACE_S = 1.0  # a cancelled render that has not stopped after this is killed
START_TIMEOUT_S = 120.0
POLL_S = 0.05  # how often a waiting thread looks at the deadline and for a cancel (an answer ends the wait at once)
DISCONNECT_POLL_S = 0.5
REMEMBERED_GRAMMARS = 256
SLOW_S = 0.2  # a job still running after this is slow (a chat renders and tokenises in milliseconds)
SLOW_NICE = 10  # the CPU priority a slow job's worker drops to (and the server's own grammar compiles run at)
SPARES_PER_WORKER = 2  # spare workers at most, per prepare worker, standing in for workers busy with slow jobs
# the worker's environment: what Python and the Rust libraries need, nothing of the server's (API keys)
PASSED_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LANG", "LC_ALL", "TMPDIR")


def _lower_priority() -> None:
    """Drop the calling thread to SLOW_NICE (Linux: a thread's own nice value; anyone may lower their priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SLOW_NICE)
    except OSError:
        pass


class PrepareError(ValueError):
    """A job refused (over a limit, bad input) or failed: the request's 400. `code`: the OpenAI error code."""

    def __init__(self, message: str, code: str | None = None, cancelled: bool = False):
        super().__init__(message)
        self.code, self.cancelled = code, cancelled


class _Worker:
    """One worker process; jobs go to its stdin and answers come from its stdout (framed messages)."""

    def __init__(self, init: bytes):
        env = {k: v for k, v in os.environ.items() if k in PASSED_ENV}
        env |= {"MALLOC_ARENA_MAX": "2", "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = proc.spawn([sys.executable, "-m", "openglm.server.prepare_worker", str(os.getpid())], env=env,
                               stdin=proc.PIPE, stdout=proc.PIPE)
        self.jobs = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.conn = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        try:
            self.send(init)
            if not self.conn.poll(START_TIMEOUT_S):
                raise EOFError
            self.conn.recv_bytes()  # {"ready": true}
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(f"a prepare worker did not start (exit code {self.proc.returncode})") from None

    def send(self, message: bytes) -> None:
        self.jobs.send_bytes(message)

    def kill(self) -> None:
        proc.kill_group(self.proc.pid)
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        self._close_pipes()  # the worker ends at the end of its input
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.kill()

    def _close_pipes(self) -> None:
        self.jobs.close()
        self.conn.close()


class PrepareWorkers:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, limits: ServerLimits):
        self.limits = limits
        self.init = json.dumps({
            "tokenizer": tokenizer.hf.to_str(), "chat_template": tokenizer.chat_template,
            "eos_token": tokenizer.eos_token, "config": tokenizer.config,
            "model_max_length": tokenizer.model_max_length,
            "vocab_size": vocab_size, "max_model_len": max_model_len,
            "template_timeout_s": limits.template_timeout_s}).encode()
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.max_spares = SPARES_PER_WORKER * limits.prepare_workers
        self.threads = concurrent.futures.ThreadPoolExecutor(limits.prepare_workers + self.max_spares,
                                                             "openglm-prepare")
        # workers are started in this thread: a worker dies with the thread that started it (PR_SET_PDEATHSIG is the
        # thread's, not the process's), so never in a short-lived one
        self.starter = concurrent.futures.ThreadPoolExecutor(1, "openglm-prepare-start")
        # the server's own compile of a grammar that passed (llguidance releases the GIL), at low CPU priority
        self.compilers = concurrent.futures.ThreadPoolExecutor(limits.prepare_workers, "openglm-grammar",
                                                               initializer=_lower_priority)
        self.grammars: OrderedDict[str, None] = OrderedDict()  # grammars that compiled within the budget
        self.restarts = 0  # workers killed (over time, crashed, a cancelled grammar) and started anew
        self.spares = 0  # spares standing in for workers busy with slow jobs
        self.closed = False
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def start(self) -> "PrepareWorkers":
        for _ in range(self.limits.prepare_workers):
            self._keep(self.starter.submit(_Worker, self.init).result())
        return self

    def close(self) -> None:
        with self._lock:
            self.closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.close()
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.starter.shutdown(wait=False, cancel_futures=True)
        self.compilers.shutdown(wait=False, cancel_futures=True)

    # ---- jobs (from the event loop) ------------------------------------------------------------------
    async def chat(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict,
                   is_disconnected=None) -> list[int]:
        job = {"job": "chat", "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
               "kwargs": kwargs}
        return await self._run(job, self.limits.template_timeout_s + TEXT_DEADLINE_S, False, is_disconnected)

    async def text(self, text: str, is_disconnected=None) -> list[int]:
        return await self._run({"job": "text", "text": text}, TEXT_DEADLINE_S, False, is_disconnected)

    async def grammar(self, grammar: str, is_disconnected=None) -> None:
        """Refuse (PrepareError) a grammar that does not compile, or not within the budget."""
        if grammar in self.grammars:
            self.grammars.move_to_end(grammar)
            return
        await self._run({"job": "grammar", "grammar": grammar}, self.limits.grammar_timeout_s, True, is_disconnected)
        self.grammars[grammar] = None
        while len(self.grammars) > REMEMBERED_GRAMMARS:
            self.grammars.popitem(last=False)

    async def at_low_priority(self, fn, *args):
        """`fn(*args)` in a server thread at low CPU priority (the compile of a grammar that passed its check)."""
        return await asyncio.get_running_loop().run_in_executor(self.compilers, fn, *args)

    async def _run(self, job: dict, deadline_s: float, kill_on_cancel: bool, is_disconnected):
        cancel = threading.Event()
        payload = json.dumps(job, ensure_ascii=False).encode()
        future = asyncio.get_running_loop().run_in_executor(self.threads, self._call, job["job"], payload,
                                                            deadline_s, kill_on_cancel, cancel)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if is_disconnected is not None and await is_disconnected():
                    cancel.set()
        except asyncio.CancelledError:
            cancel.set()
            raise

    # ---- one job (in a thread of the pool) -----------------------------------------------------------
    def _call(self, kind: str, payload: bytes, deadline_s: float, kill_on_cancel: bool, cancel: threading.Event):
        worker = self.idle.get()
        started, slow, spare, alive = time.monotonic(), False, False, True
        try:
            worker.send(payload)
            deadline, interrupted = started + deadline_s, False
            while not worker.conn.poll(POLL_S):
                now = time.monotonic()
                if not slow and now - started > SLOW_S:
                    slow, spare = True, self._slowed(worker)
                if cancel.is_set() and not interrupted:
                    if kill_on_cancel:
                        alive = self._kill(worker)
                        raise PrepareError("the client disconnected", cancelled=True)
                    os.kill(worker.proc.pid, signal.SIGUSR1)
                    interrupted, deadline = True, min(deadline, now + CANCEL_GRACE_S)
                if now > deadline:
                    alive = self._kill(worker)
                    raise PrepareError(self._over_time(kind, deadline_s, interrupted), cancelled=interrupted)
            reply = json.loads(worker.conn.recv_bytes())
            if "error" in reply:
                raise PrepareError(reply["error"], reply.get("code"), cancelled=reply.get("kind") == "cancelled")
            return array.array("i", worker.conn.recv_bytes()).tolist() if kind != "grammar" else None
        except (EOFError, OSError):  # the worker died in the job: over its memory cap (an abort), or killed
            alive = self._kill(worker)
            raise PrepareError(f"preparing the request stopped its worker process ({self._what(kind)} went over the "
                               f"worker's memory limit or crashed it)") from None
        finally:
            self._release(worker, alive and not slow, spare)

    @staticmethod
    def _what(kind: str) -> str:
        return {"chat": "rendering the chat template", "text": "tokenising the prompt",
                "grammar": "compiling the output constraint"}[kind]

    def _over_time(self, kind: str, deadline_s: float, interrupted: bool) -> str:
        if interrupted:
            return "the client disconnected"
        if kind == "grammar":
            return f"the output constraint did not compile within its limit of {deadline_s:g} s"
        return f"{self._what(kind)} did not finish within {deadline_s:g} s"

    # ---- the pool ----------------------------------------------------------------------------------
    def _slowed(self, worker: _Worker) -> bool:
        """A job has run past SLOW_S: its worker drops to a low CPU priority (the engine and quick jobs come first)
        and, while there are fewer than `max_spares`, a spare is started in its place; whether one was."""
        try:
            os.setpriority(os.PRIO_PROCESS, worker.proc.pid, SLOW_NICE)
        except OSError:  # it has just exited
            pass
        with self._lock:
            if self.closed or self.spares >= self.max_spares:
                return False
            self.spares += 1
        self._start_later()
        return True

    def _kill(self, worker: _Worker) -> bool:
        worker.kill()
        self.restarts += 1
        log.warning("openglm: killed a prepare worker (%d so far)", self.restarts)
        return False

    def _release(self, worker: _Worker, reusable: bool, spare: bool) -> None:
        """After a job: a worker that answered in time goes back to the pool; one that was slow (its priority is
        lowered for good) or killed leaves it, and a new one takes its place unless a spare already has."""
        if reusable and not self.closed:
            self.idle.put(worker)
            return
        worker.close()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            if spare:
                self.spares -= 1
        if not spare and not self.closed:
            self._start_later()

    def _start_later(self) -> None:
        try:
            self.starter.submit(self._start_worker)
        except RuntimeError:  # shutting down
            pass

    def _start_worker(self) -> None:
        try:
            worker = _Worker(self.init)
        except RuntimeError as exc:  # the pool goes on with one worker fewer
            log.error("openglm: %s", exc)
            return
        with self._lock:
            closed = self.closed
        if closed:
            worker.close()
        else:
            self._keep(worker)

    def _keep(self, worker: _Worker) -> None:
        with self._lock:
            self._all.append(worker)
        self.idle.put(worker)
