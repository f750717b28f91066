"""Log output of the command-line tools, through stdlib :mod:`logging`.

bastion's modules log on loggers under ``bastion`` (``bastion.dtype``, ``bastion.serve``, ...) and
install no handler themselves: a program that imports bastion decides what it shows. The ``bastion``
command calls :func:`configure_logging` once per run:

- no ``--log-level`` (the default): bastion's own warnings on stderr; the libraries' (transformers,
  torch, huggingface_hub) info, warnings and progress bars hidden, errors shown. ``--verbose`` shows their
  info logs and weight-loading progress bars too.
- ``--log-level LEVEL`` (``debug``, ``info``, ``warning``, ``error``): every logger, bastion's and the
  libraries', at that level, and Python warnings routed through logging (the ``py.warnings`` logger) at
  the same level (torch's own info lines, compiler statistics, only at ``debug``); progress bars at
  ``info`` and ``debug``.
"""

from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["LOG_LEVELS", "configure_logging", "request_level", "requested_level"]

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")

#: the libraries whose loggers the level applies to, beside bastion's own
_LIBRARIES: tuple[str, ...] = ("transformers", "torch", "huggingface_hub", "accelerate", "datasets", "urllib3", "filelock")
#: modules whose Python warnings the quiet default hides (their logs are hidden as well)
_QUIET_WARNING_MODULES: tuple[str, ...] = ("transformers", "torch", "huggingface_hub", "accelerate")

_requested: str | None = None
_HANDLER_NAME = "bastion-cli"


def request_level(level: str | None) -> None:
    """Remember the ``--log-level`` of this run (None: the quiet default) for :func:`configure_logging`."""
    global _requested
    if level is not None and level.lower() not in LOG_LEVELS:
        from bastion.contract.errors import InvalidInputError

        raise InvalidInputError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    _requested = None if level is None else level.lower()


def requested_level() -> str | None:
    """The ``--log-level`` of this run, or None."""
    return _requested


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on whatever ``sys.stderr`` is when a record is written (not the stream at setup)."""

    @property  # type: ignore[override]
    def stream(self):  # type: ignore[no-untyped-def]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # type: ignore[no-untyped-def]
        pass


def _handler(logger: logging.Logger, fmt: str) -> None:
    if any(getattr(h, "name", None) == _HANDLER_NAME for h in logger.handlers):
        return
    handler = _Stderr()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)


def configure_logging(level: str | None = None, *, verbose: bool = False) -> None:
    """Set what the command-line tools show (see the module docstring). ``level`` None takes the level
    :func:`request_level` remembered, if any."""
    level = (level or _requested or "").lower() or None
    if level is not None and level not in LOG_LEVELS:
        request_level(level)  # raises the error that names the levels
    own = logging.getLogger("bastion")
    _handler(own, "%(message)s")
    if level is None:
        libraries = logging.INFO if verbose else logging.ERROR
        own.setLevel(logging.INFO if verbose else logging.WARNING)
        progress = verbose
        if not verbose:
            for module in _QUIET_WARNING_MODULES:
                warnings.filterwarnings("ignore", module=module)
    else:
        libraries = getattr(logging, level.upper())
        own.setLevel(libraries)
        progress = libraries <= logging.INFO
        logging.captureWarnings(True)
        py_warnings = logging.getLogger("py.warnings")
        _handler(py_warnings, "%(message)s")
        py_warnings.setLevel(libraries)
    for name in _LIBRARIES:
        # torch's INFO lines are compiler statistics: shown at debug only
        chatty = name == "torch" and libraries == logging.INFO
        logging.getLogger(name).setLevel(logging.WARNING if chatty else libraries)
    _library_verbosity(libraries, progress)


def _library_verbosity(level: int, progress: bool) -> None:
    """transformers and huggingface_hub keep their own verbosity and progress-bar switches."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        hf_logging = None
    if hf_logging is not None:
        hf_logging.set_verbosity(level)
        (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        return
    (enable_progress_bars if progress else disable_progress_bars)()
