"""Drafters that need no training, for tests, examples and benchmarks of the decode loop.

:class:`NoisyOracleDrafter` wraps a reference Hugging Face causal LM (often the target itself). Each
step it runs the reference on the committed context plus the root, rolls out the reference's greedy
continuation for K tokens and returns, for depths 1..K, the reference's next-token logits at each
rollout position, sharpened or flattened and perturbed with Gaussian noise. With the target as
reference and no noise the chain is the target's own greedy continuation (every token accepted); noise
makes some argmaxes wrong, so acceptance lengths are non-trivial and side branches of a tree matter.
"""

from __future__ import annotations

from typing import Any

import torch

from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.compat import cache_kwargs
from bastion.contract.interfaces import Drafter
from bastion.contract.sampling import seeded_generator
from bastion.contract.types import DraftContext, DraftStep, Marginals

__all__ = ["NoisyOracleDrafter", "PlantedDrafter"]


class NoisyOracleDrafter(Drafter):
    """Noisy copies of a reference model's greedy-rollout next-token distributions.

    Parameters
    ----------
    model:
        A Hugging Face causal LM (eval mode); it keeps its own KV cache of committed tokens.
    block_size:
        K, the number of depths proposed per step.
    noise:
        Standard deviation of the Gaussian noise added to the (scaled) reference logits.
    sharpness:
        Factor applied to the reference logits before the noise (> 1 sharpens, < 1 flattens).
    seed:
        Seed of the noise generator (reset by :meth:`reset`), so runs are reproducible.
    feature_layers:
        Target layer ids whose features the drafter asks for; it only checks their shapes (useful to
        exercise the feature path of a pipeline).
    """

    def __init__(
        self,
        model: Any,
        block_size: int = 8,
        noise: float = 1.0,
        sharpness: float = 1.0,
        seed: int = 0,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidInputError(f"block_size must be an int >= 1, got {block_size!r}")
        if not noise >= 0 or not sharpness > 0:
            raise InvalidInputError(f"need noise >= 0 and sharpness > 0, got noise={noise!r}, sharpness={sharpness!r}")
        self.model = model.eval()
        self.block_size = block_size
        self.noise = float(noise)
        self.sharpness = float(sharpness)
        self.seed = int(seed)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.features_seen = 0  # committed positions whose target features arrived (feature path check)
        self._feature_dim: int | None = None
        self._device = model.get_output_embeddings().weight.device
        self.reset()

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def bind(self, target: Any) -> None:
        if self.feature_layers and max(self.feature_layers) >= target.num_layers:
            raise IncompatibleComponentsError(
                f"feature layers {self.feature_layers} out of range for a target with {target.num_layers} layers"
            )
        self._feature_dim = len(self.feature_layers) * target.hidden_size if self.feature_layers else None

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._cache: Any = None
        self._cached = 0  # committed tokens already in the reference cache
        self.features_seen = 0
        self._gen = seeded_generator(self.seed, self._device)

    def begin(self, context: DraftContext) -> None:
        from transformers import DynamicCache

        self.reset()
        self._tokens = [int(t) for t in context.tokens.tolist()]
        self._cache = DynamicCache(config=self.model.config)
        self._check_features(context.features, len(self._tokens))

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> Marginals:
        if self._cache is None:
            raise InvalidInputError("propose() before begin(): start a sequence first")
        if not 0 <= int(step.root_token) < self.vocab_size:
            raise InvalidInputError(f"root_token must lie in [0, {self.vocab_size}), got {step.root_token}")
        feed = self._tokens[self._cached :] + [int(step.root_token)]
        logits = self._extend(feed)  # [V], reference next-token logits after the root
        self._cached = len(self._tokens)
        rows = [logits]
        for _ in range(self.block_size - 1):  # greedy rollout of the reference
            rows.append(self._extend([int(rows[-1].argmax())]))
        self._cache.crop(-self.block_size)  # drop root + rollout: only committed tokens stay cached
        ref = torch.stack(rows).float()  # [K, V]
        noise = torch.randn(ref.shape, generator=self._gen, device=ref.device) * self.noise
        return Marginals.from_logits(ref * self.sharpness + noise, temperature=step.temperature)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        new = [int(t) for t in tokens.tolist()]
        self._check_features(features, len(new))
        self._tokens.extend(new)

    # ------------------------------------------------------------------ internals
    def _extend(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)  # [1, t]
        out = self.model(input_ids=ids, **cache_kwargs(self.model, self._cache))
        return out.logits[0, -1]  # [V]

    def _check_features(self, features: torch.Tensor | None, rows: int) -> None:
        if not self.feature_layers:
            return
        if features is None or features.dim() != 2 or features.shape[0] != rows:
            raise IncompatibleComponentsError(
                f"expected target features [{rows}, F], got {None if features is None else tuple(features.shape)}"
            )
        if self._feature_dim is not None and features.shape[1] != self._feature_dim:
            raise IncompatibleComponentsError(f"expected {self._feature_dim} feature columns, got {features.shape[1]}")
        self.features_seen += rows


class PlantedDrafter(Drafter):
    """Marginals with planted confidence and planted correctness over a known token sequence.

    Parameters
    ----------
    sequence:
        The prompt followed by the target's greedy continuation: at context length ``c`` the right token
        at depth ``k`` is ``sequence[c + k]`` (valid while decoding greedily along that sequence).
    vocab_size:
        V, the target's vocabulary size.
    block_size:
        K, the number of depths proposed per step.
    accept_rate:
        Probability that the top token at a depth is the right one (drawn per context length and depth
        from ``seed``, so the same positions get the same draws in every run).
    confidence:
        Probability the marginals give the top token (the rest is spread evenly over the other allowed
        tokens). A wrong top token comes with the right token excluded, so it can never be accepted.
    """

    def __init__(
        self,
        sequence: list[int],
        vocab_size: int,
        *,
        block_size: int = 6,
        accept_rate: float = 1.0,
        confidence: float = 0.95,
        seed: int = 0,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidInputError(f"block_size must be an int >= 1, got {block_size!r}")
        if not 0.0 <= accept_rate <= 1.0 or not 0.0 < confidence < 1.0:
            raise InvalidInputError(f"need 0 <= accept_rate <= 1 and 0 < confidence < 1, got {accept_rate!r}, {confidence!r}")
        if vocab_size < 3:
            raise InvalidInputError("PlantedDrafter needs a vocabulary of at least 3 tokens")
        self.sequence = [int(t) for t in sequence]
        self._vocab = int(vocab_size)
        self.block_size = block_size
        self.accept_rate = float(accept_rate)
        self.confidence = float(confidence)
        self.seed = int(seed)
        self.proposals = 0  # propose() calls (drafting steps) since the last reset
        self.committed = 0  # positions committed since begin (prompt included)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def reset(self) -> None:
        self.proposals = 0
        self.committed = 0

    def begin(self, context: DraftContext) -> None:
        self.reset()
        self.committed = int(context.tokens.shape[0])

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self.committed += int(tokens.shape[0])

    def propose(self, step: DraftStep) -> Marginals:
        if step.context_len != self.committed:
            raise InvalidInputError(f"drafter holds {self.committed} committed positions, the step says {step.context_len}")
        self.proposals += 1
        k, v = self.block_size, self._vocab
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step.context_len)
        right = torch.rand(k, generator=gen) < self.accept_rate  # [K] planted correctness per depth
        shift = torch.randint(1, v, (k,), generator=gen)  # [K] offsets of the wrong tokens
        probs = torch.empty(k, v)  # [K, V]
        for d in range(k):
            pos = step.context_len + d + 1
            truth = self.sequence[pos] if pos < len(self.sequence) else 0
            top = truth if bool(right[d]) else (truth + int(shift[d])) % v
            allowed = v - 1 if bool(right[d]) else v - 2  # a wrong top token excludes the right one
            probs[d].fill_((1.0 - self.confidence) / allowed)
            if not bool(right[d]):
                probs[d, truth] = 0.0
            probs[d, top] = self.confidence
        return Marginals.from_logits(probs.log(), temperature=step.temperature)
