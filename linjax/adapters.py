"""The paper's two projection adapters: LoRA on q/k/v/o and a short convolution on q, k and v."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax.kernels import conv
from linjax.layers import AttentionProjections, Trainable, float32_array, torch_linear_init


class LoRA(nnx.Module):
    """Low-rank updates x·A·B·(alpha/rank) for q_proj, k_proj, v_proj and o_proj (PEFT's defaults), or the
    projections `targets` names ("q", "k", "v", "o"); the others keep their pretrained weights.

    A starts like PEFT's (kaiming-uniform, bound 1/√in) and B at zero, so the
    adapted model starts equal to the pretrained one.
    """

    def __init__(self, proj: AttentionProjections, *, rank: int = 8, alpha: float = 16.0,
                 targets=("q", "k", "v", "o"), rngs: nnx.Rngs):
        self.scaling = alpha / rank
        self.targets = tuple(f"{t}_proj" for t in targets)
        for name in self.targets:
            fan_in, fan_out = getattr(proj, name).kernel.shape
            down = Trainable(torch_linear_init(rngs.params(), (fan_in, rank), fan_in))
            up = Trainable(jnp.zeros((rank, fan_out), jnp.float32))
            setattr(self, f"{name}_a", down)
            setattr(self, f"{name}_b", up)

    def delta(self, name: str, x: jax.Array) -> jax.Array:
        if name not in self.targets:
            return jnp.zeros((), x.dtype)  # a projection LoRA does not adapt
        a, b = getattr(self, f"{name}_a")[...], getattr(self, f"{name}_b")[...]
        return ((x @ a.astype(x.dtype)) @ b.astype(x.dtype)) * jnp.asarray(self.scaling, x.dtype)

    def merged_weights(self, prefix: str, pretrained: dict) -> dict[str, np.ndarray]:
        """The PyTorch export's q/k/v/o_proj weights under `prefix` with the update folded in:
        W + (alpha/rank)·A·B, in float64 then float32. `pretrained`: the torch [out, in] weights by name.
        Exact, because the mixer applies the adapted projections everywhere it uses them."""
        out = {}
        for name in self.targets:
            a = np.asarray(getattr(self, f"{name}_a")[...], np.float64)
            b = np.asarray(getattr(self, f"{name}_b")[...], np.float64)
            key = f"{prefix}.{name}.weight"
            merged = pretrained[key].astype(np.float64) + self.scaling * (a @ b).T
            out[key] = merged.astype(np.float32)
        return out


class ShortConv(nnx.Module):
    """Causal depthwise conv1d (kernel 8, bias, no activation) on q, k and v, after RoPE (paper, appendix).

    init "torch": PyTorch's Conv1d default (fan-in = kernel size for a depthwise conv), as FLA and the
    paper. init "identity": the current token's tap 1, every other tap and the bias 0, so the conv
    starts as the identity: what the window softmax needs to start as the pretrained attention when
    it reads the convolved q, k, v (`conv_on_window`).
    """

    def __init__(self, q_channels: int, kv_channels: int, *, kernel_size: int = 8, init: str = "torch",
                 rngs: nnx.Rngs):
        self.kernel_size = kernel_size
        for name, channels in (("q", q_channels), ("k", kv_channels), ("v", kv_channels)):
            if init == "identity":
                weight = jnp.zeros((kernel_size, channels), jnp.float32).at[-1].set(1.0)  # weight[K-1]: token t
                bias = jnp.zeros((channels,), jnp.float32)
            else:
                weight = torch_linear_init(rngs.params(), (kernel_size, channels), kernel_size)
                bias = torch_linear_init(rngs.params(), (channels,), kernel_size)
            setattr(self, f"{name}_weight", Trainable(weight))
            setattr(self, f"{name}_bias", Trainable(bias))

    def empty_caches(self, batch: int, q_channels: int, kv_channels: int, dtype):
        return tuple(conv.empty_cache(batch, c, self.kernel_size, dtype)
                     for c in (q_channels, kv_channels, kv_channels))

    def __call__(self, q, k, v, caches=None):
        """q [B,T,H,D], k, v [B,T,Hkv,D] → the same shapes, plus the new caches."""
        caches = caches or (None, None, None)
        outs, new_caches = [], []
        for name, x, cache in zip("qkv", (q, k, v), caches):
            b, t, n, d = x.shape
            y, cache = conv.apply(x.reshape(b, t, n * d), getattr(self, f"{name}_weight")[...],
                                  getattr(self, f"{name}_bias")[...], cache)
            outs.append(y.reshape(b, t, n, d))
            new_caches.append(cache)
        return tuple(outs), tuple(new_caches)

    def torch_tensors(self, prefix: str) -> dict[str, np.ndarray]:
        """The PyTorch mirror's {q,k,v}_conv under `prefix`: depthwise Conv1d weights [C, 1, K] and biases."""
        out = {}
        for name in "qkv":
            weight = float32_array(getattr(self, f"{name}_weight"))  # [K, C]
            out[f"{prefix}.{name}_conv.weight"] = np.ascontiguousarray(weight.T[:, None, :])
            out[f"{prefix}.{name}_conv.bias"] = float32_array(getattr(self, f"{name}_bias"))
        return out
