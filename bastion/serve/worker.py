"""The engine thread: the one thread that owns the :class:`~bastion.engine.Engine` (and the models).

The asyncio front end hands it work through a thread-safe inbox (:meth:`EngineWorker.submit`,
:meth:`EngineWorker.cancel`) and gets events back in each request's own asyncio queue (through
``loop.call_soon_threadsafe``). The same loop runs in an engine process of its own
(:mod:`bastion.serve.process`), its events then sent to the server's process. Between steps the thread
takes every command waiting in its inbox:
a submission is prepared (tokenized and checked, see :mod:`bastion.serve.prepare`) and added to the
engine, or refused; a cancellation drops a waiting request or takes a running one out of the batch at
the next step. Then it runs one :meth:`Engine.step` and forwards each request's new text. With nothing
running or waiting it blocks on its inbox (no busy loop).

Events a :class:`Ticket` receives, in order: :class:`Accepted` or :class:`Rejected` (then nothing
else); then :class:`Delta` per step that committed tokens (unless submitted with ``deltas=False``),
the first one (the token drawn from the prefill) handed over before the step that admitted the request
decodes; then one :class:`Finished`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable, Protocol, TypeVar

import attrs
import torch

from bastion.engine import Engine, StepUpdate
from bastion.serve.errors import APIError, UnavailableError, as_api_error
from bastion.serve.metrics import ServeMetrics
from bastion.serve.prepare import Prepared

__all__ = ["Accepted", "Delta", "EngineWorker", "Event", "Finished", "Rejected", "Ticket"]

log = logging.getLogger("bastion.serve")


@attrs.frozen
class Accepted:
    """The request is in the engine: its prompt length and token limit."""

    prompt_tokens: int
    max_tokens: int


@attrs.frozen
class Rejected:
    """The request never reached the engine (a bad request, a full queue, a shutdown)."""

    error: APIError


@attrs.frozen
class Delta:
    """One step's output for the request: the text it released (may be empty) and its token count."""

    text: str
    tokens: int


@attrs.frozen
class Finished:
    """The request ended: the engine's stop reason, the usage, the whole text, and the error that ended
    it (``stop_reason`` ``"error"`` or ``"cancelled"``), else None."""

    stop_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    error: APIError | None = None


Event = Accepted | Rejected | Delta | Finished
_LastEvent = TypeVar("_LastEvent", Rejected, Finished)  # a request's last event


Prepare = Callable[[Any], Prepared]  # the pipeline -> the request ready for the engine (run on the engine thread)


class Outbox(Protocol):
    """Where a ticket's events go when it is not on an asyncio loop of this process (an engine in a
    process of its own sends them to the server's process)."""

    def deliver(self, batch: list[tuple[Any, Event]]) -> None: ...


class Ticket:
    """One request as the front end and the engine thread share it: how to prepare it (called with the
    pipeline, on the engine thread), the asyncio queue its events arrive in, and its engine request once
    added."""

    def __init__(self, prepare: Prepare, loop: asyncio.AbstractEventLoop, *, deltas: bool = True) -> None:
        self.prepare = prepare
        self.loop: asyncio.AbstractEventLoop | Outbox = loop
        #: whether the front end wants a :class:`Delta` per step (a stream) or only the last event; a
        #: request answered whole gets none, so its steps never wake the event loop
        self.deltas = deltas
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.request: Any = None  # the engine's Request, set by the engine thread
        self.cancelled = False  # set by the front end; the engine thread acts on it
        self.closed = False  # set by the front end once it has seen Rejected or Finished
        self.first_token_seen = False

    async def next_event(self) -> Event:
        """The next event (waits for it); marks the ticket closed on its last one."""
        return self._seen(await self.events.get())

    def next_ready(self) -> Event | None:
        """The next event if one has arrived, else None (no wait)."""
        try:
            return self._seen(self.events.get_nowait())
        except asyncio.QueueEmpty:
            return None

    def _seen(self, event: Event) -> Event:
        if isinstance(event, (Rejected, Finished)):
            self.closed = True
        return event

    def receive(self, event: Event) -> None:
        """Queue ``event`` for the front end (runs on the front end's loop)."""
        self.events.put_nowait(event)

    def push(self, event: Event) -> None:
        """Hand ``event`` to the front end's loop (from the engine thread)."""
        push_all([(self, event)])


