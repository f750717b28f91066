"""Checks on what components hand back and on user-facing values, in one place.

Each check raises one of the project's errors (:mod:`bastion.contract.errors`) whose message names the
component or the value at fault. Input values: ``check_int`` and ``check_number`` return the checked
value; the ``attrs`` validators ``positive_int``, ``optional_positive_int``, ``positive_number`` and
``finite_non_negative`` take ``(instance, attribute, value)`` and name the field. The per-step checks are cheap: a few host comparisons on values the pipeline holds
on the host already, plus one transfer of ``2 m`` integers for an ``m``-node accepted path.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Mapping

import torch

from bastion.contract.errors import ComponentError, IncompatibleComponentsError, InvalidInputError, TreeValidationError
from bastion.contract.interfaces import BudgetDecision
from bastion.utils.sync import to_host
from bastion.contract.tree import Tree
from bastion.contract.types import Marginals, Verdict

__all__ = [
    "check_built_tree",
    "check_decision",
    "options_object",
    "check_int",
    "check_number",
    "positive_int",
    "optional_positive_int",
    "positive_number",
    "finite_non_negative",
    "SEED_LIMIT",
    "check_seed",
    "check_device",
    "check_max_nodes",
    "check_marginals",
    "check_verdict",
    "check_greedy_verdict",
    "predict_checked",
    "predict_batch_checked",
    "check_tokenizer",
    "check_token_ids",
]

#: seeds are integers in [0, SEED_LIMIT)
SEED_LIMIT = 2**64


def _name(component: object) -> str:
    return type(component).__name__


def check_seed(seed: object, *, name: str = "seed") -> int:
    """``seed`` as a Python int in [0, 2**64); floats, bools and out-of-range values raise
    :class:`InvalidInputError`."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidInputError(f"{name} must be an int in [0, 2**64), got {seed!r} ({type(seed).__name__})")
    value = int(seed)
    if not 0 <= value < SEED_LIMIT:
        raise InvalidInputError(f"{name} must be an int in [0, 2**64), got {value}")
    return value


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this process can use: an unknown name, or a CUDA / MPS device on
    a build or machine without one, raises :class:`InvalidInputError` saying what to use instead."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"unknown device {device!r} (use cpu, cuda, cuda:N or mps)") from exc
    if dev.type == "meta":
        raise InvalidInputError(f"device {device!r} holds no data and cannot decode; use cpu, cuda, cuda:N or mps")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"device {device!r}: this torch build or machine has no CUDA device; use device=\"cpu\" "
                "(--device cpu on the command line)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidInputError(
            f"device {device!r}: MPS is not available here; use device=\"cpu\" (--device cpu on the command line)"
        )
    return dev


def check_max_nodes(max_nodes: int, target: Any) -> int:
    """``max_nodes`` bounded by what ``target`` can verify: at most its positions (every tree node takes a
    cache slot, so a larger value is the same as the positions: it is capped there), and a verify step's
    tree mask (``max_nodes x (positions + max_nodes)`` in the target's dtype) and logits (``max_nodes x
    vocab`` floats) within the memory of the target's device. Fails at construction, naming the field and
    the memory it would need, instead of allocating at the first step."""
    positions = int(getattr(target, "max_positions", 0) or 0)
    if positions > 1:
        max_nodes = min(max_nodes, positions)
    try:
        itemsize = torch.empty((), dtype=target.dtype).element_size()
        vocab = int(target.vocab_size)
        device = torch.device(target.device)
    except Exception:  # a plugin target without these properties: positions were all we could check
        return max_nodes
    need = max_nodes * (positions + max_nodes) * itemsize + max_nodes * vocab * 4
    limit = _device_memory(device)
    if limit is not None and need > limit:
        raise InvalidInputError(
            f"max_nodes={max_nodes} would need {need / 1e9:.3g} GB per verify step at the target's {positions} "
            f"positions (max_position_embeddings): a {max_nodes} x {positions + max_nodes} tree mask and "
            f"{max_nodes} x {vocab} logits, more than the {limit / 1e9:.3g} GB of {device.type} memory; use a "
            "smaller max_nodes"
        )
    return max_nodes


def _device_memory(device: torch.device) -> int | None:
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        from bastion.huggingface.configs import physical_memory

        return physical_memory()
    return None


