"""The original gated delta rule: as GDN, but α_t is one scalar per head.

log α_t = LogSigmoid(h_t W_α + b_α), W_α ∈ R^{d×H}, b_α initialised to 1 (the
per-channel gate's initialisation, so the two variants start from the same decay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import gdn
from linjax.layers import Trainable, torch_linear_init, torch_linear_tensors
from linjax.mixers.gdn import Beta, example_beta
from linjax.mixers.gla import example_decay
from linjax.mixers.linear import LinearMixer


class GDNScalar(LinearMixer):
    mechanism = "gdn_scalar"
    kernel_module = gdn  # GDN's kernel with a log α of one value per head, [B,T,H]
    fla_kernel = "gated_delta_rule"

    def __init__(self, proj, settings, *, rngs: nnx.Rngs):
        super().__init__(proj, settings, rngs=rngs)
        hidden, heads = proj.q_proj.kernel.shape[0], proj.num_heads
        self.gate_weight = Trainable(torch_linear_init(rngs.params(), (hidden, heads), hidden))
        self.gate_bias = Trainable(jnp.full((heads,), settings.gate_bias, jnp.float32))
        self.beta = Beta(hidden, heads, rngs=rngs)

    def gates(self, h, k):
        log_alpha = jax.nn.log_sigmoid(h.astype(jnp.float32) @ self.gate_weight[...] + self.gate_bias[...])
        return log_alpha, self.beta(h)

    @classmethod
    def example_gates(cls, key, batch, time, heads, key_dim):
        decay_key, beta_key = jax.random.split(key)
        return example_decay(decay_key, batch, time, heads), example_beta(beta_key, batch, time, heads)

    def mechanism_tensors(self, prefix):
        return {**torch_linear_tensors(f"{prefix}.gate_proj", self.gate_weight, self.gate_bias),
                **self.beta.torch_tensors(prefix)}
