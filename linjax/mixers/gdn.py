"""GDN in the Kimi form, the paper's "GDN": S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ.

The delta rule's rank-1 correction is what the paper's first-order analysis
(sec. 3.2) finds in softmax attention. Gate as GLA; β_t = sigmoid(h_t W_β + b_β)
per query head, W_β ∈ R^{d×H}, b_β initialised to −1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import gdn
from linjax.layers import Trainable, torch_linear_init, torch_linear_tensors
from linjax.mixers.gla import GLA, example_decay


class Beta(nnx.Module):
    """β = sigmoid(h W_β + b_β) ∈ (0, 1), one per query head."""

    def __init__(self, hidden: int, heads: int, *, rngs: nnx.Rngs):
        self.weight = Trainable(torch_linear_init(rngs.params(), (hidden, heads), hidden))
        self.bias = Trainable(jnp.full((heads,), -1.0, jnp.float32))

    def __call__(self, h):
        return jax.nn.sigmoid(h.astype(jnp.float32) @ self.weight[...] + self.bias[...])

    def torch_tensors(self, prefix: str):
        """As the PyTorch mirror's `beta_proj` under `prefix`."""
        return torch_linear_tensors(f"{prefix}.beta_proj", self.weight, self.bias)


def example_beta(key, batch, time, heads):
    """Random β [B,T,H] = sigmoid(N(0, 1))."""
    return jax.nn.sigmoid(jax.random.normal(key, (batch, time, heads), jnp.float32))


class GDN(GLA):
    """GLA's gate plus β: the same parameters, created in the same order, and a delta-rule kernel."""

    mechanism = "gdn"
    kernel_module = gdn
    fla_kernel = "kda"  # FLA's Kimi Delta Attention: the delta rule with a per-channel decay

    def __init__(self, proj, settings, *, rngs: nnx.Rngs):
        super().__init__(proj, settings, rngs=rngs)
        self.beta = Beta(proj.q_proj.kernel.shape[0], proj.num_heads, rngs=rngs)

    def gates(self, h, k):
        return self.gate(h), self.beta(h)

    @classmethod
    def example_gates(cls, key, batch, time, heads, key_dim):
        decay_key, beta_key = jax.random.split(key)
        return example_decay(decay_key, batch, time, heads, key_dim), example_beta(beta_key, batch, time, heads)

    def mechanism_tensors(self, prefix):
        return {**super().mechanism_tensors(prefix), **self.beta.torch_tensors(prefix)}
