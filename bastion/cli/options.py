"""Command-line options shared by every command that builds a pipeline (generate, bench, run).

:func:`add_model_options` registers them on a sub-command's parser; :func:`build_pipeline` turns the
parsed namespace into a :class:`~bastion.Pipeline` (the embedded demo pair without ``--target`` and
``--drafter``). Every component kind is selectable by name with options::

    --target DIR|HUB_ID  --drafter NAME|DIR|HUB_ID  --drafter-option KEY=VALUE  --device-map MAP
    --tree-builder NAME  --tree-option [NAME.]KEY=VALUE
    --budget-controller NAME  --controller-option [NAME.]KEY=VALUE  --budget N (= fixed, budget=N)
    --latency-model NAME  --latency-option KEY=VALUE
    --verifier NAME  --verifier-option KEY=VALUE
    --max-nodes N  --device DEV  --dtype auto|float32|bfloat16|float16  --compile  --verbose

Option values are JSON (``k=3``, ``branching=[4,2,1]``, ``name=x`` as a plain string). An option
without ``NAME.`` belongs to the component chosen by the matching flag; ``NAME.KEY=VALUE`` names the
component it belongs to (bench pairs several builders and controllers in one run).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import attrs

from bastion.utils.dtypes import CLI_DTYPES

__all__ = [
    "DEVICE_DEFAULT",
    "DTYPES",
    "ComponentChoice",
    "add_component_arguments",
    "add_model_arguments",
    "add_model_options",
    "add_verbose_argument",
    "build_pipeline",
    "component_choices",
    "configure_output",
    "option_value",
    "parse_option",
    "pipeline_kwargs",
    "resolve_cli_device",
    "set_threads",
    "generation_settings",
    "torch_dtype",
]

DTYPES: tuple[str, ...] = ("auto", *CLI_DTYPES)

#: (flag stem, component kind, default name, options flag)
_KINDS: tuple[tuple[str, str, str, str], ...] = (
    ("tree_builder", "tree_builder", "best-first", "tree_option"),
    ("budget_controller", "budget_controller", "bastion", "controller_option"),
    ("latency_model", "latency_model", "roofline", "latency_option"),
    ("verifier", "verifier", "exact", "verifier_option"),
)


def option_value(raw: str) -> Any:
    """A JSON value, or the text itself when it is not JSON (``name=fast`` -> ``"fast"``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_option(text: str) -> tuple[str | None, str, Any]:
    """``[NAME.]KEY=VALUE`` -> (NAME or None, KEY, JSON value)."""
    key, sep, raw = text.partition("=")
    owner, dot, opt = key.rpartition(".")
    if not sep or not opt or (dot and not owner):
        raise argparse.ArgumentTypeError(f"expected [NAME.]KEY=VALUE (e.g. k=3 or static.branching=[4,2,1]), got {text!r}")
    return (owner or None), opt.strip(), option_value(raw)


def _plain_option(text: str) -> tuple[None, str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return None, key.strip(), option_value(raw)


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's CPU threads, an int >= 1 (None: torch's choice); the one rule of every
    command (generate, run, bench, train)."""
    from bastion.training.loop import set_threads as apply

    apply(threads)


#: the command-line spelling of each generation setting
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
          "seed": "--seed", "stop": "--stop"}


def generation_settings(args: argparse.Namespace, *, names: tuple[str, ...] = tuple(_FLAGS)) -> Any:
    """The generation settings of the command line (``--max-new-tokens``, ``--temperature``, ``--top-p``,
    ``--top-k``, ``--seed``, ``--stop``, those of ``names`` the command has) as one
    :class:`~bastion.GenerationConfig`, checked by the rule every path applies
    (:func:`bastion.engine.params.check_setting`) before any model loads; a bad value raises
    :class:`~bastion.contract.errors.InvalidInputError` naming the option."""
    from bastion.contract.errors import InvalidInputError
    from bastion.engine.params import GenerationConfig, SamplingParams, check_setting

    values: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if name == "stop" and isinstance(value, list) and not value:
            value = None  # no --stop given
        if value is None:
            continue
        try:
            values[name] = check_setting(name, value)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{_FLAGS[name]}: {exc}") from None
    sampling = SamplingParams(**{k: values.pop(k) for k in ("temperature", "top_p", "top_k", "seed") if k in values})
    return GenerationConfig(sampling=sampling, **values)


#: the --device default of every command that builds a pipeline (generate, bench, run, serve)
DEVICE_DEFAULT = "auto"


def resolve_cli_device(name: str) -> str:
    """A --device value as a device name: ``auto`` is ``cuda`` when CUDA is available, else ``cpu``."""
    if str(name) != "auto":
        return str(name)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_arguments(p: argparse.ArgumentParser, *, device_default: str = DEVICE_DEFAULT) -> None:
    """--target, --drafter, --drafter-option, --device, --dtype, --device-map, --compile."""
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: local directory or hub id (default: the demo pair)")
    g.add_argument("--drafter", help="drafter: registered name, checkpoint dir or hub id; without --target, dflash "
                   "(default) or model picks the demo pair's block or autoregressive drafter")
    g.add_argument("--drafter-option", type=_plain_option, action="append", default=[], metavar="KEY=VALUE",
                   help="option for a drafter given by name, JSON value (repeatable)")
    g.add_argument("--device", default=device_default,
                   help="cpu, cuda, cuda:N, mps or auto (default auto: cuda when CUDA is available, else cpu)"
                   if device_default == "auto" else f"cpu, cuda, cuda:N, mps or auto (default {device_default})")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype (default auto: the checkpoint's; the demo pair runs float32 on the CPU)")
    g.add_argument(
        "--device-map",
        default=None,
        help="place the target with Hugging Face / accelerate (e.g. auto, balanced, cpu) instead of --device; "
        "'auto' across several devices needs the accelerate package",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="compiled verify path: torch.compile per tree-size bucket (CUDA graphs on CUDA); off by default "
        "until measured on your hardware (see the device check)",
    )


def add_component_arguments(p: argparse.ArgumentParser) -> None:
    """--tree-builder/--tree-option, --budget-controller/--controller-option/--budget,
    --latency-model/--latency-option, --verifier/--verifier-option, --max-nodes."""
    g = p.add_argument_group("components (see `bastion plugins` for the registered names)")
    g.add_argument("--tree-builder", default=None, metavar="NAME", help="tree builder (default best-first)")
    g.add_argument("--tree-option", type=parse_option, action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="tree builder option, JSON value (repeatable), e.g. branching=[4,2,1]")
    g.add_argument("--budget-controller", default=None, metavar="NAME", help="budget controller (default bastion)")
    g.add_argument("--controller-option", type=parse_option, action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="budget controller option, JSON value (repeatable)")
    g.add_argument("--budget", type=int, default=None,
                   help="verify a fixed number of tree nodes (the fixed controller) instead of the adaptive one")
    g.add_argument("--latency-model", default="roofline", metavar="NAME", help="latency model (default roofline)")
    g.add_argument("--latency-option", type=parse_option, action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="latency model option, JSON value (repeatable)")
    g.add_argument("--verifier", default="exact", metavar="NAME", help="verifier (default exact)")
    g.add_argument("--verifier-option", type=parse_option, action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="verifier option, JSON value (repeatable)")
    g.add_argument("--max-nodes", type=int, default=64, help="largest tree the builder drafts (default 64)")


def add_verbose_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show library logs and weight-loading progress bars")


def add_model_options(p: argparse.ArgumentParser, *, device_default: str = DEVICE_DEFAULT) -> None:
    """Everything a command needs to build a pipeline: models, components and --verbose."""
    add_model_arguments(p, device_default=device_default)
    add_component_arguments(p)
    add_verbose_argument(p)


@attrs.frozen
class ComponentChoice:
    """One component kind as the command line chose it: its name and options per component name."""

    kind: str
    name: str
    options: dict[str, dict[str, Any]] = attrs.field(factory=dict)  # component name -> {key: value}

    def options_for(self, name: str | None = None) -> dict[str, Any]:
        return dict(self.options.get(name or self.name, {}))


def component_choices(args: argparse.Namespace) -> dict[str, ComponentChoice]:
    """The chosen name and options of each component kind (drafter excluded), keyed by kind."""
    from bastion.contract.errors import InvalidInputError

    controller = args.budget_controller
    if args.budget is not None:
        if controller not in (None, "fixed"):
            raise InvalidInputError(f"--budget selects the fixed controller; it cannot be combined with --budget-controller {controller}")
        controller = "fixed"
    chosen = {"tree_builder": args.tree_builder or "best-first", "budget_controller": controller or "bastion",
              "latency_model": args.latency_model, "verifier": args.verifier}
    out: dict[str, ComponentChoice] = {}
    for attr, kind, _default, opt_attr in _KINDS:
        name = chosen[attr]
        options: dict[str, dict[str, Any]] = {}
        for owner, key, value in getattr(args, opt_attr, []):
            options.setdefault(owner or name, {})[key] = value
        out[kind] = ComponentChoice(kind, name, options)
    if args.budget is not None:
        out["budget_controller"].options.setdefault("fixed", {})["budget"] = args.budget
    return out


def torch_dtype(name: str) -> Any:
    """``"auto"`` or a torch dtype for a --dtype value."""
    from bastion.utils.dtypes import parse_dtype

    return "auto" if name == "auto" else parse_dtype(name)


def pipeline_kwargs(args: argparse.Namespace, *, components: bool = True) -> dict[str, Any]:
    """Keyword arguments of :meth:`bastion.Pipeline.from_pretrained` (and ``demo``) for the parsed
    model and component options. Options qualified with a name other than the chosen component's are an
    error (nothing would use them). With ``components=False`` only the models and drafter options."""
    from bastion.contract.errors import InvalidInputError

    drafter_opts = {key: value for _, key, value in args.drafter_option}
    models: dict[str, Any] = dict(device=resolve_cli_device(args.device), dtype=torch_dtype(args.dtype))
    if getattr(args, "device_map", None):
        models["device_map"] = args.device_map
    if getattr(args, "compile", False):
        models["compile"] = True
    if not components:
        return {**models, "component_options": {"drafter": drafter_opts} if drafter_opts else None}
    choices = component_choices(args)
    component_options: dict[str, dict[str, Any]] = {}
    for kind, choice in choices.items():
        stray = sorted(set(choice.options) - {choice.name})
        if stray:
            raise InvalidInputError(
                f"{kind.replace('_', ' ')} options for {', '.join(stray)}, but the {kind.replace('_', ' ')} is {choice.name}"
            )
        if choice.options_for():
            component_options[kind] = choice.options_for()
    if drafter_opts:
        component_options["drafter"] = drafter_opts
    return dict(
        models,
        tree_builder=choices["tree_builder"].name,
        budget_controller=choices["budget_controller"].name,
        latency_model=choices["latency_model"].name,
        verifier=choices["verifier"].name,
        max_nodes=args.max_nodes,
        component_options=component_options,
    )


def build_pipeline(args: argparse.Namespace, *, device: Any = None, components: bool = True) -> Any:
    """The pipeline ``args`` describe (the demo pair without --target/--drafter; --drafter alone pairs a
    drafter with the demo target); ``device`` overrides ``args.device`` (a rank's own device). With
    ``components=False`` only the models (and drafter options) come from ``args`` and the other components
    are the defaults: for commands that assemble several pipelines around one loaded pair."""
    from bastion.contract.errors import InvalidInputError
    from bastion.engine.pipeline import Pipeline

    target, drafter = getattr(args, "target", None), getattr(args, "drafter", None)
    kwargs = pipeline_kwargs(args, components=components)
    if device is not None:
        kwargs["device"] = device
    from bastion.demo import DEMO_DRAFTERS

    if target is None and (drafter is None or drafter in DEMO_DRAFTERS):
        if kwargs["dtype"] == "auto":
            del kwargs["dtype"]  # the demo pair's own default
        return Pipeline.demo(drafter=drafter or "dflash", **kwargs)
    if target is None:
        from bastion.demo import demo_paths

        target = str(demo_paths().target)  # a drafter for the demo target (e.g. a plugin drafter)
    if drafter is None:
        raise InvalidInputError("--target needs a --drafter (a registered drafter name, or a checkpoint dir or hub id)")
    return Pipeline.from_pretrained(target, drafter, **kwargs)


def configure_output(verbose: bool) -> None:
    """Quiet by default: library warnings, info logs and weight-loading progress bars only with --verbose
    or a ``--log-level`` (``bastion --log-level info ...``); see :mod:`bastion.utils.logs`."""
    from bastion.utils.logs import configure_logging

    configure_logging(verbose=verbose)
