"""Reference decoders that use no bastion code: oracles for lossless tests."""

from __future__ import annotations

import torch

__all__ = ["greedy_reference", "sampling_reference"]


def greedy_reference(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The model's own greedy continuation of ``prompt`` [1, L]: one full forward per token, no cache."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


def sampling_reference(
    model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, seed: int, *, temperature: float = 1.0,
    top_k: int = 0, top_p: float = 1.0,
) -> list[int]:
    """Plain autoregressive sampling of ``model`` with the seeded positional stream: the token at
    position ``p`` is the inverse-CDF draw of the model's distribution (Hugging Face's own temperature,
    top-k and top-p warpers) with uniform ``u(seed, p)``. One full forward per token, no cache.

    Only the definition of the random stream (:func:`bastion.contract.sampling.position_uniforms`) comes
    from bastion: what a seed means is part of its contract."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from bastion.contract.sampling import position_uniforms

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            scores = warpers(ids, model(ids).logits[:, -1].float())  # [1, V]
            probs = torch.softmax(scores[0].double(), dim=-1).tolist()
            u = float(position_uniforms(seed, torch.tensor(ids.shape[1])))
            acc, token = 0.0, max(i for i, p in enumerate(probs) if p > 0)
            for i, p in enumerate(probs):  # the first token whose cumulative mass exceeds u
                acc += p
                if p > 0 and acc > u:
                    token = i
                    break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return ids[0, prompt.shape[1] :].tolist()
