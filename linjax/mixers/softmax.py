"""The original softmax attention, with a KV cache for decoding.

This is the pretrained mixer every linear mechanism replaces, and the teacher
for attention transfer. Modes (ARCHITECTURE.md, "Modes of a mixer"): with no
state it attends causally over x; with a `KVCache` it appends x's keys and
values at `cache.length` and attends over everything cached so far.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.config import ModelConfig
from linjax.layers import AttentionProjections


class KVCache(NamedTuple):
    k: jax.Array  # [B, max_length, Hkv, D]
    v: jax.Array  # [B, max_length, Hkv, D]
    length: jax.Array  # [] int32, positions already written


def causal_attention(q, k, v, *, key_offset=None, valid_length=None):
    """Softmax attention, q [B,T,H,D] over k, v [B,S,Hkv,D] with H a multiple of Hkv.

    Without offsets, query i attends keys 0..i (S == T). With `key_offset`
    (queries sit at positions key_offset..key_offset+T-1 of a cache) query i
    attends cached keys 0..key_offset+i. Softmax statistics are fp32.
    """
    if key_offset is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    query_pos = key_offset + jnp.arange(q.shape[1])
    key_pos = jnp.arange(k.shape[1])
    mask = key_pos[None, :] <= query_pos[:, None]  # [T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def pretrained_attention(proj: AttentionProjections, x: jax.Array, positions: jax.Array) -> jax.Array:
    """The original block's attention output: causal softmax on the frozen projections (no adapters).

    Also the teacher of attention transfer for a linearized block built on the same `proj`.
    """
    return proj.out(causal_attention(*proj.qkv(x, positions)))


class SoftmaxAttention(nnx.Module):
    """Full causal softmax attention on the pretrained projections."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 projections: AttentionProjections | None = None):
        self.proj = projections or AttentionProjections(config, dtype=dtype, rngs=rngs)

    def init_state(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_length, self.proj.num_kv_heads, self.proj.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array, positions: jax.Array, state: KVCache | None = None):
        if state is None:
            return pretrained_attention(self.proj, x, positions)
        q, k, v = self.proj.qkv(x, positions)
        start = state.length
        cache_k = jax.lax.dynamic_update_slice_in_dim(state.k, k.astype(state.k.dtype), start, axis=1)
        cache_v = jax.lax.dynamic_update_slice_in_dim(state.v, v.astype(state.v.dtype), start, axis=1)
        o = causal_attention(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), key_offset=start)
        new_state = KVCache(cache_k, cache_v, start + x.shape[1])
        return self.proj.out(o), new_state
