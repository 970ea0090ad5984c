"""GLA: S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ (paper, sec. 3.1.2), with the appendix's low-rank gate.

log α_t = LogSigmoid(h_t W1 W2 + b), W1 ∈ R^{d×16}, W2 ∈ R^{16×(H·D)}, b initialised to 1
(`LinearizeConfig.gate_bias`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import gla
from linjax.layers import Trainable, torch_linear_init, torch_linear_tensors
from linjax.mixers.linear import LinearMixer


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


class GLA(LinearMixer):
    mechanism = "gla"
    kernel = gla

    def __init__(self, proj, settings, *, rngs: nnx.Rngs):
        super().__init__(proj, settings, rngs=rngs)
        hidden = proj.q_proj.kernel.shape[0]
        self.gate = LowRankGate(hidden, proj.num_heads, proj.head_dim, rank=settings.gate_rank,
                                 bias=settings.gate_bias, rngs=rngs)

    def gates(self, h, k):
        return (self.gate(h),)

    def mechanism_tensors(self, prefix):
        return {**torch_linear_tensors(f"{prefix}.gate_down", self.gate.down),
                **torch_linear_tensors(f"{prefix}.gate_up", self.gate.up, self.gate.bias)}