def push_all(items: list[tuple[Ticket, Event]]) -> None:
    """Hand each ``(ticket, event)`` to its ticket's loop (or :class:`Outbox`), in order, with one
    wake-up per loop (from the engine thread): a step's events for every running request cost the front
    end one wake-up, not one per request."""
    by_loop: dict[Any, list[tuple[Ticket, Event]]] = {}
    for ticket, event in items:
        by_loop.setdefault(ticket.loop, []).append((ticket, event))
    for loop, batch in by_loop.items():
        if not isinstance(loop, asyncio.AbstractEventLoop):
            loop.deliver(batch)
            continue
        try:
            loop.call_soon_threadsafe(_receive_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _receive_all(batch: list[tuple[Ticket, Event]]) -> None:
    for ticket, event in batch:
        ticket.receive(event)


_STOP = "stop"


def engine_down() -> UnavailableError:
    """The 503 a request gets when no engine is running to take it."""
    return UnavailableError("the engine is not running", code="engine_down")


class EngineWorker:
    """Owns an :class:`~bastion.engine.Engine` on a thread of its own (see the module doc).

    ``max_running`` bounds the running batch, ``max_queue`` the requests waiting for admission beyond
    the batch's free rows (a request past it is refused with a 503), ``prefill_tokens`` the prompt
    tokens admitted per step, ``prefill_chunk`` the chunk a longer prompt is prefilled in, one per step
    beside the running rows (None: whole prompts)."""

    def __init__(self, pipe: Any, *, max_running: int = 32, max_queue: int = 256, prefill_tokens: int = 2048,
                 prefill_chunk: int | None = 256, metrics: ServeMetrics | None = None) -> None:
        self.pipe = pipe
        self.max_running = max_running
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics or ServeMetrics()
        self._engine = self._new_engine()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[Any, Ticket] = {}  # engine request id -> ticket (engine thread only)
        self._open = 0  # tickets submitted and not yet answered with Rejected/Finished
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the thread, if it died

    def _new_engine(self) -> Engine:
        return Engine(self.pipe, max_running=self.max_running, prefill_tokens=self.prefill_tokens, prefill_chunk=self.prefill_chunk)

    # ------------------------------------------------------------------ front-end side (any thread)
    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="bastion-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine thread: every request still open ends with a 503 error."""
        if self._thread is None:
            return
        self._inbox.put((_STOP, None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def open_requests(self) -> int:
        """Requests submitted and not yet finished or refused."""
        with self._lock:
            return self._open

    def submit(self, prepare: Prepare, *, deltas: bool = True) -> Ticket:
        """Queue a request (call from the front end's event loop): ``prepare(pipe)`` runs on the engine
        thread; its events arrive in the ticket (``deltas=False``: no :class:`Delta` events, for a request
        answered whole)."""
        ticket = Ticket(prepare, asyncio.get_running_loop(), deltas=deltas)
        if not self.alive:
            ticket.events.put_nowait(Rejected(engine_down()))
            return ticket
        with self._lock:
            self._open += 1
        self._inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Cancel a request whose client went away (its row leaves the batch at the next step)."""
        if ticket.closed or ticket.cancelled:
            return
        ticket.cancelled = True
        self._inbox.put(("cancel", ticket))

    def cancel_all(self) -> None:
        """Cancel every open request (a shutdown past its drain timeout)."""
        self._inbox.put(("cancel_all", None))

    # ------------------------------------------------------------------ the engine thread
    def _main(self) -> None:
        try:
            with torch.inference_mode():
                self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug in the loop itself: answer everyone, then stop
            log.exception("the engine thread stopped")
            self.failure = exc
            self._fail_all(as_api_error(exc))

    def _loop(self) -> None:
        while True:
            commands = []
            try:
                commands.append(self._inbox.get(block=self._engine.idle))
            except queue.Empty:
                pass
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stop = False
            for kind, ticket in commands:
                if kind == _STOP:
                    stop = True
                elif kind == "submit":
                    self._add(ticket)
                elif kind == "cancel":
                    self._cancel(ticket)
                elif kind == "cancel_all":
                    for live in list(self._live.values()):
                        self._cancel(live)
            if stop:
                self._fail_all(UnavailableError("the server shut down before the request finished", code="shutdown"))
                return
            if not self._engine.idle:
                self._step()
            self.metrics.observe_queue(len(self._engine.running), len(self._engine.waiting))
            self._flush()

    def _flush(self) -> None:
        """The end of one pass of the loop (before it may block on the inbox): an engine in a process of
        its own sends what it has gathered here."""

    def _add(self, ticket: Ticket) -> None:
        engine = self._engine
        try:
            if ticket.cancelled:
                raise UnavailableError("the request was cancelled", code="cancelled")
            queued = len(engine.waiting) - max(0, self.max_running - len(engine.running))
            if queued >= self.max_queue:
                raise UnavailableError(f"the server's queue is full ({self.max_queue} waiting requests); retry later",
                                       code="queue_full")
            prepared = ticket.prepare(self.pipe)
            request = engine.add(prepared.prompt_ids, prepared.config, text=True)
        except Exception as exc:  # noqa: BLE001 - refused: the client gets the error
            error = as_api_error(exc)
            reason = error.code if error.code in ("queue_full", "cancelled") else "invalid" if error.status == 400 else "error"
            self.metrics.count_rejected(reason)
            self._close(ticket, Rejected(error))
            return
        ticket.request = request
        self._live[request.id] = ticket
        self.metrics.count_prompt_tokens(request.prompt_len)
        ticket.push(Accepted(request.prompt_len, request.config.max_new_tokens))

    def _cancel(self, ticket: Ticket) -> None:
        request = ticket.request
        if request is None or request.id not in self._live:
            return  # not added yet (the submission sees the flag) or already finished
        self._engine.cancel(request)
        if request.finished:  # it was waiting: dropped now, no step will report it
            self._finish(ticket, request)

    def _step(self) -> None:
        engine = self._engine
        try:
            # the newcomers' first tokens (from their prefill) go out before the step decodes
            updates = engine.step(on_admitted=self._hand_over)
        except Exception as exc:  # noqa: BLE001 - the engine itself broke: fail its requests, start a fresh one
            log.exception("engine step failed")
            self._fail_all(as_api_error(exc))
            self._engine = self._new_engine()
            return
        self._hand_over(updates)
        if engine.last_step is not None:
            self.metrics.observe_step(engine.last_step)

    def _hand_over(self, updates: list[StepUpdate]) -> None:
        """Each update's events to its request's stream, all in one wake-up of the front end's loop."""
        out: list[tuple[Ticket, Event]] = []  # these updates' events, handed over together
        tokens = 0
        for update in updates:
            ticket = self._live.get(update.request.id)
            if ticket is None:
                continue
            if update.tokens:
                tokens += len(update.tokens)
                if not ticket.first_token_seen:
                    ticket.first_token_seen = True
                    self.metrics.observe_first_token(update.request)
            if ticket.deltas and (update.tokens or update.text):
                out.append((ticket, Delta(update.text, len(update.tokens))))
            if update.finished:
                out.append((ticket, self._finish(ticket, update.request, push=False)))
        if tokens:
            self.metrics.count_completion_tokens(tokens)  # once per hand-over, not per row
        push_all(out)

    def _finish(self, ticket: Ticket, request: Any, *, push: bool = True) -> Finished:
        reason = str(request.stop_reason)
        self.metrics.count_finished(reason)
        error = None
        if reason == "error":
            error = as_api_error(request.error if request.error is not None else RuntimeError("decoding failed"))
        elif reason == "cancelled":
            error = UnavailableError("the request was cancelled before it finished", code="cancelled")
        self._live.pop(request.id, None)
        return self._close(ticket, Finished(reason, request.prompt_len, len(request.tokens), request.text, error), push=push)

    def _close(self, ticket: Ticket, event: _LastEvent, *, push: bool = True) -> _LastEvent:
        """The request is over: one fewer open; ``event`` (its last) handed over now, or by the caller
        (``push=False``) -> ``event``."""
        with self._lock:
            self._open -= 1
        if push:
            ticket.push(event)
        return event

    def _fail_all(self, error: APIError) -> None:
        """End every request in the engine with ``error`` (the engine is dropped or shutting down)."""
        for ticket in list(self._live.values()):
            request = ticket.request
            self.metrics.count_finished("error")
            self._close(ticket, Finished("error", request.prompt_len, len(request.tokens), request.text, error))
        self._live.clear()
        while True:  # submissions nobody will prepare
            try:
                kind, ticket = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._close(ticket, Rejected(error))
