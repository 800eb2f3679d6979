"""Continuous batching: one thread owns the model and its slotted cache (:mod:`meshtrain.serving.slots`).

Between two decode steps it (1) drops waiting requests that were cancelled or ran out of time, (2)
admits waiting requests into free slots (each one's prefill), (3) ends running requests that were
cancelled (a client that went away) or ran out of time, freeing their slots, then (4) runs one
decode program over the busy slots (several steps of it while nobody waits for a slot) and hands each
running request its tokens. A request leaves its slot at a
stop id, a stop text, its ``max_tokens`` or its slot's end.

The waiting line is bounded (``max_queue``): :meth:`Scheduler.submit` refuses a request past it with
:class:`Overloaded` (the server answers 429 with ``Retry-After``), and every request once :meth:`close`
began (a SIGTERM: the requests already in are finished, then the thread ends).

What a request sees: :class:`Event` s through the ``deliver`` callback it was submitted with (called on
the scheduler's thread), text pieces as they become safe to show (:class:`TextStream`), the last one
with its :class:`Finish`.

Example::

    scheduler = Scheduler(slots, tokenizer.decode, max_queue=32, timeout_s=300)
    scheduler.start()
    ticket = scheduler.submit(Job(prompt_ids=(1, 2, 3), max_tokens=16), deliver=print)
    ...
    scheduler.close(); scheduler.join(60)
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from meshtrain.errors import MeshtrainError
from meshtrain.serving.slots import MAX_STEPS, RowSampling, SamplingRows, Slots

log = logging.getLogger("meshtrain.serve")


class Finish(str, enum.Enum):
    """Why a request ended: ``stop`` (a stop id or text), ``length`` (``max_tokens`` or the slot's end),
    ``timeout`` (past the request timeout), ``cancelled`` (the client went away), ``error`` (the step
    failed: the server log has the traceback)."""

    STOP = "stop"
    LENGTH = "length"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ERROR = "error"


class Overloaded(MeshtrainError):
    """The waiting line is full (``retry_after_s``: when a slot is likely free) or the server is draining."""

    def __init__(self, message: str, retry_after_s: int, draining: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.draining = draining


@dataclasses.dataclass(frozen=True)
class Job:
    """What one request asks for, checked (:mod:`meshtrain.serving.protocol`): the prompt's ids, at most
    ``max_tokens`` new ones, its sampling, the texts and token ids that end it."""

    prompt_ids: Tuple[int, ...]
    max_tokens: int
    sampling: RowSampling = RowSampling()
    stop_texts: Tuple[str, ...] = ()
    stop_ids: FrozenSet[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Event:
    """A piece of a request's output: ``text`` (may be empty), the new ``token_ids`` it came from, and on
    the last event ``finish`` with the count of ``completion_tokens``."""

    text: str
    token_ids: Tuple[int, ...] = ()
    finish: Optional[Finish] = None
    completion_tokens: int = 0


class TextStream:
    """The text of a growing list of token ids, handed out in pieces that will not change: a piece
    holds back a trailing partial UTF-8 character and any tail that could begin a stop text; a stop
    text ends the output before it. ``decode``: ids -> text (the tokenizer's).

    Decoding is incremental (a request's whole text is never decoded again per token): the ids since
    the last committed piece are decoded with the few before them as context, and the new text is what
    that adds to the context's own text (a tokenizer may drop a leading space, or merge bytes, at the
    start of a list of ids: the context makes both decodes start alike)."""

    def __init__(self, decode: Callable, stops: Tuple[str, ...]):
        self.decode, self.stops = decode, tuple(s for s in stops if s)
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        self.ids: List[int] = []
        self.sent = 0
        self.text = ""
        self._start = self._read = 0  # ids[_start:_read]: the context; ids[_read:]: not yet in text
        self._context_text = ""

    def push(self, token: int) -> Tuple[str, bool]:
        """Add ``token``: ``(new text safe to show, whether a stop text appeared)``."""
        self.ids.append(token)
        window = self.decode(self.ids[self._start:])
        if not window.endswith("\ufffd"):  # else a character still missing bytes: wait for them
            self.text += window[len(self._context_text):]
            self._start, self._read = self._read, len(self.ids)
            self._context_text = self.decode(self.ids[self._start:self._read])
        # a stop text that began before what was sent was held back and is found at its end
        since = max(0, self.sent - self.longest_stop)
        hits = [p for p in (self.text.find(s, since) for s in self.stops) if p >= 0]
        if hits:
            return self._take(min(hits)), True
        hold = max([k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])] + [0])
        return self._take(len(self.text) - hold), False

    def rest(self) -> str:
        """What was held back, at the end (no stop text came): a partial character shows as U+FFFD."""
        if self._read < len(self.ids):
            self.text += self.decode(self.ids[self._start:])[len(self._context_text):]
            self._start = self._read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class Ticket:
    """One submitted request: its :class:`Job`, where its events go, its deadline, and its state on the
    scheduler's side. :meth:`cancel` (any thread) asks the scheduler to end it and free its slot."""

    def __init__(self, job: Job, deliver: Callable[[Event], None], deadline: float, decode: Callable, whole: bool):
        self.job, self.deliver, self.deadline, self.whole = job, deliver, deadline, whole
        self.held: List[Event] = []  # a whole response's pieces: handed over at the end, in one event
        self.stream = TextStream(decode, job.stop_texts)
        self.cancelled = threading.Event()
        self.generated = 0
        self.started = time.monotonic()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """The thread that owns ``slots`` (module docstring). ``decode``: ids -> text; ``max_queue``:
    requests that may wait for a slot; ``timeout_s``: how long a request may wait and run."""

    def __init__(self, slots: Slots, decode: Callable, *, max_queue: int, timeout_s: float):
        self.slots, self.decode, self.max_queue, self.timeout_s = slots, decode, max_queue, timeout_s
        n = slots.n
        self._waiting: Deque[Ticket] = deque()
        self._running: Dict[int, Ticket] = {}
        self._last = np.zeros(n, np.int32)
        self._length = np.zeros(n, np.int32)
        self._sampling = SamplingRows.empty(n)
        self._cond = threading.Condition()
        self._closing = False
        self._seconds_per_request = 1.0  # a running mean, for Retry-After
        self.counts = {outcome.value: 0 for outcome in Finish} | {"rejected": 0}
        self._thread = threading.Thread(target=self._loop, name="meshtrain-serve-scheduler", daemon=True)

    # -- the server's side -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, deliver: Callable[[Event], None], whole: bool = False) -> Ticket:
        """Queue ``job``; :class:`Overloaded` when the waiting line is full or the server is draining.
        ``whole``: ``deliver`` gets one event at the end, with all the text and ids (a response that is
        not streamed: one wake-up of the server's event loop per request, not one per token)."""
        with self._cond:
            if self._closing:
                raise Overloaded("the server is shutting down; send the request to another replica", 1, True)
            if len(self._waiting) >= self.max_queue and len(self._running) + len(self._waiting) >= self.slots.n:
                self.counts["rejected"] += 1
                raise Overloaded(f"{len(self._waiting)} requests are waiting for one of {self.slots.n} slots "
                                 f"(serve.max_queue {self.max_queue}); retry later", self.retry_after_s())
            ticket = Ticket(job, deliver, time.monotonic() + self.timeout_s, self.decode, whole)
            self._waiting.append(ticket)
            self._cond.notify()
            return ticket

    def retry_after_s(self) -> int:
        """Whole seconds until a slot is likely free: the mean request time × waiting per slot."""
        per_slot = (len(self._waiting) + 1) / max(self.slots.n, 1)
        return int(min(60, max(1, math.ceil(self._seconds_per_request * per_slot))))

    def status(self) -> Dict[str, object]:
        with self._cond:
            return {"slots": self.slots.n, "running": len(self._running), "waiting": len(self._waiting),
                    "max_queue": self.max_queue, "context": self.slots.context, "closing": self._closing,
                    "finished": dict(self.counts)}

    def close(self) -> None:
        """Refuse new requests; the thread ends once the running and waiting ones are done."""
        with self._cond:
            self._closing = True
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._closing):
                    self._cond.wait()
                if self._closing and not (self._waiting or self._running):
                    return
                admitted = self._take_waiting()
            try:
                if admitted:
                    self._admit(admitted)
                self._end_abandoned()
                if self._running:
                    self._step()
            except Exception:  # noqa: BLE001 - a failed step must not kill the server: its requests fail
                log.exception("the decode step failed; its requests end with an error")
                with self._cond:
                    for slot in list(self._running):
                        self._finish(slot, Finish.ERROR)

    def _take_waiting(self) -> List[Tuple[int, Ticket]]:
        """(under the lock) Waiting tickets for the free slots; cancelled / late ones end here."""
        now, out = time.monotonic(), []
        free = [b for b in range(self.slots.n) if b not in self._running]
        for ticket in list(self._waiting):
            gone = Finish.CANCELLED if ticket.cancelled.is_set() else Finish.TIMEOUT if now > ticket.deadline else None
            if gone is not None:
                self._waiting.remove(ticket)
                self._end(ticket, gone)
        while free and self._waiting:
            slot = free.pop(0)
            ticket = self._waiting.popleft()
            self._running[slot] = ticket
            out.append((slot, ticket))
        return out

    def _admit(self, admitted: List[Tuple[int, Ticket]]) -> None:
        """The prefill of every request that just took a slot (together: :meth:`Slots.admit_many`)."""
        tokens, _ = self.slots.admit_many([(slot, t.job.prompt_ids, t.job.sampling) for slot, t in admitted])
        for (slot, ticket), token in zip(admitted, tokens):
            self._length[slot] = len(ticket.job.prompt_ids)
            self._sampling.set(slot, ticket.job.sampling, step=1)
            self._take_token(slot, token)

    def _end_abandoned(self) -> None:
        now = time.monotonic()
        for slot, ticket in list(self._running.items()):
            if ticket.cancelled.is_set():
                self._finish(slot, Finish.CANCELLED)
            elif now > ticket.deadline:
                self._finish(slot, Finish.TIMEOUT)

    def _step(self) -> None:
        """One decode program: several steps (up to :data:`MAX_STEPS`) while nobody waits for a free slot
        (a waiting request joins between programs), as many as every running row may still take, so no
        row runs past its ``max_tokens`` or its slot's end; else one step."""
        with self._cond:
            someone_waits = bool(self._waiting) and len(self._running) < self.slots.n
        steps = 1
        if not someone_waits:
            room = min(min(t.job.max_tokens - t.generated, self.slots.context - int(self._length[slot]))
                       for slot, t in self._running.items())
            steps = max(1, min(MAX_STEPS, room))
        tokens_kb, _ = self.slots.decode(self._last, self._length, self._sampling, used=max(self._running) + 1,
                                         steps=steps)
        for tokens_b in tokens_kb:
            for slot in list(self._running):  # a row that ended at an earlier step drops the rest
                self._length[slot] += 1
                self._sampling.step_b[slot] += 1
                self._take_token(slot, int(tokens_b[slot]))

    def _take_token(self, slot: int, token: int) -> None:
        """Row ``slot``'s new token: its text to the request, and the request ends if it should."""
        ticket = self._running[slot]
        ticket.generated += 1
        self._last[slot] = token
        job = ticket.job
        if token in job.stop_ids:  # its text is not shown (as OpenAI's), its id is counted and returned
            self._finish(slot, Finish.STOP, last=(token,))
            return
        text, stopped = ticket.stream.push(token)
        if stopped:
            self._finish(slot, Finish.STOP, text, (token,))
        elif ticket.generated >= job.max_tokens or self._length[slot] >= self.slots.context:
            # (the next token would be written at slot _length: past the slot's end, it cannot be fed)
            self._finish(slot, Finish.LENGTH, text + ticket.stream.rest(), (token,))
        elif ticket.whole:
            ticket.held.append(Event(text, (token,)))
        else:
            ticket.deliver(Event(text, (token,)))

    def _finish(self, slot: int, finish: Finish, text: str = "", last: Tuple[int, ...] = ()) -> None:
        ticket = self._running.pop(slot)
        self._end(ticket, finish, text, last)

    def _end(self, ticket: Ticket, finish: Finish, text: str = "", last: Tuple[int, ...] = ()) -> None:
        self.counts[finish.value] += 1
        if finish in (Finish.STOP, Finish.LENGTH):
            took = time.monotonic() - ticket.started
            self._seconds_per_request = 0.8 * self._seconds_per_request + 0.2 * took
        if ticket.held:
            text = "".join(e.text for e in ticket.held) + text
            last = tuple(t for e in ticket.held for t in e.token_ids) + last
        ticket.deliver(Event(text, last, finish, ticket.generated))
