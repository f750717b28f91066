"""A small facade over ``torch.distributed`` for commands launched by ``torchrun``.

``torchrun --nproc-per-node N -m bastion ...`` starts N processes and tells each its place through the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). :func:`setup`
reads it, joins the process group (gloo on CPU, NCCL on CUDA) and returns a :class:`DistContext`; a
plain ``python -m bastion ...`` run gets a one-process context and never touches ``torch.distributed``,
so every command works the same with and without the launcher. Multi-node runs go through torchrun's own
rendezvous; nothing here opens sockets or spawns processes.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError

__all__ = ["DistContext", "env_ranks", "resolve_device", "setup", "teardown", "shard", "gather_objects", "broadcast_object", "barrier"]

T = TypeVar("T")


@frozen
class DistContext:
    """Where this process stands in a (possibly one-process) data-parallel run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(factory=lambda: torch.device("cpu"), eq=False)
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is up (world size > 1)."""
        return self.backend is not None


def env_ranks(environ: Any = None) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the torchrun environment; ``(0, 1, 0)`` without one."""
    env = os.environ if environ is None else environ
    try:
        rank = int(env.get("RANK", 0))
        world = int(env.get("WORLD_SIZE", 1))
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise InvalidInputError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {exc}") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise InvalidInputError(f"inconsistent launcher environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}")
    return rank, world, local


def resolve_device(device: str | torch.device | None, local_rank: int = 0) -> torch.device:
    """The device of this process: ``"auto"``/None picks CUDA when present; a bare ``"cuda"`` becomes
    ``cuda:LOCAL_RANK`` so every process of a node gets its own GPU."""
    name = "auto" if device is None else str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(f"device {name!r} asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def setup(device: str | torch.device | None = "cpu", *, environ: Any = None) -> DistContext:
    """Join the launcher's process group (if any) and pick this process's device."""
    rank, world, local = env_ranks(environ)
    dev = resolve_device(device, local)
    if world == 1:
        return DistContext(0, 1, 0, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(rank, world, local, dev, backend)


def teardown(ctx: DistContext) -> None:
    """Leave the process group (no-op for a one-process context).

    On a normal exit the ranks first meet at a barrier, so none tears its connections down while another
    still has traffic in flight on them: with gloo, a rank that destroyed its group and exited while its
    peer was still finishing aborted the peer now and then (``terminate called without an active
    exception``). Called while an exception propagates (from a ``finally`` block), it leaves at once: a
    failing rank must not wait for peers that are still working, and the launcher stops them when it
    exits."""
    if ctx.distributed and dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op for one process)."""
    if ctx.distributed:
        dist.barrier()


def shard(items: Sequence[T], ctx: DistContext) -> list[T]:
    """This rank's share of ``items``: every ``world_size``-th item starting at ``rank``."""
    return list(items[ctx.rank :: ctx.world_size])


def gather_objects(obj: T, ctx: DistContext) -> list[T] | None:
    """Every rank's ``obj`` in rank order on rank 0 (None on the other ranks); ``[obj]`` for one process."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: T, ctx: DistContext) -> T:
    """Rank 0's ``obj`` on every rank (the other ranks' ``obj`` is ignored); ``obj`` for one process."""
    if not ctx.distributed:
        return obj
    box: list[Any] = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    return box[0]
