"""Building blocks shared by every decoder: RMSNorm, RoPE, SwiGLU MLP, attention projections."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax.config import ModelConfig
from linjax.kernels import scaling


class RMSNorm(nnx.Module):
    """x / rms(x) · w, with the statistics in fp32 (as in HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs):
        del rngs  # no random initialisation: the weight starts at one
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        # The mean and the per-token scaling as matrix-vector products (kernels/scaling.py): their
        # gradients avoid XLA:CPU's slow small reductions (results/bench/HISTORY.md).
        x32 = x.astype(jnp.float32)
        inverse_rms = jax.lax.rsqrt(scaling.row_sums(x32 * x32) / x32.shape[-1] + self.eps)
        return self.weight[...] * scaling.scale_rows(inverse_rms, x32).astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim/2] for `default`, `linear` and Llama-3.1's `llama3` RoPE."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, and the band in
        # between interpolated smoothly (Llama 3.1 report, "RoPE scaling").
        factor = config.rope_factor
        old_len = config.rope_original_max_position_embeddings
        low_wavelen = old_len / config.rope_low_freq_factor
        high_wavelen = old_len / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - config.rope_low_freq_factor) / (
            config.rope_high_freq_factor - config.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [B,T,N,D] by positions [B,T]; HF's half-split (not interleaved) layout."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B,T,1,D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.gate_proj = linear(d, f)
        self.up_proj = linear(d, f)
        self.down_proj = linear(f, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nnx.Module):
    """The pretrained q/k/v/o projections, with RoPE and (Qwen3) per-head q/k RMSNorm.

    Every mixer, softmax or linear, reads its queries, keys and values from here,
    so linearizing a layer reuses these (frozen) modules instead of copying them.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        qkv_bias = config.attention_bias
        o_bias = config.attention_bias and config.model_type == "llama"
        linear = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.q_proj = linear(d, self.num_heads * hd, qkv_bias)
        self.k_proj = linear(d, self.num_kv_heads * hd, qkv_bias)
        self.v_proj = linear(d, self.num_kv_heads * hd, qkv_bias)
        self.o_proj = linear(self.num_heads * hd, d, o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None
        self.config = config

    def _project(self, name: str, x: jax.Array, lora) -> jax.Array:
        y = getattr(self, name)(x)
        return y if lora is None else y + lora.delta(name, x)

    def key_projection(self, x: jax.Array, lora=None) -> jax.Array:
        """x [B,T,d] → the keys as k_proj (and LoRA) give them [B,T,Hkv·D], before q/k norm and RoPE."""
        return self._project("k_proj", x, lora)

    def qkv(self, x: jax.Array, positions: jax.Array, lora=None):
        """x [B,T,d] → q [B,T,H,D], k [B,T,Hkv,D], v [B,T,Hkv,D], after q/k norm and RoPE.

        `lora` (a `linjax.adapters.LoRA`) adds its low-rank updates to the frozen projections.
        """
        b, t, _ = x.shape
        q = self._project("q_proj", x, lora).reshape(b, t, self.num_heads, self.head_dim)
        k = self._project("k_proj", x, lora).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self._project("v_proj", x, lora).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inverse_frequencies(self.config)  # constant-folded under jit
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def out(self, o: jax.Array, lora=None) -> jax.Array:
        """o [B,T,H,D] → [B,T,d]."""
        b, t = o.shape[:2]
        return self._project("o_proj", o.reshape(b, t, self.num_heads * self.head_dim), lora)


class Trainable(nnx.Param):
    """A parameter that linearization adds; everything else (plain `nnx.Param`) is the frozen backbone.

    Training filters on this type: gradients and optimizer state exist only for it.
    """


def torch_linear_init(key, shape, fan_in: int, dtype=jnp.float32) -> jax.Array:
    """U(−1/√fan_in, 1/√fan_in): PyTorch's default for nn.Linear/Conv1d weights and biases.

    The paper keeps PyTorch's default initialisation for every new tensor it does
    not name, so linjax does the same.
    """
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def float32_array(param) -> np.ndarray:
    """A parameter (or array) as a float32 NumPy array: the PyTorch export's dtype."""
    return np.asarray(param[...], dtype=np.float32)


def torch_linear_tensors(prefix: str, weight, bias=None) -> dict[str, np.ndarray]:
    """A Flax [in, out] kernel (+ bias) as the tensors of a torch nn.Linear named `prefix` ([out, in]), float32."""
    out = {f"{prefix}.weight": np.ascontiguousarray(float32_array(weight).T)}
    if bias is not None:
        out[f"{prefix}.bias"] = float32_array(bias)
    return out
