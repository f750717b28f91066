"""The target's next-token rule, shared by the pipeline (first token) and verifiers (every node).

Seeded sampling uses a counter-based random stream: the token at absolute sequence position ``p`` is
drawn by inverse-CDF sampling of the target's processed distribution with the uniform
``u(seed, p)`` (:class:`PositionalStream`). A uniform depends on the seed and the position only, never on
how many draws came before, so:

* every node of a verification tree at depth ``d`` (position ``context_len + d``) samples the token after
  it with the uniform of position ``context_len + d + 1``, shared by all nodes of that depth;
* the tokens a seeded run emits are ``x_p = F^-1(u(seed, p) | x_<p)`` whatever the trees, budgets or
  timings were: the same tokens as plain autoregressive sampling with the same seed. Distinct positions
  get independent uniforms, so this is exactly the target's sampling distribution (lossless).

Verifiers receive the uniforms of a step's nodes in :attr:`SamplingConfig.uniforms`;
:func:`sample_tokens` honours them, so a verifier that calls it is reproducible without any change.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
from attrs import field, frozen

from bastion.utils.checks import SEED_LIMIT, check_seed
from bastion.contract.errors import InvalidInputError
from bastion.contract.types import SamplingConfig

__all__ = [
    "processed_log_probs",
    "sample_tokens",
    "sample_rows",
    "inverse_cdf_sample",
    "position_uniforms",
    "position_uniform",
    "PositionalStream",
    "SEED_LIMIT",
    "check_seed",
    "at_position",
    "seeded_generator",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """Unsigned 64-bit value -> the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed values arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplications wrap modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def _mix_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def position_uniforms(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) for absolute sequence ``positions`` (LongTensor[...]) -> float64 [...].

    Counter-based (splitmix64 of the seed's key plus the position), computed on the positions' device
    with integer ops only: no generator state, no host transfer. Each value has 53 random bits."""
    key = _signed(_mix_int(check_seed(seed)))
    z = positions.long() * _signed(_GOLDEN) + key  # [...] wraps modulo 2**64
    return _shr(_mix(z), 11).double() * 2.0**-53


def position_uniform(seed: int, position: int) -> float:
    """The uniform of one absolute ``position``, computed on the host in integer arithmetic: bit for bit
    the value :func:`position_uniforms` gives for it, at a small fraction of the cost of the tensor ops
    (the one-token steps of plain decoding need a single uniform)."""
    z = (int(position) * _GOLDEN + _mix_int(check_seed(seed))) & _MASK64  # wraps modulo 2**64
    return (_mix_int(z) >> 11) * 2.0**-53


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids ``[...]`` drawn from ``probs`` [..., V] (non-negative, any positive total) by inverse
    CDF with ``uniforms`` [...] in [0, 1): the first id whose cumulative mass exceeds ``u * total``.
    A token of zero probability is never returned."""
    p = probs.double()
    cum = p.cumsum(dim=-1)  # [..., V]
    total = cum[..., -1:]  # [..., 1]
    ids = torch.searchsorted(cum.contiguous(), (uniforms.to(cum.device, torch.float64)[..., None] * total).contiguous(), right=True)
    # rounding can put u * total at the very end: fall back to the last token of positive mass
    last = p.shape[-1] - 1 - (p > 0).flip(-1).int().argmax(dim=-1, keepdim=True)  # [..., 1]
    return torch.minimum(ids, last).squeeze(-1)


def processed_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probabilities ``[..., V]`` of the target's sampling distribution: temperature, then top-k,
    then top-p (nucleus) filtering, the order Hugging Face ``generate`` applies them.
    Requires ``sampling.temperature > 0``."""
    x = logits.float() / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)  # ascending, like HF TopPLogitsWarper
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - sampling.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_rows(
    logits: torch.Tensor, sampling: Sequence[SamplingConfig], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] -> LongTensor[B], row i with ``sampling[i]`` (its
    ``uniforms``, when set, hold one value: [1] or a scalar) and ``generators[i]``: one argmax for the
    whole batch when every row is greedy, else row by row, each row's draw exactly what
    :func:`sample_tokens` gives for that row as a one-node tree ``[1, V]``."""
    if all(s.greedy for s in sampling):
        return logits.argmax(dim=-1)
    out = []
    for i, (s, g) in enumerate(zip(sampling, generators, strict=True)):
        # a scalar uniform (or none) draws from the row itself, a [1] one from the row as a one-node tree
        row = logits[i] if s.uniforms is None or s.uniforms.dim() == 0 else logits[i : i + 1]
        out.append(sample_tokens(row, s, g).reshape(1))  # [1]
    return out[0] if len(out) == 1 else torch.cat(out)


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of ``logits`` [..., V] -> LongTensor[...]: argmax when greedy, else a draw from
    :func:`processed_log_probs`: by inverse CDF with ``sampling.uniforms`` [...] when the config carries
    them (seeded runs), otherwise with ``generator``."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = processed_log_probs(logits, sampling).exp()
    if sampling.uniforms is not None:
        if tuple(sampling.uniforms.shape) != tuple(probs.shape[:-1]):
            raise InvalidInputError(
                f"sampling.uniforms has shape {tuple(sampling.uniforms.shape)}, expected one per row of the "
                f"logits {tuple(probs.shape[:-1])}"
            )
        return inverse_cdf_sample(probs, sampling.uniforms)
    flat = probs.reshape(-1, probs.shape[-1])
    draws = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return draws.reshape(probs.shape[:-1])


@frozen
class PositionalStream:
    """The seeded random stream of one sequence: the uniform for absolute position ``p`` is
    ``position_uniforms(seed, p)``. Stateless, so any number of rows, trees or retries can share it."""

    seed: int = field(converter=check_seed)

    @classmethod
    def from_seed(cls, seed: int | None) -> "PositionalStream":
        """``seed`` or, when None, a seed drawn from torch's global generator (so ``torch.manual_seed``
        makes unseeded runs repeatable, as with Hugging Face ``generate``)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        return cls(seed)

    def uniforms(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 [...] uniforms for LongTensor ``positions`` [...]."""
        return position_uniforms(self.seed, positions)

    def for_tokens_at(self, sampling: SamplingConfig, positions: torch.Tensor) -> SamplingConfig:
        """``sampling`` carrying the uniforms that sample the tokens at ``positions`` [...] (one row of
        logits per position)."""
        return attrs.evolve(sampling, uniforms=self.uniforms(positions))

    def for_tree(self, sampling: SamplingConfig, context_len: int, depths: torch.Tensor) -> SamplingConfig:
        """``sampling`` for a verification tree whose root sits at position ``context_len``: node ``i`` at
        depth ``depths[i]`` samples the token at position ``context_len + depths[i] + 1``."""
        return self.for_tokens_at(sampling, depths + (context_len + 1))


def at_position(
    sampling: SamplingConfig,
    stream: PositionalStream | None,
    position: int,
    *,
    rows: int | None = None,
    device: torch.device | str | None = None,
) -> SamplingConfig:
    """``sampling`` for one token at absolute ``position`` from ``stream`` (unchanged when None: greedy):
    a scalar uniform for logits [V], or ``rows`` copies of it for logits [rows, V], on ``device`` (the
    CPU by default). The uniform is computed on the host (:func:`position_uniform`), the same value as
    :meth:`PositionalStream.uniforms`, and written by a fill: no host-to-device copy."""
    if stream is None:
        return sampling
    u = position_uniform(stream.seed, position)
    shape = () if rows is None else (rows,)
    return attrs.evolve(sampling, uniforms=torch.full(shape, u, dtype=torch.float64, device=device))


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (checked by :func:`check_seed`)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(check_seed(seed))
    return gen
