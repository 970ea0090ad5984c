"""GLA: S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ (paper, sec. 3.1.2), with one of two decay gates.

`gate = "low_rank"` (the default), the paper's appendix: log α_t = LogSigmoid(h_t W1 W2 + b),
W1 ∈ R^{d×16}, W2 ∈ R^{16×(H·D)}, b initialised to 1 (`LinearizeConfig.gate_bias`).

`gate = "liger_pooled_key"`, Liger-GLA's (Lan et al. 2025): the gate reuses the frozen key
projection, log α_t = LogSigmoid(Pool(k_proj(h_t))) / 16, and adds no parameters. Liger's pool is
an adaptive average pool of k_proj's output to Hkv·D channels, the width it already has, so it
is the identity: each key channel, before q/k norm and RoPE (with LoRA's update when there is
one), is the logit of its own decay. Dividing by 16 (Liger's gate logit normaliser, as in GLA's
original gate) keeps α near 1: α = sigmoid(k)^(1/16), 0.96 at k = 0. Query head h reads kv
head h // (H / Hkv), as the keys do.

`feature_map = "softmax"` is Liger-GLA's feature map: the kernel reads softmax(q) and softmax(k) over
the head dimension instead of L2-normalised q and k; Liger takes them before RoPE (`linear_rope =
false`) and runs its GLA over every token beside the window (`state_covers_window = true`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import gla
from linjax.layers import Trainable, torch_linear_init, torch_linear_tensors
from linjax.mixers.linear import LinearMixer

LIGER_GATE_NORMALIZER = 16.0


class LowRankGate(nnx.Module):
    """log α = LogSigmoid(h W1 W2 + b): one decay per query head and key channel, in fp32."""

    def __init__(self, hidden: int, heads: int, head_dim: int, *, rank: int = 16, bias: float = 1.0,
                 rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, head_dim
        self.down = Trainable(torch_linear_init(rngs.params(), (hidden, rank), hidden))
        self.up = Trainable(torch_linear_init(rngs.params(), (rank, heads * head_dim), rank))
        self.bias = Trainable(jnp.full((heads * head_dim,), bias, jnp.float32))

    def __call__(self, h):
        b, t, _ = h.shape
        logits = h.astype(jnp.float32) @ self.down[...] @ self.up[...] + self.bias[...]
        return jax.nn.log_sigmoid(logits).reshape(b, t, self.heads, self.head_dim)


class PooledKeyGate(nnx.Module):
    """Liger's log α = LogSigmoid(k) / 16 from the key projection's output k [B,T,Hkv·D]. No parameters."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def __call__(self, key):
        b, t, _ = key.shape
        logits = key.astype(jnp.float32).reshape(b, t, self.kv_heads, self.head_dim)
        log_alpha = jax.nn.log_sigmoid(logits) / LIGER_GATE_NORMALIZER
        return jnp.repeat(log_alpha, self.heads // self.kv_heads, axis=2)  # [B,T,H,D]


def example_decay(key, batch, time, heads, *channels):
    """Random log α [B,T,H,*channels] = LogSigmoid(2 + N(0, 1)): α mostly between 0.7 and 0.99."""
    return jax.nn.log_sigmoid(2.0 + jax.random.normal(key, (batch, time, heads, *channels), jnp.float32))


class GLA(LinearMixer):
    mechanism = "gla"
    kernel_module = gla
    fla_kernel = "gla"

    def __init__(self, proj, settings, *, rngs: nnx.Rngs):
        super().__init__(proj, settings, rngs=rngs)
        self.feature_map = settings.feature_map
        if settings.gate == "liger_pooled_key":
            self.gate = PooledKeyGate(proj.num_heads, proj.num_kv_heads, proj.head_dim)
        else:
            hidden = proj.q_proj.kernel.shape[0]
            self.gate = LowRankGate(hidden, proj.num_heads, proj.head_dim, rank=settings.gate_rank,
                                     bias=settings.gate_bias, rngs=rngs)

    def features(self, q, k):
        """`feature_map` "softmax": Liger's softmax(q), softmax(k) over the head dimension, in fp32 (each
        a distribution over the D channels, so qᵀk ∈ (0, 1]); "l2": the paper's L2 normalisation."""
        if self.feature_map == "softmax":
            return (jax.nn.softmax(q.astype(jnp.float32), axis=-1).astype(q.dtype),
                    jax.nn.softmax(k.astype(jnp.float32), axis=-1).astype(k.dtype))
        return super().features(q, k)

    def decay(self, h):
        """log α [B,T,H,D] from the block input h [B,T,d]."""
        if isinstance(self.gate, PooledKeyGate):
            return self.gate(self.proj.key_projection(h, self.lora))
        return self.gate(h)

    def gates(self, h, k):
        return (self.decay(h),)

    @classmethod
    def example_gates(cls, key, batch, time, heads, key_dim):
        return (example_decay(key, batch, time, heads, key_dim),)

    def mechanism_tensors(self, prefix):
        if isinstance(self.gate, PooledKeyGate):  # the PyTorch mirror reads its (merged) k_proj
            return {}
        return {**torch_linear_tensors(f"{prefix}.gate_down", self.gate.down),
                **torch_linear_tensors(f"{prefix}.gate_up", self.gate.up, self.gate.bias)}
