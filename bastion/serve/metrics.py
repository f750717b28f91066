"""The server's Prometheus metrics, in a registry of their own (one per server).

The engine thread records them (prometheus_client's metrics are thread-safe); ``GET /metrics`` renders
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

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ServeMetrics"]

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
        if request.t_admitted is not None:
            self.queue_seconds.observe(max(0.0, request.t_admitted - request.t_queued))
        if request.t_first_token is not None:
            self.ttft_seconds.observe(max(0.0, request.t_first_token - request.t_queued))

    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)
