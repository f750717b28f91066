"""The errors the server answers with, each carrying its HTTP status and OpenAI's error fields.

Every handler raises one of these (or lets a :class:`~bastion.contract.errors.BastionError` through, which
:func:`as_api_error` turns into one); the app renders them as OpenAI's error body::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

from typing import Any

from bastion.contract.errors import BastionError, ComponentError, InvalidInputError

__all__ = ["APIError", "BadRequestError", "ServerError", "UnavailableError", "as_api_error"]


class APIError(BastionError):
    """An error the server sends to a client: ``status`` (HTTP), ``type``, ``param`` (the request field
    at fault, or None) and ``code`` (a short machine-readable reason, or None)."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error body for this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequestError(APIError, InvalidInputError):
    """400: the request is malformed, asks for something unsupported, or does not fit the model."""

    status = 400
    type = "invalid_request_error"


class ServerError(APIError):
    """500: decoding failed inside the server (a component raised); the message names the component."""

    status = 500
    type = "server_error"


class UnavailableError(APIError):
    """503: the server cannot take the request now (the queue is full, or it is shutting down); the
    ``Retry-After`` header says in how many seconds to try again."""

    status = 503
    type = "server_error"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})


def as_api_error(exc: BaseException) -> APIError:
    """``exc`` as the error a client gets: API errors as they are, bad input as a 400, a component
    failure or anything else as a 500 whose message names what failed."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidInputError):
        return BadRequestError(str(exc))
    if isinstance(exc, ComponentError):
        return ServerError(str(exc), code="component_error")
    return ServerError(f"{type(exc).__name__}: {exc}", code="internal_error")