def check_marginals(marginals: Any, vocab_size: int, drafter: object) -> Marginals:
    """What :meth:`Drafter.propose` returned must be :class:`Marginals` over the target's vocabulary."""
    if not isinstance(marginals, Marginals):
        raise ComponentError(
            f"drafter {_name(drafter)}.propose returned {type(marginals).__name__}; it must return "
            "bastion.core.Marginals or bastion.core.CandidateTree"
        )
    if marginals.vocab_size != vocab_size:
        raise IncompatibleComponentsError(
            f"drafter {_name(drafter)} proposed marginals over {marginals.vocab_size} tokens but the target's "
            f"vocabulary has {vocab_size}"
        )
    return marginals


def check_next_tokens(tokens: Any, rows: int, vocab_size: int, verifier: object) -> list[int]:
    """A verifier's plain-step answer (:meth:`Verifier.next_tokens`): one token id inside the vocabulary
    per row. Returns them as a host list of ints."""
    who = f"verifier {_name(verifier)}"
    got = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    if not isinstance(got, (list, tuple)) or len(got) != rows:
        raise ComponentError(f"{who}: next_tokens must return one token per row ({rows}), got {tokens!r}")
    out = []
    for tok in got:
        # a host list of ints is the usual answer: the ABC check only for other integer types
        if type(tok) is not int and (isinstance(tok, bool) or not isinstance(tok, numbers.Integral)) or not 0 <= int(tok) < vocab_size:
            raise ComponentError(f"{who}: next token {tok!r} is not a token id in the vocabulary [0, {vocab_size})")
        out.append(int(tok))
    return out


def check_verdict(verdict: Any, tree: Tree, vocab_size: int, verifier: object) -> list[int]:
    """The accepted nodes of ``verdict`` must be a parent chain from the root of ``tree``, its accepted
    tokens the nodes' tokens, and its bonus token inside the vocabulary. Returns the nodes (host list).
    Reads the tree's host copy (:meth:`Tree.on_host`), so it costs no device transfer."""
    who = f"verifier {_name(verifier)}"
    if not isinstance(verdict, Verdict):
        raise ComponentError(f"{who} returned {type(verdict).__name__}; it must return bastion.core.Verdict")
    nodes_t = verdict.accepted_nodes
    if not isinstance(nodes_t, torch.Tensor) or nodes_t.dim() != 1 or nodes_t.dtype not in (torch.long, torch.int32, torch.int):
        raise ComponentError(f"{who}: accepted_nodes must be a 1-D integer tensor, got {getattr(nodes_t, 'shape', nodes_t)!r}")
    nodes = nodes_t.tolist() if nodes_t.device.type == "cpu" else to_host(nodes_t, "verdict nodes")
    n = len(tree)
    if not nodes or nodes[0] != 0:
        raise ComponentError(f"{who}: the accepted path must start at the root (node 0), got {nodes}")
    if len(nodes) != len(verdict.accepted_tokens) + 1:
        raise ComponentError(
            f"{who}: {len(nodes)} accepted nodes (root included) but {len(verdict.accepted_tokens)} accepted tokens"
        )
    if any(not 0 <= i < n for i in nodes):
        raise ComponentError(f"{who}: accepted nodes {nodes} lie outside the tree's {n} nodes")
    if not 0 <= verdict.bonus_token < vocab_size:
        raise ComponentError(f"{who}: bonus token {verdict.bonus_token} lies outside the vocabulary [0, {vocab_size})")
    if len(nodes) > 1:
        host = tree.on_host()  # the builder's host copy: no device read
        parents = [host.parents[i] for i in nodes[1:]]
        tokens = [host.tokens[i] for i in nodes[1:]]
        for prev, node, parent in zip(nodes, nodes[1:], parents):
            if parent != prev:
                raise ComponentError(
                    f"{who}: accepted node {node} is not a child of node {prev} (its parent is {parent}); the "
                    f"accepted nodes must form one root-to-node path"
                )
        if tuple(tokens) != tuple(verdict.accepted_tokens):
            raise ComponentError(
                f"{who}: accepted tokens {list(verdict.accepted_tokens)} differ from the tokens {tokens} of the "
                f"accepted nodes {nodes[1:]}"
            )
    return nodes


