"""Causal softmax attention in query blocks, recomputed in the backward: the training and scoring
form of the pretrained attention (linjax/mixers/softmax.py) on every platform but cuDNN's.

    blocked_causal_attention(q, k, v, block) -> o     q [B,T,H,D], k, v [B,T,Hkv,D], H a multiple of Hkv
    recomputed(q, k, v) -> o                         the same in at most MAX_BLOCKS blocks, under
                                                     jax.checkpoint: the backward keeps q, k, v only

o = softmax(q kᵀ / √D, causal) v with fp32 scores and softmax, in q's dtype. Pure functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# XLA builds the whole [T, T] score matrix of jax.nn.dot_product_attention and masks half of it
# away, and the softmax over it is memory-bound. Blocks skip the keys after the block's last query
# and keep each block's scores in cache (64 rows was the fastest block; results/bench/HISTORY.md).
# At most MAX_BLOCKS blocks, so long sequences do not unroll into hundreds of products.
QUERY_BLOCK, MAX_BLOCKS = 64, 16


def recomputed(q, k, v):
    """`blocked_causal_attention` in at most MAX_BLOCKS query blocks, recomputed in the backward."""
    block = max(QUERY_BLOCK, -(-q.shape[1] // MAX_BLOCKS))
    # Recomputed in the backward pass instead of saved, as flash attention does: the backward keeps
    # only q, k and v, not every block's [G·n, keys] scores and key prefixes (0.9 GB for SmolLM2
    # at T = 1,024, written and zero-filled at every step; growing as T²).
    return jax.checkpoint(lambda q, k, v: blocked_causal_attention(q, k, v, block), prevent_cse=False)(q, k, v)


def blocked_causal_attention(q, k, v, block: int):
    """Causal softmax attention in query blocks of `block` rows, each over the keys up to its last
    query only (about half the dense products); fp32 scores and softmax. The G = H / Hkv query heads
    of a kv head share its keys.

    Layout: q, k and v are put heads-major once ([B, Hkv, G, T, D] and [B, Hkv, T, D]), so each
    block's two products are batched matmuls over (B, Hkv) on contiguous rows, the block's G·n
    queries stacked as one matrix (as in the mixer's `cached_attention`). Einsums over the
    [B, T, H, D] inputs made XLA:CPU transpose every block's keys and values again."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q = (q * jnp.asarray(D ** -0.5, q.dtype)).reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    over_heads = ((0, 1), (0, 1))
    # Blocks taken by split and the key prefixes put together by concatenate: in the backward these
    # become a concatenate and per-block slices, where q[..., start:end] and k[:, :, :end] became a
    # zero-padded full-length gradient per block and a 16-way sum.
    edges = list(range(block, T, block))
    q_blocks, k_blocks, v_blocks = (jnp.split(q, edges, axis=3), jnp.split(k, edges, axis=2),
                                    jnp.split(v, edges, axis=2))
    blocks = []
    for i, start in enumerate(range(0, T, block)):
        end = min(start + block, T)
        rows = q_blocks[i].reshape(B, Hkv, G * (end - start), D)  # row g·n + i: query start + i
        keys, values = (jnp.concatenate(parts[:i + 1], axis=2) for parts in (k_blocks, v_blocks))
        scores = jax.lax.dot_general(rows, keys, (((3,), (3,)), over_heads),
                                     preferred_element_type=jnp.float32)  # [B, Hkv, G·n, end]
        query_pos = start + jnp.tile(jnp.arange(end - start), G)
        scores = jnp.where(jnp.arange(end)[None, :] <= query_pos[:, None], scores, -jnp.inf)
        # Softmax normalised after the product with v: the division touches the [G·n, D] output,
        # not the [G·n, end] probabilities, which saves the backward a pass over the scores.
        # The max is a constant shift of each row, so no gradient flows through it.
        unnormalised = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
        out = jax.lax.dot_general(unnormalised.astype(v.dtype), values, (((3,), (2,)), over_heads),
                                  preferred_element_type=jnp.float32)  # [B, Hkv, G·n, D]
        out = out / jnp.sum(unnormalised, axis=-1, keepdims=True)
        blocks.append(out.reshape(B, Hkv, G, end - start, D))
    out = jnp.concatenate(blocks, axis=3)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q.dtype)
