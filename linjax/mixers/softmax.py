"""The original softmax attention, with a KV cache for decoding.

This is the pretrained mixer every linear mechanism replaces, and the teacher
for attention transfer. Modes (docs/architecture.md, "Modes of a mixer"): with no
state it attends causally over x; with a `KVCache` it appends x's keys and
values at `cache.length` and attends over everything cached so far.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.config import ModelConfig
from linjax.layers import AttentionProjections
from linjax.mixers.states import KVCache
from linjax.platform import has_cuda


# XLA:CPU builds the whole [T, T] score matrix of jax.nn.dot_product_attention and masks half of it
# away, and the softmax over it is memory-bound: at T = 1,024 (9 heads, D 64) one layer's forward +
# backward took 0.31 s that way, 0.16 s in query blocks of 128 and 0.14 s in blocks of 64, against
# 0.13 s for PyTorch's SDPA (same machine and run, 2 cores). Blocks skip the keys after the block's
# last query and keep each block's scores in cache. At most MAX_BLOCKS blocks, so long sequences
# do not unroll into hundreds of products.
QUERY_BLOCK, MAX_BLOCKS = 64, 16
HALF_PRECISION = (jnp.bfloat16, jnp.float16)


def causal_attention(q, k, v):
    """Causal softmax attention, q [B,T,H,D] over k, v [B,T,Hkv,D] with H a multiple of Hkv.

    No form keeps a [T, T] array for the backward. The form is chosen by the platform the program
    is lowered for (`jax.lax.platform_dependent`), so a CUDA lowering made on a CPU machine is the
    program a GPU runs: on CUDA, cuDNN's flash attention for bf16 / fp16 (it takes no fp32), and
    the blocked form with recomputation otherwise, as on every other platform. XLA's
    `dot_product_attention` keeps the whole T × T probabilities for its backward (at SmolLM2's
    shapes and T 4,096, 67 GB at batch 4 over 30 layers).
    """
    if not _cudnn_takes(q):  # one form for every platform
        return recomputed_blocked_attention(q, k, v)
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn_attention, default=recomputed_blocked_attention)


def _cudnn_takes(q) -> bool:
    """Whether cuDNN's fused attention accepts q (and exists here: it is traced only on a machine with a
    CUDA device, since it asks the device for its compute capability while tracing)."""
    D = q.shape[-1]
    return q.dtype in HALF_PRECISION and D % 8 == 0 and D <= 128 and has_cuda()


def cudnn_attention(q, k, v):
    """cuDNN's flash attention (bf16 / fp16, GQA as is): its backward keeps the output and the
    log-sum-exp, not the probabilities."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def recomputed_blocked_attention(q, k, v):
    """`blocked_causal_attention` in at most MAX_BLOCKS query blocks, recomputed in the backward."""
    block = max(QUERY_BLOCK, -(-q.shape[1] // MAX_BLOCKS))
    # Recomputed in the backward pass instead of saved, as flash attention does: the backward keeps
    # only q, k and v, not every block's [G·n, keys] scores and key prefixes (0.9 GB for SmolLM2
    # at T = 1,024, written and zero-filled at every step; growing as T²).
    # The floor (bench/train.py) at T = 1,024: 8.96 → 8.55 s, at 512: 3.72 → 3.53 s (medians of 5,
    # interleaved in one process on the loaded 2-core machine).
    return jax.checkpoint(lambda q, k, v: blocked_causal_attention(q, k, v, block), prevent_cse=False)(q, k, v)


def blocked_causal_attention(q, k, v, block: int):
    """Causal softmax attention in query blocks of `block` rows, each over the keys up to its last
    query only (about half the dense products); fp32 scores and softmax. The G = H / Hkv query heads
    of a kv head share its keys.

    Layout: q, k and v are put heads-major once ([B, Hkv, G, T, D] and [B, Hkv, T, D]), so each
    block's two products are batched matmuls over (B, Hkv) on contiguous rows, the block's G·n
    queries stacked as one matrix (as in `cached_attention`). Einsums over the [B, T, H, D] inputs
    made XLA:CPU transpose every block's keys and values again: one layer at SmolLM2's shapes
    (9 heads, 3 kv heads, D 64), forward / forward + backward, 7.0 / 12.4 ms → 3.2 / 9.5 ms at
    T = 512 and 17.6 / 62.7 ms → 10.1 / 40.4 ms at T = 1,024 (same run, 2 cores)."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    q = (q * jnp.asarray(D ** -0.5, q.dtype)).reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    over_heads = ((0, 1), (0, 1))
    # Blocks taken by split and the key prefixes put together by concatenate: in the backward these
    # become a concatenate and per-block slices, where q[..., start:end] and k[:, :, :end] became a
    # zero-padded full-length gradient per block and a 16-way sum (one layer's forward + backward at
    # T = 1,024: 84 → 79 ms, median of 40 in the same run, loaded 2-core machine).
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
        # not the [G·n, end] probabilities, which saves the backward a pass over the scores (one
        # layer's forward + backward at T = 1,024: 103 → 81 ms, same run, loaded 2-core machine).
        # The max is a constant shift of each row, so no gradient flows through it.
        unnormalised = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
        out = jax.lax.dot_general(unnormalised.astype(v.dtype), values, (((3,), (2,)), over_heads),
                                  preferred_element_type=jnp.float32)  # [B, Hkv, G·n, D]
        out = out / jnp.sum(unnormalised, axis=-1, keepdims=True)
        blocks.append(out.reshape(B, Hkv, G, end - start, D))
    out = jnp.concatenate(blocks, axis=3)  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q.dtype)


def cached_attention(q, cache: KVCache):
    """Queries q [B,T,H,D] at positions cache.length − T .. cache.length − 1 (their keys already written)
    over the cache's keys 0 .. own position. fp32 scores and softmax.

    Layout: the cache is [B, Hkv, S, D] and the G = H / Hkv query heads of a kv head and the T queries
    share one [G·T, D] matrix, so both products are plain batched matmuls over (B, Hkv) that read
    the cache once, in place. A [B, S, Hkv, D] cache, or an einsum that keeps T as its own axis, made
    XLA:CPU transpose or re-lay the cache at every decode step.
    """
    B, T, H, D = q.shape
    Hkv, S = cache.k.shape[1], cache.k.shape[2]
    G = H // Hkv
    q = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D) * D ** -0.5
    batch_over_heads = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(q.astype(cache.k.dtype), cache.k, (((3,), (3,)), batch_over_heads),
                                 preferred_element_type=jnp.float32)  # [B, Hkv, G·T, S]
    query_pos = cache.length - T + jnp.tile(jnp.arange(T), G)  # row g·T + t holds query t
    scores = jnp.where(jnp.arange(S)[None, :] <= query_pos[:, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jax.lax.dot_general(p.astype(cache.v.dtype), cache.v, (((3,), (2,)), batch_over_heads),
                              preferred_element_type=jnp.float32)  # [B, Hkv, G·T, D]
    return out.reshape(B, Hkv, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def pretrained_attention(proj: AttentionProjections, x: jax.Array, positions: jax.Array) -> jax.Array:
    """The original block's attention output: causal softmax on the frozen projections (no adapters).

    Also the teacher of attention transfer for a linearized block built on the same `proj`.
    """
    return proj.out(causal_attention(*proj.qkv(x, positions)))


class SoftmaxAttention(nnx.Module):
    """Full causal softmax attention on the pretrained projections."""

    mechanism = "softmax"

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 projections: AttentionProjections | None = None):
        self.proj = projections or AttentionProjections(config, dtype=dtype, rngs=rngs)

    def torch_tensors(self, prefix: str, pretrained: dict) -> dict:
        """Nothing beyond the pretrained projections for the PyTorch export (LinearMixer.torch_tensors)."""
        return {}

    def init_state(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, self.proj.num_kv_heads, max_length, self.proj.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array, positions: jax.Array, state: KVCache | None = None):
        if state is None:
            return pretrained_attention(self.proj, x, positions)
        q, k, v = self.proj.qkv(x, positions)
        write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            cache, jnp.swapaxes(new, 1, 2).astype(cache.dtype), state.length, axis=2)
        state = KVCache(write(state.k, k), write(state.v, v), state.length + x.shape[1])
        return self.proj.out(cached_attention(q, state).astype(x.dtype)), state
