"""Hedgehog: normalised linear attention with learned feature maps (paper, sec. 3.1.1).

    y_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t,  S_t = Σ φ(k_i) v_iᵀ,  z_t = Σ φ(k_i)
    φ(x) = softmax([2z, −2z]),  z = x W + b

One map for queries and one for keys per layer, each W ∈ R^{D×D} shared by the
heads and initialised to the identity (b to zero). This is FLA's
HedgehogFeatureMap, which the paper's appendix names as its feature map: one
softmax over the 2D-dimensional concatenation (so φ(x) sums to 1), with the
factor 2 on both halves.
With a window, the softmax and linear parts share one normaliser (LoLCATs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import linear_attn
from linjax.layers import Trainable, torch_linear_tensors
from linjax.mixers.linear import LinearMixer


class FeatureMap(nnx.Module):
    """φ(x) = softmax([2z, −2z]) over the last axis, z = x @ weight + bias (weight [D, D], Flax's [in, out])."""

    def __init__(self, head_dim: int):
        self.weight = Trainable(jnp.eye(head_dim, dtype=jnp.float32))
        self.bias = Trainable(jnp.zeros((head_dim,), jnp.float32))

    def __call__(self, x):
        z = 2 * (x.astype(jnp.float32) @ self.weight[...] + self.bias[...])
        return jax.nn.softmax(jnp.concatenate([z, -z], axis=-1), axis=-1).astype(x.dtype)


class Hedgehog(LinearMixer):
    mechanism = "hedgehog"
    kernel_module = linear_attn
    fla_kernel = "linear_attn"
    normalized = True
    linear_scale = 1.0  # default scale: φ(q)ᵀφ(k) is already the kernel's similarity

    def __init__(self, proj, settings, *, rngs: nnx.Rngs):
        super().__init__(proj, settings, rngs=rngs)
        self.query_map = FeatureMap(proj.head_dim)
        self.key_map = FeatureMap(proj.head_dim)

    def feature_dim(self) -> int:
        return 2 * self.proj.head_dim

    def features(self, q, k):
        return self.query_map(q), self.key_map(k)

    def gates(self, h, k):
        return ()

    @classmethod
    def example_gates(cls, key, batch, time, heads, key_dim):
        return ()

    @classmethod
    def example_features(cls, q, k):
        """φ at initialisation (W = I, b = 0): softmax([2x, −2x]), so Dk = 2 · head_dim."""
        phi = lambda x: jax.nn.softmax(jnp.concatenate([2 * x, -2 * x], axis=-1), axis=-1)
        return phi(q), phi(k)

    def mechanism_tensors(self, prefix):
        return {**torch_linear_tensors(f"{prefix}.query_map.proj", self.query_map.weight, self.query_map.bias),
                **torch_linear_tensors(f"{prefix}.key_map.proj", self.key_map.weight, self.key_map.bias)}
