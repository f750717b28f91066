"""The HTTP front end: a FastAPI app speaking OpenAI's completions and chat API.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Each request is parsed
and checked (:mod:`bastion.serve.protocol`), handed to the engine (:mod:`bastion.serve.worker`, :mod:`bastion.serve.process`),
and answered from the events the engine sends back. Every error is OpenAI's error body with its status
(400 bad request, 500 a component failed, 503 queue full or shutting down, with ``Retry-After``).

A streaming client that disconnects cancels its request (its row leaves the batch at the next step);
so does a non-streaming client, checked every :data:`DISCONNECT_POLL_S` seconds while it waits.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any, AsyncIterator

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bastion.serve.errors import APIError, BadRequestError, UnavailableError, as_api_error
from bastion.serve.metrics import CONTENT_TYPE
from bastion.serve.process import EngineProcess
from bastion.serve.prepare import chat_inputs, completion_inputs
from bastion.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_chat,
    parse_completion,
    usage,
)
from bastion.serve.worker import Accepted, Delta, EngineWorker, Event, Finished, Prepare, Rejected, Ticket

__all__ = ["AppState", "DISCONNECT_POLL_S", "create_app"]

#: how often a non-streaming request checks whether its client is still connected
DISCONNECT_POLL_S = 0.5


@attrs.define
class AppState:
    """What the routes share: the engine (a thread or a process of its own), the served model's name and creation time, the
    context window, the chat answer cap, and whether the server is draining (refusing new work)."""

    worker: EngineWorker | EngineProcess
    model_name: str
    max_positions: int
    chat_max_tokens: int = 256
    created: int = attrs.field(factory=lambda: int(time.time()))
    draining: bool = False
    retry_after: int = 1


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def create_app(state: AppState) -> FastAPI:
    """The FastAPI app serving ``state``'s engine thread."""
    app = FastAPI(title="bastion", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.bastion = state

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return _error_response(as_api_error(exc))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": str(state.retry_after)})
        if not state.worker.alive:
            return JSONResponse({"status": "engine down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.worker.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != state.model_name:
            raise StarletteHTTPException(404, f"the model {model_id!r} does not exist; this server serves {state.model_name!r}")
        return JSONResponse(_model_card(state))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_open(state)
        req = parse_completion(await request.body())
        _check_model(state, req.model)
        return await _generate(state, request, req, functools.partial(completion_inputs, req=req), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_open(state)
        req = parse_chat(await request.body())
        _check_model(state, req.model)
        prepare = functools.partial(chat_inputs, req=req, default_max_tokens=state.chat_max_tokens)
        return await _generate(state, request, req, prepare, chat=True)

    return app


def _model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "bastion",
            "max_model_len": state.max_positions}


def _check_open(state: AppState) -> None:
    if state.draining:
        state.worker.metrics.count_rejected("draining")
        raise UnavailableError("the server is shutting down", retry_after=state.retry_after, code="draining")


def _check_model(state: AppState, name: str) -> None:
    if name != state.model_name:
        raise BadRequestError(f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                              param="model", code="model_not_found")


async def _generate(state: AppState, http: Request, req: CompletionRequest | ChatRequest,
                    prepare: Prepare, *, chat: bool) -> Response:
    """Submit the request (``prepare``: plain data and a module-level function, so an engine in a process
    of its own can take it); answer with its whole result, or stream it as server-sent events."""
    worker = state.worker
    ticket = worker.submit(prepare, deltas=bool(req.stream))  # a whole answer needs no per-step events
    try:
        first = await ticket.next_event()
    except BaseException:
        worker.cancel(ticket)
        raise
    if isinstance(first, Rejected):
        raise first.error
    assert isinstance(first, Accepted)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        body = _stream(state, ticket, rid, chat=chat, include_usage=req.include_usage)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        done = await _wait_finished(ticket, http)
    finally:
        if not ticket.closed:
            worker.cancel(ticket)
    if done is None:  # the client went away
        return Response(status_code=499)
    if done.error is not None:
        raise done.error
    build = chat_response if chat else completion_response
    return JSONResponse(build(rid, state.model_name, done.text, done.stop_reason, done.prompt_tokens, done.completion_tokens))


async def _wait_finished(ticket: Ticket, http: Request) -> Finished | None:
    """The request's :class:`Finished` event, or None once its client has disconnected."""
    while True:
        try:
            event = await asyncio.wait_for(ticket.next_event(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return None
            continue
        if isinstance(event, Finished):
            return event


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _stream(state: AppState, ticket: Ticket, rid: str, *, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The request's server-sent events: a chunk per step that released text (the steps that arrived
    while the stream waited for the event loop, as one chunk), the finish reason, the usage
    (``include_usage``), ``[DONE]``. An error mid-stream is sent as an ``{"error": ...}`` event.
    Leaving early (the client disconnected) cancels the request."""
    model, created = state.model_name, int(time.time())
    try:
        if chat:
            yield _sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, with_usage=include_usage))
        ahead: Event | None = None  # an event read while gathering deltas, handled next
        while True:
            event = ahead if ahead is not None else await ticket.next_event()
            ahead = None
            if isinstance(event, Delta):
                # the steps that arrived while this stream waited for the loop go out as one chunk
                text = [event.text]
                while isinstance(ahead := ticket.next_ready(), Delta):
                    text.append(ahead.text)
                joined = "".join(text)
                if joined:
                    piece = chat_chunk(rid, model, created, {"content": joined}, with_usage=include_usage) if chat else \
                        completion_chunk(rid, model, created, joined, with_usage=include_usage)
                    yield _sse(piece)
                continue
            if isinstance(event, Finished):
                if event.error is not None:
                    yield _sse(event.error.body())
                else:
                    last = chat_chunk(rid, model, created, {}, event.stop_reason, with_usage=include_usage) if chat else \
                        completion_chunk(rid, model, created, "", event.stop_reason, with_usage=include_usage)
                    yield _sse(last)
                    if include_usage:
                        used = usage(event.prompt_tokens, event.completion_tokens)
                        build = chat_chunk if chat else completion_chunk
                        yield _sse(build(rid, model, created, None, usage_=used))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not ticket.closed:
            state.worker.cancel(ticket)
