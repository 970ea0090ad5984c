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
from linjax.kernels import softmax_blocked
from linjax.layers import AttentionProjections
from linjax.mixers.states import KVCache
from linjax.platform import targets_cuda

HALF_PRECISION = (jnp.bfloat16, jnp.float16)


def causal_attention(q, k, v):
    """Causal softmax attention, q [B,T,H,D] over k, v [B,T,Hkv,D] with H a multiple of Hkv.

    No form keeps a [T, T] array for the backward. The form is chosen by the platform the program
    is lowered for (`jax.lax.platform_dependent`), so a CUDA lowering made on a CPU machine is the
    program a GPU runs: on CUDA, cuDNN's flash attention for bf16 / fp16 (it takes no fp32), and
    the blocked form with recomputation (kernels/softmax_blocked.py) otherwise, as on every other
    platform. XLA's `dot_product_attention` keeps the whole T × T probabilities for its backward (at SmolLM2's
    shapes and T 4,096, 67 GB at batch 4 over 30 layers).
    """
    if not _cudnn_takes(q):  # one form for every platform
        return softmax_blocked.recomputed(q, k, v)
    return jax.lax.platform_dependent(q, k, v, cuda=cudnn_attention, default=softmax_blocked.recomputed)


def _cudnn_takes(q) -> bool:
    """Whether cuDNN's fused attention accepts q, and the program is built for CUDA (`targets_cuda`:
    tracing it asks for a CUDA backend's cuDNN, which a CPU-only process building a CPU program lacks)."""
    D = q.shape[-1]
    return q.dtype in HALF_PRECISION and D % 8 == 0 and D <= 128 and targets_cuda()


def cudnn_attention(q, k, v):
    """cuDNN's flash attention (bf16 / fp16, GQA as is): its backward keeps the output and the
    log-sum-exp, not the probabilities."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


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
