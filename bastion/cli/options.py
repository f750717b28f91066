"""Model and component options shared by the commands that build a pipeline (``generate``, ``run``).

:func:`add_model_options` registers them on a sub-command's parser; :func:`build_pipeline` turns the
parsed namespace into a :class:`~bastion.Pipeline` (the embedded demo pair without ``--target`` and
``--drafter``).
"""

from __future__ import annotations

import argparse
from typing import Any

from bastion.core.dtypes import CLI_DTYPES as DTYPES

__all__ = ["DTYPES", "add_model_options", "build_pipeline"]


def add_model_options(p: argparse.ArgumentParser, *, device_default: str = "cpu") -> None:
    """``--target/--drafter``, the tree builder and budget, device, dtype and ``--device-map``."""
    g = p.add_argument_group("model and components")
    g.add_argument("--target", help="target model: local directory or hub id (default: the demo pair)")
    g.add_argument("--drafter", help="drafter: registered name, DFlash checkpoint dir or hub id (default: the demo pair)")
    g.add_argument("--tree-builder", default="best-first", help="registered tree builder (default best-first)")
    g.add_argument("--budget", type=int, default=None, help="verify a fixed number of tree nodes instead of the adaptive controller")
    g.add_argument("--max-nodes", type=int, default=64, help="largest tree the builder drafts (default 64)")
    g.add_argument("--device", default=device_default, help=f"cpu, cuda, cuda:N or auto (default {device_default})")
    g.add_argument("--dtype", choices=DTYPES, default="float32")
    g.add_argument(
        "--device-map",
        default=None,
        help="place the target with Hugging Face / accelerate (e.g. auto, balanced, cpu) instead of --device; "
        "'auto' across several devices needs the accelerate package",
    )


def build_pipeline(args: argparse.Namespace, *, device: Any = None) -> Any:
    """The pipeline ``args`` describe; ``device`` overrides ``args.device`` (a rank's own device)."""
    from bastion import registry
    from bastion.core.dtypes import parse_dtype
    from bastion.core.errors import InvalidInputError
    from bastion.core.pipeline import Pipeline

    if (args.target is None) != (args.drafter is None):
        raise InvalidInputError("pass both --target and --drafter, or neither for the demo pair")
    controller: Any = "bastion"
    if args.budget is not None:
        controller = registry.create("budget_controller", "fixed", budget=args.budget)
    kwargs: dict[str, Any] = dict(
        tree_builder=args.tree_builder,
        budget_controller=controller,
        device=args.device if device is None else device,
        dtype=parse_dtype(args.dtype),
        max_nodes=args.max_nodes,
    )
    if getattr(args, "device_map", None):
        kwargs["device_map"] = args.device_map
    if args.target is None:
        return Pipeline.demo(**kwargs)
    return Pipeline.from_pretrained(args.target, args.drafter, **kwargs)
