"""The pretrained attention in the PyTorch mirror, and the registry of mixers by mechanism name.

`Attention` holds the pretrained q/k/v/o projections (with q/k norm and RoPE) and is full
causal softmax attention (mechanism "softmax"); `WindowAttention` is the window-only baseline
("window", linjax/mixers/window.py). Each mixer class names its mechanism in `mechanism`,
the name linjax writes in config.json's `mixers`; defining such a subclass registers it in
`MIXERS`, from which modeling_linjax.py builds each layer. The linear mechanisms are in
modeling_linjax_linear.py. Imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

from .modeling_linjax_cache import KeyValueCache
from .modeling_linjax_kernels import apply_rope, rope_inverse_frequencies, token_positions, window_softmax_parts

MIXERS: dict = {}  # mechanism name → mixer class; every Attention subclass with its own `mechanism` adds itself


def sinks_and_window(settings: dict) -> tuple:
    """(sinks, window) of config.linearize: softmax over the first `sinks` tokens and the last `window`."""
    return int(settings.get("sinks", 0)), int(settings.get("window", 0))


class RMSNorm(nn.Module):
    """x / rms(x) · w with fp32 statistics (linjax.layers.RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """The pretrained q/k/v/o projections (with q/k norm and RoPE), and full causal softmax attention."""

    mechanism = "softmax"
    sinks, window = 0, None  # attend to every earlier token

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if vars(cls).get("mechanism"):  # None: a base class of mixers, not a mechanism
            if cls.mechanism in MIXERS:
                raise TypeError(f"two mixer classes name the mechanism {cls.mechanism!r}")
            MIXERS[cls.mechanism] = cls

    def __init__(self, config):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.output_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Recomputed per call, not a buffer: transformers builds the model on the meta device and
        # would leave a non-persistent buffer uninitialised.
        self.rope = config.rope

    @classmethod
    def new_cache(cls, settings: dict):
        """An empty decode cache for one layer of this mixer (`settings`: config.linearize)."""
        return KeyValueCache()

    def qkv(self, x, positions):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inverse_frequencies(self.rope, self.head_dim)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, o):
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x, position_ids, start: int = 0, cache: KeyValueCache | None = None):
        """x [B,T,d] at positions start .. start + T − 1 (after `cache`'s tokens, if one is given)."""
        q, k, v = self.qkv(x, position_ids)
        positions = token_positions(start, x.shape[1], x.device)
        keys, values, key_positions = (k, v, positions) if cache is None else cache.extend(k, v, positions)
        numerator, _, row_sum = window_softmax_parts(q, keys, values, positions, key_positions, self.sinks,
                                                     self.window)
        return self.out((numerator / row_sum[..., None]).to(x.dtype))


class WindowAttention(Attention):
    """Softmax over the first `sinks` tokens and the last `window` only, no linear term (linjax/mixers/window.py)."""

    mechanism = "window"

    def __init__(self, config):
        super().__init__(config)
        self.sinks, self.window = sinks_and_window(config.linearize)
        if int(config.linearize.get("retain", 0)):  # linjax refuses it; a hand-edited config must not lose it
            raise ValueError("linearize.retain > 0 writes the tokens it does not keep into a linear state; "
                             "the window-only mixer has none")

    @classmethod
    def new_cache(cls, settings: dict):
        return KeyValueCache(*sinks_and_window(settings))


MIXERS[Attention.mechanism] = Attention
