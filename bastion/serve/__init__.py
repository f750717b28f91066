"""``bastion serve``: an OpenAI-compatible HTTP server over one continuously batched engine.

One engine loop (:mod:`bastion.serve.worker`; by default in a process of its own,
:mod:`bastion.serve.process`) owns the :class:`~bastion.engine.Engine`; requests join
its running batch between steps and leave when they finish or their client disconnects, and every step
is one decision of the pipeline's budget controller for the rows running now. The FastAPI front end
(:mod:`bastion.serve.app`) speaks OpenAI's completions and chat API, streamed or not, plus ``/health``
and Prometheus ``/metrics`` (:mod:`bastion.serve.metrics`). Needs the ``serve`` extra
(``pip install "bastion[serve]"``).
"""

from bastion.serve.errors import APIError, BadRequestError, ServerError, UnavailableError
from bastion.serve.server import BastionServer, ServeSettings

__all__ = ["APIError", "BadRequestError", "BastionServer", "ServeSettings", "ServerError", "UnavailableError"]
