"""The child side of the server's prepare workers (`server/prepare.py`): one process that renders chat templates,
tokenises prompts and compiles output grammars, a job at a time, each within a budget.

Started as `python -m openglm.server.prepare_worker PARENT_PID` with a scrubbed environment (no API key), it
reads an init message (the tokenizer, the context size, the budgets) and then jobs from its stdin, and answers
each on its stdout in one message (token ids follow as a second, binary one); anything else printed goes to
stderr. It dies with its parent (PR_SET_PDEATHSIG, and at the end of its input). Its address space is capped once
it is set up: a template or a prompt that needs more memory fails here, as a MemoryError, or as an abort inside
Rust code, which the parent answers with a 400 and a new worker. A chat job's renders are interrupted by SIGALRM
when the template's seconds run out (a loop that calls nothing is stopped too) and by SIGUSR1 when the client
has left.

Prompts that cannot fit are refused before they are tokenised in full: first by a bound that costs nothing (a
text of c characters has at least c / longest-token-length tokens), then, for a long text, by counting its
tokens a window at a time and stopping as soon as the count is over the context (memory: one window).
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection

from openglm.tokenizer import RenderBudget, TemplateLimitError, Tokenizer, TokenizerError

WINDOW_CHARS = 1 << 16  # a long text is counted this many characters at a time
MEMORY_FLOOR = 1 << 30  # address space a worker may add to what it holds after setting up, at least
PR_SET_PDEATHSIG = 1


class Cancelled(BaseException):
    """The client left: the parent interrupted this job (a BaseException, so that no `except Exception` on the way
    out of the template takes it for the template's own error)."""


class Refused(TemplateLimitError):
    """A job's input is over a limit: the message names it; `code` is the OpenAI error code."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class Worker:
    def __init__(self, init: dict):
        from tokenizers import Tokenizer as HFTokenizer  # Rust tokenizers: the worker's one heavy import

        self.tokenizer = Tokenizer(HFTokenizer.from_str(init["tokenizer"]), model_max_length=init["model_max_length"],
                                   chat_template=init["chat_template"], eos_token=init["eos_token"],
                                   config=init["config"])
        self.vocab_size, self.max_model_len = init["vocab_size"], init["max_model_len"]
        self.template_seconds = init["template_timeout_s"]
        self.max_chars = self.max_model_len * self.tokenizer.max_token_chars
        self._grammar = None
        self.rendering = False

    # ---- prompts -----------------------------------------------------------------------------------
    def too_long(self, text: str) -> Refused:
        return Refused(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                       f"{len(text)} characters, more than that many tokens", code="context_length_exceeded")

    def admit(self, text: str) -> None:
        """Refuse a text that cannot fit, without tokenising it whole."""
        if len(text) > self.max_chars:  # more characters than max_model_len tokens can stand for
            raise self.too_long(text)
        if len(text) <= WINDOW_CHARS:
            return
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + WINDOW_CHARS)
            if end < len(text):  # cut at a space where there is one: a cut changes a word's tokens, not many
                space = text.rfind(" ", start + WINDOW_CHARS // 2, end)
                end, cuts = (space if space > start else end), cuts + 1
            count += len(self.tokenizer.encode(text[start:end]))
            if count > self.max_model_len + 8 * cuts:  # over the context even if every cut added tokens
                raise self.too_long(text)
            start = end

    def text(self, job: dict) -> list[int]:
        text = job["text"]
        self.admit(text)
        return self.tokenizer.encode(text)

    def chat(self, job: dict) -> list[int]:
        budget = WorkerBudget(self)
        return self.tokenizer.apply_chat_template(job["messages"], tools=job["tools"],
                                                  add_generation_prompt=job["add_generation_prompt"], tokenize=True,
                                                  budget=budget, **job["kwargs"])

    # ---- grammars ----------------------------------------------------------------------------------
    def grammar(self, job: dict) -> None:
        from openglm.engine.grammar import GrammarEngine, GrammarError  # llguidance: only once a grammar comes

        if self._grammar is None:
            self._grammar = GrammarEngine(self.tokenizer, self.vocab_size)
        try:
            self._grammar.compile(job["grammar"])  # all the work the server will do with it
        except GrammarError as exc:
            raise Refused(str(exc)) from None

    # ---- the loop ----------------------------------------------------------------------------------
    def answer(self, job: dict) -> tuple[dict, bytes | None]:
        try:
            if job["job"] == "grammar":
                self.grammar(job)
                return {"ok": True}, None
            ids = self.chat(job) if job["job"] == "chat" else self.text(job)
            return {"ok": True}, array.array("i", ids).tobytes()
        except Cancelled:
            return {"error": "the client disconnected", "kind": "cancelled"}, None
        except Refused as exc:
            return {"error": str(exc), "kind": "limit", "code": exc.code}, None
        except TemplateLimitError as exc:
            return {"error": str(exc), "kind": "limit"}, None
        except TokenizerError as exc:
            return {"error": str(exc), "kind": "input"}, None
        except MemoryError:
            return {"error": "preparing the request went over the worker's memory limit", "kind": "limit"}, None


class WorkerBudget(RenderBudget):
    """The render budget with a timer: SIGALRM when the request's template seconds are used up."""

    def __init__(self, worker: Worker):
        super().__init__(seconds=worker.template_seconds, max_chars=worker.max_chars)
        self.worker = worker

    def admit(self, text: str) -> None:
        self.worker.admit(text)

    def too_large(self, what: str) -> TemplateLimitError:
        if what == "an output":  # the rendered conversation is longer than any prompt the model can take
            return Refused(f"this model's maximum context length is {self.worker.max_model_len} tokens; the rendered "
                           f"conversation has more than {self.max_chars} characters, more than that many tokens",
                           code="context_length_exceeded")
        return super().too_large(what)

    def start(self) -> None:
        super().start()
        self.worker.rendering = True
        signal.setitimer(signal.ITIMER_REAL, max(self.seconds - self.used, 1e-3))

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.worker.rendering = False
        super().stop()


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the end of the socket still ends the worker
        pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _cap_memory(floor: int) -> None:
    """Cap the address space at what the worker holds now plus `floor`: its jobs' memory is bounded."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + floor, size + floor))


def main(parent: int) -> None:
    _die_with_parent(parent)
    jobs, answers = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a stray print cannot corrupt the answers
    worker = Worker(json.loads(jobs.recv_bytes()))

    def on_alarm(signum, frame):
        if worker.rendering:
            raise TemplateLimitError(f"the chat template ran longer than its limit of {worker.template_seconds:g} s")

    def on_cancel(signum, frame):
        if worker.rendering:
            raise Cancelled()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGUSR1, on_cancel)
    _cap_memory(max(MEMORY_FLOOR, 64 * worker.max_chars))
    answers.send_bytes(b'{"ready": true}')
    while True:
        try:
            job = json.loads(jobs.recv_bytes())
        except (EOFError, OSError):  # the server has gone
            return
        reply, ids = worker.answer(job)
        answers.send_bytes(json.dumps(reply).encode())
        if ids is not None:
            answers.send_bytes(ids)


if __name__ == "__main__":
    main(int(sys.argv[1]))
