"""The engine in a process of its own: the server's front end and the engine loop do not share a GIL.

In one process the engine thread and the HTTP front end take turns at the interpreter lock. A decode
step calls hundreds of short tensor operations, each releasing the lock and taking it back; whenever
the front end holds it (a stream's chunk on its way out, a request being parsed) the engine waits for
the whole of that turn, so a front end busy a few per cent of the time stretches every step by more than
that. :class:`EngineProcess` runs the same loop (:class:`~bastion.serve.worker.EngineWorker`) in a child
process, which builds the pipeline itself (``build``, a picklable callable, run there) and owns the
models; the server's process keeps the tickets, the metrics and the event loop.

The two talk over one duplex pipe:

- server -> engine: ``("submit", id, prepare, deltas)``, ``("cancel", id)``, ``("cancel_all",)``,
  ``("stop",)``; ``prepare`` is plain data and a module-level function (what the app submits);
- engine -> server: ``("ready", info)`` or ``("failed", message)`` once at start, then ``("events",
  [(id, event), ...], calls)`` with one step's events for every request and the metrics calls recorded
  since the last message (:class:`~bastion.serve.metrics.MetricsRecorder`), and ``("died", message)``
  if the engine loop itself broke.

The child ignores SIGINT and SIGTERM (the server drains, then tells it to stop) and exits when the pipe
closes, so it never outlives its server. If it dies, every open request ends with a 503 and ``/health``
answers 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

import bastion
from bastion.contract.errors import InvalidInputError
from bastion.serve.errors import UnavailableError, as_api_error
from bastion.serve.metrics import MetricsRecorder, ServeMetrics, replay
from bastion.serve.worker import _STOP, EngineWorker, Event, Finished, Prepare, Rejected, Ticket, engine_down, push_all

__all__ = ["EngineProcess", "EngineStartError", "component_names", "engine_info"]

log = logging.getLogger("bastion.serve")

_KINDS = ("drafter", "tree_builder", "budget_controller", "latency_model", "verifier")


class EngineStartError(RuntimeError):
    """The engine process could not start: its pipeline failed to build, it exited, or it took too long.
    ``bad_input``: the build refused its arguments (one of bastion's input errors; the message is its own)."""

    def __init__(self, message: str, *, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


def component_names(pipe: Any) -> dict[str, str]:
    """The pipeline's components, ``kind -> class name``."""
    return {kind: type(getattr(pipe, kind)).__name__ for kind in _KINDS}


def engine_info(pipe: Any) -> dict[str, Any]:
    """What an engine over ``pipe`` serves, as plain data: the context window (``max_positions``), the
    components, and the version and folder of the ``bastion`` it runs (:attr:`EngineProcess.info`)."""
    return {"max_positions": int(pipe.target.max_positions), "components": component_names(pipe),
            "version": bastion.__version__, "folder": str(Path(bastion.__file__).parent)}


class EngineProcess:
    """An :class:`~bastion.serve.worker.EngineWorker` in a child process, with the worker's front-end
    methods (see the module doc). The constructor starts the child and waits until ``build()`` has
    returned there (the models are loaded): :attr:`info` then holds the served pipeline's context window
    (``max_positions``), components, and the version and folder of the ``bastion`` the child imported."""

    def __init__(self, build: Callable[[], Any], *, max_running: int = 32, max_queue: int = 256, prefill_tokens: int = 2048,
                 prefill_chunk: int | None = 256, metrics: ServeMetrics | None = None, startup_timeout: float = 900.0) -> None:
        self.metrics = metrics or ServeMetrics()
        self.pipe = None  # the pipeline lives in the child
        self.failure: str | None = None  # why the engine stopped, if it died
        options = dict(max_running=max_running, max_queue=max_queue, prefill_tokens=prefill_tokens, prefill_chunk=prefill_chunk)
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or locks
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_child_main, args=(child, build, options), name="bastion-engine", daemon=True)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._gone = False  # the pipe closed: the child has exited
        self.info: dict[str, Any] = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        try:
            if not self._conn.poll(timeout):
                self._process.kill()
                raise EngineStartError(f"the engine process did not load its pipeline within {timeout:.0f} s")
            message = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise EngineStartError(f"the engine process exited while starting (exit status {self._process.exitcode})") from None
        if message[0] == "failed":
            self._process.join(10)
            _, text, bad_input = message
            raise EngineStartError(text if bad_input else f"the engine process could not start: {text}", bad_input=bad_input)
        return dict(message[1])

    # ------------------------------------------------------------------ the worker's front-end methods
    def start(self) -> None:
        """Start relaying the engine's events (the engine already runs)."""
        if self._reader is not None:
            return
        self._reader = threading.Thread(target=self._read, name="bastion-engine-events", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine process: every request still open ends with a 503 error."""
        self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)
        self._end_all("the server shut down before the request finished", "shutdown")
        self._conn.close()

    @property
    def alive(self) -> bool:
        return not self._gone and self.failure is None and self._process.is_alive()

    @property
    def open_requests(self) -> int:
        """Requests submitted and not yet finished or refused."""
        with self._lock:
            return len(self._tickets)

    def submit(self, prepare: Prepare, *, deltas: bool = True) -> Ticket:
        """Queue a request (call from the front end's event loop); ``prepare(pipe)`` runs in the engine
        process, so it must pickle (plain data and a module-level function)."""
        ticket = Ticket(prepare, asyncio.get_running_loop(), deltas=deltas)
        if not self.alive:
            ticket.events.put_nowait(Rejected(engine_down()))
            return ticket
        key = next(self._ids)
        ticket.request = key  # the front end's handle; the engine's request stays in its process
        with self._lock:
            self._tickets[key] = ticket
        try:
            sent = self._send(("submit", key, prepare, deltas))
        except Exception as exc:  # noqa: BLE001 - it does not pickle: this request fails, the server goes on
            self._answer([(key, Rejected(as_api_error(exc)))])
            return ticket
        if not sent:
            self._answer([(key, Rejected(engine_down()))])
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Cancel a request whose client went away (its row leaves the batch at the next step)."""
        if ticket.closed or ticket.cancelled:
            return
        ticket.cancelled = True
        self._send(("cancel", ticket.request))

    def cancel_all(self) -> None:
        """Cancel every open request (a shutdown past its drain timeout)."""
        self._send(("cancel_all",))

    # ------------------------------------------------------------------ the relay
    def _send(self, message: tuple[Any, ...]) -> bool:
        """Send ``message`` -> False when the engine process is gone (an object that does not pickle raises)."""
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):  # the child is gone, or the pipe closed
                return False

    def _read(self) -> None:
        """The events relay (a thread): each message's metrics replayed, its events handed to their
        tickets' loops; at the pipe's end every open request fails."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":
                replay(self.metrics, message[2])
                self._answer(message[1])
            elif message[0] == "died":
                self.failure = message[1]
                log.error("the engine process stopped: %s", message[1])
        self._gone = True
        self._end_all("the engine process exited", "engine_down")

    def _answer(self, events: list[tuple[int, Event]]) -> None:
        out: list[tuple[Ticket, Event]] = []
        with self._lock:
            for key, event in events:
                ticket = self._tickets.get(key)
                if ticket is None:
                    continue
                if isinstance(event, (Rejected, Finished)):
                    del self._tickets[key]
                out.append((ticket, event))
        push_all(out)

    def _end_all(self, message: str, code: str) -> None:
        with self._lock:
            left, self._tickets = self._tickets, {}
        error = UnavailableError(message, code=code)
        push_all([(t, Finished("error", 0, 0, "", error)) for t in left.values()])


# ---------------------------------------------------------------------- the child
class _Proxy:
    """A request in the engine process: what :class:`EngineWorker` reads of a ticket, its events sent to
    the server's process (its ``loop`` is the :class:`_Sender`)."""

    def __init__(self, key: int, prepare: Prepare, deltas: bool, sender: "_Sender") -> None:
        self.key = key
        self.prepare = prepare
        self.deltas = deltas
        self.loop = sender
        self.request: Any = None
        self.cancelled = False
        self.closed = False
        self.first_token_seen = False

    def push(self, event: Event) -> None:
        push_all([(self, event)])  # type: ignore[list-item]


class _Sender:
    """The engine process's side of the pipe: events with the metrics recorded so far, one message."""

    def __init__(self, conn: Any, recorder: MetricsRecorder, proxies: dict[int, _Proxy]) -> None:
        self.conn = conn
        self.recorder = recorder
        self.proxies = proxies
        self.lock = threading.Lock()

    def deliver(self, batch: list[tuple[Any, Event]]) -> None:
        for proxy, event in batch:
            if isinstance(event, (Rejected, Finished)):
                self.proxies.pop(proxy.key, None)
        self.send([(proxy.key, event) for proxy, event in batch])

    def send(self, events: list[tuple[int, Event]]) -> None:
        calls = self.recorder.take()
        if not events and not calls:
            return
        with self.lock:
            try:
                self.conn.send(("events", events, calls))
            except (OSError, ValueError):  # the server is gone; the inbox's end stops the loop
                pass


class _ChildWorker(EngineWorker):
    """The worker loop of the engine process: it sends what each pass gathered at the pass's end."""

    sender: _Sender

    def _flush(self) -> None:
        self.sender.send([])


def _child_main(conn: Any, build: Callable[[], Any], options: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on these and then stops the engine
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        pipe = build()
        recorder = MetricsRecorder()
        worker = _ChildWorker(pipe, metrics=recorder, **options)  # type: ignore[arg-type]
    except BaseException as exc:  # noqa: BLE001 - the server reports it and exits
        bad_input = isinstance(exc, InvalidInputError)
        conn.send(("failed", str(exc) if bad_input else f"{type(exc).__name__}: {exc}", bad_input))
        conn.close()
        return
    proxies: dict[int, _Proxy] = {}
    worker.sender = sender = _Sender(conn, recorder, proxies)
    conn.send(("ready", engine_info(pipe)))
    threading.Thread(target=_take_commands, args=(conn, worker, proxies, sender), name="bastion-engine-inbox", daemon=True).start()
    worker._main()  # the engine loop, in this process's main thread, until a stop
    if worker.failure is not None:
        failure = "".join(traceback.format_exception_only(type(worker.failure), worker.failure)).strip()
        try:
            conn.send(("died", failure))
        except (OSError, ValueError):
            pass
    conn.close()


def _take_commands(conn: Any, worker: EngineWorker, proxies: dict[int, _Proxy], sender: _Sender) -> None:
    """The engine process's inbox (a thread): the server's commands into the worker's own inbox; the
    pipe's end (the server is gone) stops the loop."""
    inbox = worker._inbox
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            inbox.put((_STOP, None))
            return
        except Exception:  # noqa: BLE001 - a command that does not unpickle here: skipped
            log.exception("the engine process could not read a command")
            continue
        try:
            _take(message, worker, proxies, sender)
        except Exception:  # noqa: BLE001 - one malformed command must not stop the inbox
            log.exception("the engine process could not take a command")
        if message and message[0] == "stop":
            return


def _take(message: tuple[Any, ...], worker: EngineWorker, proxies: dict[int, _Proxy], sender: _Sender) -> None:
    """One command from the server into the worker's inbox."""
    inbox = worker._inbox
    kind = message[0]
    if kind == "submit":
        _, key, prepare, deltas = message
        proxy = proxies[key] = _Proxy(key, prepare, deltas, sender)
        inbox.put(("submit", proxy))
    elif kind == "cancel":
        found = proxies.get(message[1])
        if found is not None and not found.cancelled:
            found.cancelled = True
            inbox.put(("cancel", found))
    elif kind == "cancel_all":
        inbox.put(("cancel_all", None))
    elif kind == "stop":
        inbox.put((_STOP, None))
    else:
        raise ValueError(f"unknown command {kind!r}")
