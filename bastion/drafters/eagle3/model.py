"""The EAGLE-3 draft network: one decoder layer over [token embedding, projected target features].

For a row (feature vector ``f`` [3 T], token ``x``) at position ``p``:

    h   = fc(f)                                  # [H]: three target hidden states projected (target rows)
                                                 #      or the draft's own previous output (tree rows)
    a   = [input_layernorm(embed(x)), hidden_norm(h)]      # [2 H]: the attention input
    r   = h                (hidden_norm(h) when norm_before_residual)
    u   = r + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))   # rotary at p, keys/values cached
    out = u + mlp(post_attention_layernorm(u))   # [H]: fed back as the next row's h
    logits = lm_head(norm(out))                  # [draft_vocab]

Draft token ``j`` stands for target token ``j + d2t[j]``. The token embedding has the target's vocabulary
and is the target's own unless the checkpoint stores one.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bastion.contract.errors import InvalidInputError
from bastion.drafters.eagle3.checkpoint import Eagle3Checkpoint, load_eagle3_checkpoint
from bastion.drafters.eagle3.config import CONFIG_NAME, Eagle3Config
from bastion.drafters.network import DraftNetwork, RMSNorm, rope_inv_freq

__all__ = ["Eagle3DraftModel", "Eagle3KV"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Eagle3KV:
    """Growable keys/values of the draft layer: committed rows first, then this step's tree rows.

    Storage is [1, H_kv, capacity, D] per tensor, doubling when full; :meth:`append` writes in place after
    the current length, :meth:`truncate` forgets the tail (the tree rows of a finished step)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [1, H_kv, capacity, D]
        self.values: torch.Tensor | None = None
        self.length = 0

    def clear(self) -> None:
        self.keys, self.values, self.length = None, None, 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise InvalidInputError(f"cannot truncate a draft cache of {self.length} rows to {length}")
        self.length = length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` / ``values`` [1, H_kv, n, D] after the current rows."""
        n = int(keys.shape[2])
        need = self.length + n
        if self.keys is None or need > self.keys.shape[2]:
            cap = max(need, 64, 2 * (0 if self.keys is None else self.keys.shape[2]))
            grown_k = keys.new_empty((1, keys.shape[1], cap, keys.shape[3]))  # [1, H_kv, cap, D]
            grown_v = values.new_empty((1, values.shape[1], cap, values.shape[3]))
            if self.keys is not None and self.length:
                grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
                grown_v[:, :, : self.length] = self.values[:, :, : self.length]  # type: ignore[index]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.length : need] = keys
        self.values[:, :, self.length : need] = values  # type: ignore[index]
        self.length = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values, two [1, H_kv, length, D] views."""
        if self.keys is None or self.values is None:
            raise InvalidInputError("the draft cache is empty")
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Eagle3Layer(nn.Module):
    """The draft decoder layer (``midlayer``): attention over [embedding, hidden] (2 H wide), then an MLP."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.self_attn.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.self_attn.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.self_attn.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)


class Eagle3DraftModel(DraftNetwork):
    """The EAGLE-3 draft network with its own lm head over the draft vocabulary and the ``d2t`` map."""

    def __init__(self, config: Eagle3Config, *, with_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.feature_size, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [draft_vocab]
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, h) if with_embedding else None
        self._act = _ACTIVATIONS[config.hidden_act]
        # kept in float32 outside the module's buffers, so casting the model never rounds it
        self.inv_freq, self.rope_scale = rope_inv_freq(config, "EAGLE-3")  # [D / 2], attention scaling

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_checkpoint(cls, ck: Eagle3Checkpoint) -> "Eagle3DraftModel":
        """The network holding a checked checkpoint's tensors (in their stored dtype)."""
        model = cls(ck.config, with_embedding="embed_tokens.weight" in ck.state)
        state = dict(ck.state)
        if "d2t" not in state:
            state["d2t"] = torch.zeros(ck.config.draft_vocab_size, dtype=torch.long)
        dtype = state["fc.weight"].dtype
        model = model.to(dtype)
        model.load_state_dict({k: (v.long() if k == "d2t" else v) for k, v in state.items()}, strict=True)
        return model.eval()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> "Eagle3DraftModel":
        """Load a checkpoint folder or hub id (either layout) onto ``device`` in ``dtype`` (None: stored)."""
        model = cls.from_checkpoint(load_eagle3_checkpoint(path))
        return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)

    def save_pretrained(self, path: str | Path, *, layout: str = "safeailab") -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the SafeAILab / SpecForge layout (``midlayer.*``,
        ``d2t``) or vLLM's (``layout="vllm"``: ``layers.0.*``, ``draft_id_to_target_id``)."""
        import json

        from safetensors.torch import save_file

        if layout not in ("safeailab", "vllm"):
            raise InvalidInputError(f"layout must be 'safeailab' or 'vllm', got {layout!r}")
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        d2t = state["d2t"]
        state["t2d"] = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(self.config.draft_vocab_size) + d2t] = True
        if layout == "vllm":
            state = {
                ("draft_id_to_target_id" if k == "d2t" else k.replace("midlayer.", "layers.0.", 1)): v
                for k, v in state.items()
            }
        save_file(state, str(out / "model.safetensors"))
        (out / CONFIG_NAME).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        return out

    # ------------------------------------------------------------------ network
    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft token ids (any shape)."""
        return draft_ids + self.d2t[draft_ids]

    def rows(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: Eagle3KV,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run n rows through the draft layer and append their keys/values to ``cache``.

        ``embeds`` [n, H] token embeddings, ``hidden`` [n, H] projected features or fed-back outputs,
        ``positions`` [n] long, ``visible`` BoolTensor [n, cache.length + n] (which cached rows and new rows
        each row attends to; None: every cached row and the new rows causally). Returns the layer
        outputs [n, H] (before the final norm)."""
        cfg, layer = self.config, self.midlayer
        n = int(embeds.shape[0])
        residual = layer.hidden_norm(hidden) if cfg.norm_before_residual else hidden
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)  # [n, 2H]
        attn = layer.self_attn
        q = attn.q_proj(x).view(n, cfg.num_attention_heads, cfg.head_dim).transpose(0, 1)  # [Hq, n, D]
        k = attn.k_proj(x).view(n, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, n, D]
        v = attn.v_proj(x).view(n, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, n, D]
        cos, sin = self._rotary(positions, x.dtype)  # [n, D] each
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        past = cache.length
        cache.append(k[None], v[None])
        keys, values = cache.view()  # [1, Hkv, past + n, D]
        if visible is None:
            visible = torch.ones(n, past + n, dtype=torch.bool, device=x.device)  # [n, past + n]
            visible[:, past:] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=visible.to(x.device), enable_gqa=True)
        out = out[0].transpose(0, 1).reshape(n, cfg.num_attention_heads * cfg.head_dim)  # [n, Hq * D]
        u = residual + attn.o_proj(out)  # [n, H]
        mlp = layer.mlp
        y = layer.post_attention_layernorm(u)
        return u + mlp.down_proj(self._act(mlp.gate_proj(y)) * mlp.up_proj(y))  # [n, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, draft_vocab] of layer outputs ``hidden`` [n, H]."""
        return self.lm_head(self.norm(hidden))

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None]  # [n, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)
