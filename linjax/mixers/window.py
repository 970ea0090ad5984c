"""Sinks + sliding window softmax alone, no linear term: the fixed-budget baseline.

    y_t = softmax-attention(q_t; keys and values at positions in I_t),
    I_t = { j ≤ t : j < s  or  t − j < w }

It is the paper's final recipe (sec. 4) with the linear state removed: the same
cache budget (s sinks + w window), but tokens that leave the window are simply
forgotten. Recent work reports it as a baseline that is hard to beat on short
tasks; on retrieval beyond the window (S-NIAH) it shows what the linear state
adds. It has no new parameters and needs no training: the pretrained
projections are used as they are, and `SinksWindow` (sinks_window.py) does the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.layers import AttentionProjections
from linjax.mixers.sinks_window import SinksWindow, SinksWindowCache


class WindowAttention(nnx.Module):
    """Softmax attention over the first `sinks` tokens and the last `window` ones (pretrained projections)."""

    mechanism = "window"

    def __init__(self, proj: AttentionProjections, settings, *, rngs: nnx.Rngs):
        """`proj`: the pretrained projections (shared, not copied); `settings`: a LinearizeConfig (window ≥ 1,
        which LinearizeConfig checks)."""
        del rngs  # nothing to initialise
        self.proj = proj
        self.sinks_window = SinksWindow.from_settings(settings)

    def torch_tensors(self, prefix: str, pretrained: dict) -> dict:
        """Nothing beyond the pretrained projections for the PyTorch export (LinearMixer.torch_tensors)."""
        return {}

    def init_state(self, batch: int, max_length: int, dtype=jnp.float32) -> SinksWindowCache:
        del max_length  # the cache holds sinks + window tokens, whatever the context length
        return self.sinks_window.empty_cache(batch, self.proj.num_kv_heads, self.proj.head_dim, dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, state: SinksWindowCache | None = None):
        q, k, v = self.proj.qkv(x, positions)
        parts, _, state = self.sinks_window(q, k, v, cache=state)
        out = self.proj.out(parts.normalized().astype(x.dtype))
        return out if state is None else (out, state)
