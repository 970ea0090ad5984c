"""Sinks + sliding window softmax alone, no linear term: the fixed-budget baseline.

    y_t = softmax-attention(q_t; keys and values at positions in I_t),
    I_t = { j ≤ t : j < s  or  t − j < w }

It is the paper's final recipe (sec. 4) with the linear state removed: the same
cache budget (s sinks + w window), but tokens that leave the window are simply
forgotten. Recent work reports it as a baseline that is hard to beat on short
tasks; on retrieval beyond the window (S-NIAH) it shows what the linear state
adds. It has no new parameters and needs no training: the pretrained
projections are used as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import swa
from linjax.layers import AttentionProjections
from linjax.mixers.states import WindowCache


class WindowAttention(nnx.Module):
    """Softmax attention over the first `sinks` tokens and the last `window` ones (pretrained projections)."""

    mechanism = "window"

    def __init__(self, proj: AttentionProjections, settings, *, rngs: nnx.Rngs):
        """`proj`: the pretrained projections (shared, not copied); `settings`: a LinearizeConfig (window ≥ 1)."""
        del rngs  # nothing to initialise
        if settings.window < 1:
            raise ValueError("mechanism 'window' (window-only attention) needs window ≥ 1; "
                             f"got window={settings.window}, sinks={settings.sinks}")
        self.proj = proj
        self.window, self.sinks = settings.window, settings.sinks
        self.chunk = settings.chunk
        self.use_pallas = settings.uses_pallas()

    def torch_tensors(self, prefix: str, pretrained: dict) -> dict:
        """Nothing beyond the pretrained projections for the PyTorch export (LinearMixer.torch_tensors)."""
        return {}

    def init_state(self, batch: int, max_length: int, dtype=jnp.float32) -> WindowCache:
        del max_length  # the cache holds sinks + window tokens, whatever the context length
        return swa.empty_cache(batch, self.proj.num_kv_heads, self.proj.head_dim, self.proj.head_dim,
                               sinks=self.sinks, window=self.window, dtype=dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, state: WindowCache | None = None):
        q, k, v = self.proj.qkv(x, positions)
        chunk = {} if self.chunk is None else {"chunk": self.chunk}
        if state is None:
            run = swa.pallas if self.use_pallas else swa.chunked
            parts = run(q, k, v, sinks=self.sinks, window=self.window, **chunk)
        elif x.shape[1] == 1:
            parts, state = swa.step(q[:, 0], k[:, 0], v[:, 0], state)
            parts = jax.tree.map(lambda a: a[:, None], parts)
        else:
            parts, state = swa.prefill(q, k, v, state, **chunk)
        out = self.proj.out(parts.normalized().astype(x.dtype))
        return out if state is None else (out, state)
