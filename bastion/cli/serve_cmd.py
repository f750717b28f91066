"""``bastion serve``: an OpenAI-compatible HTTP server over one continuously batched engine.

Without --target/--drafter it serves the embedded demo pair. Every model and component option of
``bastion generate`` applies (``--budget-controller plain`` serves with speculation off, ``--budget N``
at a fixed tree width). Startup prints the address, the bastion version and the folder it was imported
from (which checkout serves, when several are side by side), and the loaded components to stderr;
SIGTERM drains (new requests get 503, accepted ones finish within --drain-timeout) and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from bastion.cli.options import add_model_options, build_pipeline, configure_output

#: the name clients address the embedded demo pair by
DEMO_MODEL_NAME = "bastion-demo"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a pipeline over an OpenAI-compatible HTTP API (default: the embedded demo pair)",
        description=(
            "Serve /v1/completions, /v1/chat/completions (streamed or not), /v1/models, /health and /metrics "
            "from one engine whose running batch shares one tree budget per step. Without --target/--drafter "
            "the embedded demo pair is served. Needs the serve extra: pip install 'bastion[serve]'."
        ),
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    g.add_argument("--max-running", type=int, default=32, help="most requests decoding in one batch (default 32)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="most requests waiting beyond the batch's free rows; more get 503 with Retry-After (default 256)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a SIGTERM waits for accepted requests to finish before cancelling them (default 30)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the target's name; bastion-demo for the demo pair)")
    g.add_argument("--prefill-tokens", type=int, default=2048,
                   help="most prompt tokens prefilled per engine step, so long prompts do not stall decoding rows "
                   "(a longer prompt is admitted alone; default 2048)")
    g.add_argument("--prefill-chunk", type=int, default=256,
                   help="prefill a prompt longer than this in chunks of this many tokens, one per engine step beside the "
                   "decoding rows, so it stalls them by one chunk at a time (0: whole prompts at once; default 256)")
    g.add_argument("--chat-max-tokens", type=int, default=256,
                   help="the longest chat answer for requests without max_tokens (default 256)")
    g.add_argument("--engine", choices=("process", "thread"), default="process",
                   help="where the engine runs: a process of its own, so the HTTP front end never holds its interpreter "
                   "lock (default), or a thread of the server's process")
    add_model_options(p)
    p.set_defaults(func=run)
    return p


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the target's name: a hub id as given, a directory's own name, or
    ``bastion-demo`` for the embedded demo pair."""
    if args.served_model_name:
        return str(args.served_model_name)
    if not args.target:
        return DEMO_MODEL_NAME
    path = Path(args.target)
    return path.name if path.exists() else str(args.target)


def components_line(names: dict[str, str]) -> str:
    """The loaded components (:func:`~bastion.serve.process.component_names`), one ``kind=Class`` each."""
    return "  ".join(f"{k}={v}" for k, v in names.items())


def serve_pipeline(args: argparse.Namespace) -> Any:
    """The pipeline ``args`` describe, with the run's output settings: what the engine process calls
    (a fresh interpreter, so the log level and quiet output are set again there)."""
    from bastion.utils.logs import configure_logging, request_level

    request_level(getattr(args, "log_level", None))
    if getattr(args, "log_level", None) is not None:
        configure_logging()
    configure_output(args.verbose)
    return build_pipeline(args)


def run(args: argparse.Namespace) -> int:
    from bastion.contract.errors import InvalidInputError

    try:
        from bastion.serve import BastionServer, ServeSettings
        from bastion.serve.process import EngineStartError, engine_info
    except ImportError as exc:  # the serve extra is not installed
        raise InvalidInputError(f"bastion serve needs the serve extra ({exc.name} is missing): pip install 'bastion[serve]'") from None
    configure_output(args.verbose)
    settings = ServeSettings(
        host=args.host, port=args.port, max_running=args.max_running, max_queue=args.max_queue,
        drain_timeout=args.drain_timeout, model_name=served_model_name(args), chat_max_tokens=args.chat_max_tokens,
        prefill_tokens=args.prefill_tokens, prefill_chunk=args.prefill_chunk or None, log_level=_server_log_level(args.verbose),
    )  # checked before any model loads
    if args.engine == "thread":
        pipe = build_pipeline(args)
        server = BastionServer(pipe, settings)
        loaded = engine_info(pipe)
    else:
        try:
            server = BastionServer.spawn(functools.partial(serve_pipeline, args), settings)
        except EngineStartError as exc:
            if exc.bad_input:  # e.g. a target without a drafter: said as the thread engine would say it
                raise InvalidInputError(str(exc)) from None
            raise
        loaded = server.worker.info
    target = args.target or "the demo pair"
    print(f"bastion serve: {settings.model_name} ({target}) on {server.url}/v1  "
          f"[max-running {settings.max_running}, max-queue {settings.max_queue}, engine {args.engine}]  "
          f"bastion {loaded['version']} from {loaded['folder']}", file=sys.stderr)
    print(f"bastion serve: {components_line(loaded['components'])}", file=sys.stderr, flush=True)
    code = server.run()
    print(f"bastion serve: stopped (drained in {server.drained_in or 0.0:.2f} s)", file=sys.stderr, flush=True)
    return code


def _server_log_level(verbose: bool) -> str:
    """The web server's log level: the run's --log-level when given, else info with --verbose."""
    from bastion.utils.logs import requested_level

    return requested_level() or ("info" if verbose else "warning")
