"""The target-model interface the pipeline and drafters depend on.

The built-in implementation for Hugging Face causal LMs is :class:`bastion.huggingface.causal_lm.HFTarget`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Sequence

import torch

from bastion.contract.tree import Tree
from bastion.contract.types import TargetOutput

if TYPE_CHECKING:
    from bastion.contract.batch_state import BatchPrefill, TargetBatch

__all__ = ["Target"]


class Target(abc.ABC):
    """A verifying model with its own KV cache of committed tokens."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def config(self) -> Any:
        """The model config (HF ``PretrainedConfig`` for HF targets); read by latency models."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abc.abstractmethod
    def max_positions(self) -> int:
        """Longest sequence (committed + tree) the model accepts."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    @abc.abstractmethod
    def context_len(self) -> int:
        """Tokens committed to the KV cache."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop the KV cache."""

    @abc.abstractmethod
    def prefill(
        self, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = (), *, all_logits: bool = False
    ) -> TargetOutput:
        """Run ``input_ids`` [1, L] into a fresh cache. Returns the last position's logits [1, V] (every
        position's [L, V] with ``all_logits=True``) and features [L, F] for every position."""

    @abc.abstractmethod
    def forward_tree(self, tree: Tree, feature_layers: tuple[int, ...] = ()) -> TargetOutput:
        """One forward over all tree nodes at positions ``context_len + depth`` with an ancestor-only
        mask. Returns logits [n, V] and features [n, F]. The cache temporarily holds all n nodes until
        :meth:`commit`."""

    @abc.abstractmethod
    def commit(self, accepted_nodes: torch.Tensor) -> None:
        """Keep the cache entries of ``accepted_nodes`` [m] (root first) and drop the other tree nodes."""

    @abc.abstractmethod
    def input_embeddings(self) -> torch.nn.Module:
        """The token embedding module (drafters that share it borrow it)."""

    @abc.abstractmethod
    def output_head(self) -> torch.nn.Module:
        """The lm head mapping final hidden states to logits."""

    def open_batch(
        self, prompts: Sequence[torch.Tensor], feature_layers: tuple[int, ...] = ()
    ) -> tuple["TargetBatch", "BatchPrefill"] | None:
        """Prefill several prompts (each LongTensor [L_i]) into one batched state -> (state, prefill),
        or ``None`` when this target decodes one sequence at a time (the default): the pipeline then
        decodes a batch row after row. Implementing it lets a batch share one forward per step."""
        return None

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def feature_device(self, feature_layers: tuple[int, ...] = ()) -> torch.device:
        """The device the features of ``feature_layers`` are returned on (a drafter reading them runs
        there). One-device targets return :attr:`device`; a target spread over devices returns the
        device of its deepest requested layer."""
        return self.device
