"""Running the server: the engine (a thread, or a process of its own), the app and uvicorn, with a draining shutdown.

:class:`BastionServer` binds its socket at construction (``port=0`` picks a free one; :attr:`url`
says where it listens), then :meth:`BastionServer.run` serves in the calling (main) thread until
SIGTERM or SIGINT, or :meth:`BastionServer.start` serves from a background thread until
:meth:`BastionServer.stop` (tests, notebooks, embedding in another program).

A SIGTERM (or the first SIGINT) starts a drain: new requests get a 503 with ``Retry-After`` and
``/health`` answers 503, the requests already accepted run to their end, for at most
``drain_timeout`` seconds (then they are cancelled), and the server exits with status 0. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from types import FrameType
from typing import Any, Callable

import attrs
import uvicorn

from bastion.contract.errors import InvalidInputError
from bastion.serve.app import AppState, create_app
from bastion.serve.process import EngineProcess
from bastion.serve.worker import EngineWorker

__all__ = ["BastionServer", "ServeSettings"]

log = logging.getLogger("bastion.serve")


def _positive_int(name: str):  # type: ignore[no-untyped-def]
    def check(_obj: Any, _attr: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")

    return check


def _port(_obj: Any, _attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise InvalidInputError(f"port must be an int in [0, 65535] (0: any free port), got {value!r}")


def _nonnegative(_obj: Any, attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidInputError(f"{attr.name} must be a number >= 0, got {value!r}")


@attrs.frozen
class ServeSettings:
    """How a server runs: where it listens, the batch and queue bounds, the drain timeout (seconds),
    the model name clients address, the chat answer cap, the prompt tokens admitted per step, and
    uvicorn's log level."""

    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_port)
    max_running: int = attrs.field(default=32, validator=_positive_int("max_running"))
    max_queue: int = attrs.field(default=256, validator=_positive_int("max_queue"))
    drain_timeout: float = attrs.field(default=30.0, validator=_nonnegative)
    model_name: str = "bastion-demo"
    chat_max_tokens: int = attrs.field(default=256, validator=_positive_int("chat_max_tokens"))
    prefill_tokens: int = attrs.field(default=2048, validator=_positive_int("prefill_tokens"))
    prefill_chunk: int | None = attrs.field(default=256, validator=attrs.validators.optional(_positive_int("prefill_chunk")))
    log_level: str = "warning"


class _Uvicorn(uvicorn.Server):
    """uvicorn, with its signal handling turned into :meth:`BastionServer.drain` (and no re-raise of
    the signal after shutdown, so a drained server exits with status 0)."""

    def __init__(self, config: uvicorn.Config, owner: "BastionServer") -> None:
        super().__init__(config)
        self.owner = owner
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.owner.state.draining or self.loop is None:  # a second signal: leave now
            self.should_exit = True
            self.force_exit = True
            return
        self.owner.request_drain()


class BastionServer:
    """One server over ``pipe`` (see the module doc)."""

    def __init__(self, pipe: Any, settings: ServeSettings | None = None, *, engine: EngineProcess | None = None) -> None:
        self.settings = settings = settings or ServeSettings()
        self.pipe = pipe
        self.worker: EngineWorker | EngineProcess
        if engine is None:
            self.worker = EngineWorker(pipe, **_engine_options(settings))
            max_positions = int(pipe.target.max_positions)
        else:
            self.worker, max_positions = engine, int(engine.info["max_positions"])
        self.state = AppState(self.worker, settings.model_name, max_positions, chat_max_tokens=settings.chat_max_tokens)
        self.app = create_app(self.state)
        self.socket = _bind(settings.host, settings.port)
        self.host, self.port = self.socket.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level=settings.log_level, access_log=False, timeout_graceful_shutdown=5,
                                lifespan="off")
        self._server = _Uvicorn(config, self)
        self._thread: threading.Thread | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.drained_in: float | None = None  # seconds the last drain took

    @classmethod
    def spawn(cls, build: Callable[[], Any], settings: ServeSettings | None = None, *, startup_timeout: float = 900.0) -> "BastionServer":
        """A server whose engine runs in a process of its own (:mod:`bastion.serve.process`): ``build()``, a
        picklable callable (e.g. ``functools.partial(Pipeline.from_pretrained, target, drafter)``), makes
        the pipeline there. Returns once the pipeline is loaded and the socket bound; :attr:`pipe` is None
        (the models live in the engine process) and ``worker.info`` describes what it serves."""
        settings = settings or ServeSettings()
        engine = EngineProcess(build, startup_timeout=startup_timeout, **_engine_options(settings))
        try:
            return cls(None, settings, engine=engine)
        except BaseException:
            engine.stop()
            raise

    @property
    def url(self) -> str:
        """The base URL clients use, e.g. ``http://127.0.0.1:8000`` (``/v1`` for OpenAI clients)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        """Serve in this thread until a signal drains the server -> exit status 0."""
        self.worker.start()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self.worker.stop()
        return 0

    def start(self, timeout: float = 30.0) -> "BastionServer":
        """Serve from a background thread; returns once the server accepts connections."""
        self.worker.start()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="bastion-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop a background server now (open requests end with a 503 error)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.worker.stop()
        self.socket.close()

    def __enter__(self) -> "BastionServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ draining
    def request_drain(self) -> None:
        """Start a drain from any thread (what SIGTERM does)."""
        loop = self._server.loop
        if loop is None:
            raise RuntimeError("the server is not running")
        loop.call_soon_threadsafe(self.drain)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background server to exit (after a drain) -> whether it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def drain(self) -> None:
        """Stop accepting requests and exit once the open ones end (call on the server's event loop)."""
        if self.state.draining:
            return
        self.state.draining = True
        self.state.retry_after = max(1, int(self.settings.drain_timeout))
        log.warning("bastion serve: draining %d open requests (at most %.0f s)", self.worker.open_requests,
                    self.settings.drain_timeout)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        start = time.monotonic()
        deadline = start + self.settings.drain_timeout
        while self.worker.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.worker.open_requests:
            log.warning("bastion serve: drain timeout: cancelling %d requests", self.worker.open_requests)
            self.worker.cancel_all()
            end = time.monotonic() + 5.0
            while self.worker.open_requests and time.monotonic() < end:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let the last responses flush
        self.drained_in = time.monotonic() - start
        self._server.should_exit = True


def _engine_options(settings: ServeSettings) -> dict[str, Any]:
    return dict(max_running=settings.max_running, max_queue=settings.max_queue, prefill_tokens=settings.prefill_tokens,
                prefill_chunk=settings.prefill_chunk)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6; port 0: a free port). Its protocol is
    ``IPPROTO_TCP`` by name: asyncio switches Nagle's algorithm off (``TCP_NODELAY``) only on sockets
    that say so, and without it every response on a kept-alive connection waits for the client's
    delayed ACK (about 40 ms on Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock

