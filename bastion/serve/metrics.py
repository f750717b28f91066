"""The server's Prometheus metrics, in a registry of their own (one per server).

The engine thread records them (prometheus_client's metrics are thread-safe) through the methods of
:class:`ServeMetrics`; an engine in a process of its own records them in a :class:`MetricsRecorder`,
whose calls its server replays on the real metrics (:func:`replay`). ``GET /metrics`` renders
:meth:`ServeMetrics.render` in the Prometheus text format. Names:

- ``bastion_requests_running`` / ``bastion_requests_waiting`` (gauges): rows decoding now, requests
  queued for admission;
- ``bastion_prompt_tokens_total`` / ``bastion_completion_tokens_total`` (counters);
- ``bastion_requests_finished_total{reason}`` (counter): eos, length, stop, position-limit, cancelled,
  error; ``bastion_requests_rejected_total{reason}``: invalid, queue_full, draining;
- ``bastion_steps_total`` / ``bastion_steps_drafted_total`` (counters) and
  ``bastion_drafted_step_share`` (gauge): the share of engine steps that drafted;
- ``bastion_step_tokens`` (histogram): tokens one step committed over all its rows;
  ``bastion_step_tokens_per_row``: the same per row (1 for a plain step);
  ``bastion_step_batch_size``; ``bastion_step_width``: tree nodes verified per row (1 = plain decoding);
  ``bastion_step_seconds``;
- ``bastion_queue_seconds`` (histogram): queued until admitted (prefilled);
  ``bastion_time_to_first_token_seconds``: queued until the first token.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "MetricsRecorder", "ServeMetrics", "replay"]

CONTENT_TYPE: str = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512)


class ServeMetrics:
    """Every metric of one server, registered in :attr:`registry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge("bastion_requests_running", "Requests decoding in the running batch", registry=r)
        self.waiting = Gauge("bastion_requests_waiting", "Requests queued for admission", registry=r)
        self.prompt_tokens = Counter("bastion_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("bastion_completion_tokens", "Tokens generated", registry=r)
        self.finished = Counter("bastion_requests_finished", "Requests finished, by engine stop reason", ["reason"], registry=r)
        self.rejected = Counter("bastion_requests_rejected", "Requests refused before decoding, by reason", ["reason"], registry=r)
        self.steps = Counter("bastion_steps", "Engine decode steps", registry=r)
        self.steps_drafted = Counter("bastion_steps_drafted", "Engine decode steps that drafted", registry=r)
        self.drafted_share = Gauge("bastion_drafted_step_share", "Share of engine steps that drafted", registry=r)
        self.step_tokens = Histogram("bastion_step_tokens", "Tokens committed per step over all rows",
                                     buckets=_SIZE_BUCKETS, registry=r)
        self.step_tokens_per_row = Histogram("bastion_step_tokens_per_row", "Tokens committed per step per row",
                                             buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_size = Histogram("bastion_step_batch_size", "Rows decoded per step", buckets=_SIZE_BUCKETS, registry=r)
        self.width = Histogram("bastion_step_width", "Tree nodes verified per row per step (1: plain decoding)",
                               buckets=_SIZE_BUCKETS, registry=r)
        self.step_seconds = Histogram("bastion_step_seconds", "Wall seconds per engine step", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("bastion_queue_seconds", "Seconds from arrival to admission (prefill)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("bastion_time_to_first_token_seconds", "Seconds from arrival to the first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self._steps = 0
        self._drafted = 0

    def count_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def count_completion_tokens(self, n: int) -> None:
        self.completion_tokens.inc(n)

    def count_finished(self, reason: str) -> None:
        self.finished.labels(reason).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def observe_step(self, summary: Any) -> None:
        """One engine step's :class:`~bastion.engine.StepSummary`."""
        self._steps += 1
        self._drafted += bool(summary.drafted)
        self.steps.inc()
        if summary.drafted:
            self.steps_drafted.inc()
        self.drafted_share.set(self._drafted / self._steps)
        self.step_tokens.observe(summary.emitted)
        if summary.batch_size:
            self.step_tokens_per_row.observe(summary.emitted / summary.batch_size)
        self.batch_size.observe(summary.batch_size)
        self.width.observe(summary.width)
        self.step_seconds.observe(summary.seconds)

    def observe_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_first_token(self, request: Any) -> None:
        """A request's queue time and time to first token, once it has its first token."""
        self.observe_latency(*first_token_latency(request))

    def observe_latency(self, queue_s: float | None, ttft_s: float | None) -> None:
        """Seconds a request waited for admission and for its first token (None: not known)."""
        if queue_s is not None:
            self.queue_seconds.observe(queue_s)
        if ttft_s is not None:
            self.ttft_seconds.observe(ttft_s)

    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)


def first_token_latency(request: Any) -> tuple[float | None, float | None]:
    """An engine request's seconds from arrival to admission and to its first token (None: not yet)."""
    queue_s = None if request.t_admitted is None else max(0.0, request.t_admitted - request.t_queued)
    ttft_s = None if request.t_first_token is None else max(0.0, request.t_first_token - request.t_queued)
    return queue_s, ttft_s


Call = tuple[str, tuple[Any, ...]]  # a recorded metrics call: method name, arguments


class MetricsRecorder:
    """Takes the engine's metrics calls where the metrics are not (an engine in a process of its own):
    each is kept as a ``(method, args)`` pair, plain data, until :meth:`take` hands them over for
    :func:`replay` on the server's :class:`ServeMetrics`. The counters and ``observe_step`` are kept as
    called; the queue gauges only when they change (the engine sets them on every pass of its loop); a
    request's first token as its latencies (:func:`first_token_latency`), not the request."""

    def __init__(self) -> None:
        self._calls: list[Call] = []
        self._queue: tuple[int, int] | None = None

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in _AS_CALLED:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return functools.partial(self._record, name)

    def _record(self, name: str, *args: Any) -> None:
        self._calls.append((name, args))

    def observe_queue(self, running: int, waiting: int) -> None:
        if self._queue != (running, waiting):
            self._queue = (running, waiting)
            self._record("observe_queue", running, waiting)

    def observe_first_token(self, request: Any) -> None:
        self._record("observe_latency", *first_token_latency(request))

    def take(self) -> list[Call]:
        """The calls recorded since the last take (and forget them)."""
        calls, self._calls = self._calls, []
        return calls


#: the metrics calls a recorder keeps as they are made
_AS_CALLED = frozenset({"count_prompt_tokens", "count_completion_tokens", "count_finished", "count_rejected", "observe_step"})
_REPLAYED = _AS_CALLED | {"observe_queue", "observe_latency"}


def replay(metrics: ServeMetrics, calls: list[Call]) -> None:
    """Make ``calls`` (from :meth:`MetricsRecorder.take`) on ``metrics``."""
    for name, args in calls:
        if name not in _REPLAYED:
            raise ValueError(f"not a metrics call: {name!r}")
        getattr(metrics, name)(*args)