def check_greedy_verdict(verdict: Verdict, tree: Tree, logits: torch.Tensor, verifier: object) -> None:
    """Strict check of a greedy verdict against the target's argmax: every accepted node's token is the
    argmax at its parent and the bonus token is the argmax at the last node (stopping early stays
    allowed: it is lossless, only slower). One extra transfer of ``n`` integers."""
    who = f"verifier {_name(verifier)}"
    best = to_host(logits.argmax(dim=-1), "strict greedy check")  # [n]; opt-in, one extra read
    nodes = verdict.accepted_nodes.tolist()
    tokens = list(tree.on_host().tokens)
    for prev, node in zip(nodes, nodes[1:]):
        if tokens[node] != best[prev]:
            raise ComponentError(
                f"{who} accepted node {node} (token {tokens[node]}) but the target's argmax after node {prev} is {best[prev]}"
            )
    last = nodes[-1]
    if verdict.bonus_token != best[last]:
        raise ComponentError(f"{who}: bonus token {verdict.bonus_token} is not the target's argmax {best[last]} after node {last}")


def predict_checked(latency: Any, n_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
    """A single sequence's ``latency.predict_batch(n_tokens, [context_len])`` as a float64 CPU tensor
    ``[N]``, checked: one finite, positive number of seconds per size, else :class:`ComponentError`
    naming the model."""
    times = latency.predict_batch(n_tokens, [int(context_len)])
    return _checked_times(latency, "predict_batch", times, n_tokens, f"context {context_len}")


def predict_batch_checked(latency: Any, widths: torch.Tensor, context_lens: Any) -> torch.Tensor:
    """``latency.predict_batch(widths, context_lens)``, checked like :func:`predict_checked`."""
    times = latency.predict_batch(widths, context_lens)
    return _checked_times(latency, "predict_batch", times, widths, f"a batch of {len(context_lens)} rows")


def _checked_times(latency: Any, method: str, times: Any, n_tokens: torch.Tensor, where: str) -> torch.Tensor:
    who = f"latency model {_name(latency)}"
    if not isinstance(times, torch.Tensor) or tuple(times.shape) != tuple(n_tokens.shape):
        raise ComponentError(
            f"{who}.{method} returned {getattr(times, 'shape', type(times).__name__)}; expected a tensor of "
            f"shape {tuple(n_tokens.shape)}"
        )
    times = times.detach().to("cpu", torch.float64)
    # on host floats: a controller asks for a few dozen sizes every step, fewer than one NumPy call costs
    bad = [i for i, v in enumerate(times.tolist()) if not 0.0 < v < math.inf]  # NaN fails both comparisons
    if bad:
        i = bad[0]
        raise ComponentError(
            f"{who} predicted {float(times[i])!r} s for {int(n_tokens[i])} tokens at {where}; "
            "predictions must be finite and > 0"
        )
    return times


def check_tokenizer(tokenizer: Any, vocab_size: int, source: str) -> None:
    """A tokenizer must produce ids inside the target's vocabulary and must not encode text to nothing."""
    probe = "Hello, world! 123"
    try:
        ids = list(tokenizer.encode(probe, add_special_tokens=False))
    except Exception as exc:  # tokenizers raise many types
        raise IncompatibleComponentsError(f"the tokenizer of {source} cannot encode text: {exc}") from exc
    if not ids:
        raise IncompatibleComponentsError(f"the tokenizer of {source} encodes text to no tokens (an empty vocabulary?)")
    if max(ids) >= vocab_size or min(ids) < 0:
        raise IncompatibleComponentsError(
            f"the tokenizer of {source} produces ids up to {max(ids)}, outside the target's vocabulary [0, {vocab_size})"
        )


# ---------------------------------------------------------------------------------------------- input values
def check_token_ids(tokens: Any, vocab_size: int, *, name: str = "tokens") -> list[int]:
    """``tokens`` (a sequence of ints or a 1-D integer tensor) as a list of ints inside the vocabulary
    ``[0, vocab_size)``; floats, bools, strings and ids outside it raise :class:`InvalidInputError`
    naming ``name`` and the first bad id (a tokenizer decodes an unknown id to nothing, silently)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() > 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise InvalidInputError(f"{name} must be a 1-D integer tensor or a list of ints, got {tokens.dtype} {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise InvalidInputError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}")
    out = []
    for k, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise InvalidInputError(f"{name}[{k}] must be an int token id, got {tok!r} ({type(tok).__name__})")
        if not 0 <= int(tok) < vocab_size:
            raise InvalidInputError(f"{name}[{k}] = {int(tok)} lies outside the vocabulary [0, {vocab_size})")
        out.append(int(tok))
    return out


def check_int(name: str, value: object, *, low: int | None = 1, optional: bool = False) -> Any:
    """``value`` as an int >= ``low`` (no bound when ``low`` is None). Integer-like values (numpy
    ints) are accepted, bools and floats are not. With ``optional`` None passes through."""
    if value is None and optional:
        return None
    bound = "" if low is None else f" >= {low}"
    none = " or None" if optional else ""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an int{bound}{none}, got a bool ({value!r})")
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(f"{name} must be an int{bound}{none}, got {value!r} ({type(value).__name__})") from None
    if low is not None and out < low:
        raise InvalidInputError(f"{name} must be an int{bound}{none}, got {out}")
    return out


def check_number(name: str, value: object, *, low: float = 0.0, strict: bool = False) -> float:
    """``value`` as a finite float >= ``low`` (> ``low`` when ``strict``); bools are refused."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        out = float(value)  # type: ignore[arg-type]
        if out > low or (out == low and not strict):
            return out
    raise InvalidInputError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")


def _field(attribute: Any) -> str:
    return str(getattr(attribute, "name", "value"))


def positive_int(_inst: object, attribute: Any, value: object) -> None:
    """attrs validator: an int >= 1."""
    check_int(_field(attribute), value)


def optional_positive_int(_inst: object, attribute: Any, value: object) -> None:
    """attrs validator: None or an int >= 1."""
    check_int(_field(attribute), value, optional=True)


def positive_number(_inst: object, attribute: Any, value: object) -> None:
    """attrs validator: a finite number > 0."""
    check_number(_field(attribute), value, strict=True)


def finite_non_negative(_inst: object, attribute: Any, value: object) -> None:
    """attrs validator: a finite number >= 0."""
    check_number(_field(attribute), value)


def options_object(name: str, value: Any, cls: type) -> Any:
    """``True`` -> ``cls()``, a mapping -> ``cls(**mapping)``, an instance as is, ``False``/``None`` -> None
    (unknown option names raise :class:`InvalidInputError`)."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**dict(value))
        except TypeError as exc:
            raise InvalidInputError(f"{name}: unknown {cls.__name__} option ({exc})") from None
    raise InvalidInputError(f"{name} must be a bool, a mapping of {cls.__name__} options or a {cls.__name__}, got {value!r}")


def check_built_tree(tree: Tree, root: int, vocab_size: int, max_nodes: int | None = None, builder: object = None) -> None:
    """A tree builder's output for one step: a valid tree over the vocabulary, at most ``max_nodes``
    nodes, rooted at ``root`` (:class:`TreeValidationError` otherwise). With ``builder`` (the component
    that built it) the message names it: ``tree_builder WrongRoot.build (plugin ...) built an invalid
    tree: ...``."""
    try:
        tree.validate(vocab_size=vocab_size)
        if max_nodes is not None and len(tree) > max_nodes:
            raise TreeValidationError(f"the tree has {len(tree)} nodes; the step allows at most max_nodes = {max_nodes}")
        if int(tree.tokens[0]) != root:
            raise TreeValidationError(f"root first: node 0 holds token {int(tree.tokens[0])}, expected the root {root}")
    except TreeValidationError as exc:
        if builder is None:
            raise
        from bastion.engine.blame import plugin_of
        from bastion.contract.registry import registry

        raise TreeValidationError(
            f"tree_builder {type(builder).__name__}.build (plugin {plugin_of(builder, registry)}) built an invalid tree: {exc}"
        ) from exc


def check_decision(
    controller: object, decision: object, n_max: int, *, method: str = "decide", error: type[Exception] = InvalidInputError
) -> int:
    """The size (or batch width) of a controller's decision, checked against 1 <= n <= n_max; raises
    ``error`` naming the controller and ``method`` otherwise."""
    name = type(controller).__name__
    if not isinstance(decision, BudgetDecision):
        raise error(f"budget controller {name}.{method} returned {type(decision).__name__}, not a BudgetDecision")
    n = decision.n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= n_max:
        raise error(f"budget controller {name} returned {n!r}; need 1 <= n <= {n_max}")
    return n
