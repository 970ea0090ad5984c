"""Short causal depthwise convolution (the paper's short-conv adapter, FLA `ShortConvolution` without activation).

    y_t = bias + Σ_{i=0}^{K-1} weight[i] ⊙ x_{t-K+1+i}

weight [K, C] (weight[K-1] multiplies the current token; a torch Conv1d
weight [C, 1, K] maps to weight = w[:, 0, :].T), bias [C], applied channel by
channel. Positions before the start read the cache of the K−1 previous inputs
(zeros for a fresh sequence).

    apply(x [B,T,C], weight [K,C], bias [C], cache=None) -> (y [B,T,C], new_cache [B,K-1,C])
    step(x [B,C], weight, bias, cache) -> (y [B,C], new_cache)     # one decode token

Prefill, prefill split anywhere, and prefill then `step` token by token all
equal one dense causal convolution. Accumulation is fp32; y and the cache keep
x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linjax.kernels import scaling

DEFAULT_KERNEL_SIZE = 8


def _check(x, weight, bias, cache):
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, time, channels]; got shape {x.shape}")
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[1] != C:
        raise ValueError(f"weight must be [kernel_size, channels] = [K, {C}]; got {weight.shape} "
                         "(a torch Conv1d weight [C, 1, K] maps to w[:, 0, :].T)")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [channels] = [{C}]; got {bias.shape}")
    K = weight.shape[0]
    if cache is not None and cache.shape != (B, K - 1, C):
        raise ValueError(f"cache must be [batch, kernel_size - 1, channels] = [{B}, {K - 1}, {C}]; got {cache.shape}")
    return B, T, C, K


def empty_cache(batch, channels, kernel_size=DEFAULT_KERNEL_SIZE, dtype=jnp.float32):
    """The cache of a fresh sequence: K−1 zero inputs."""
    return jnp.zeros((batch, kernel_size - 1, channels), dtype)


def _taps(padded, w, length):
    """Σ_i w[i] ⊙ padded[:, i:i + length]: K shifted multiply-adds, cheaper than a general conv."""
    return sum(w[i] * padded[:, i:i + length] for i in range(w.shape[0]))


@jax.custom_vjp
def _causal_conv(padded, w):
    """y [B,T,C] from padded [B,K−1+T,C] and w [K,C], fp32."""
    return _taps(padded, w, padded.shape[1] - w.shape[0] + 1)


def _causal_conv_forward(padded, w):
    return _causal_conv(padded, w), (padded, w)


def _causal_conv_backward(residuals, dy):
    """The backward written out as the same kind of shifted multiply-adds. Autodiff of the K slices
    would pad dy into K full-size buffers and add them (results/bench/HISTORY.md)."""
    padded, w = residuals
    K, T = w.shape[0], dy.shape[1]
    # d padded[s] = Σ_i w[i] dy[s − i]: the taps reversed, over dy padded by K − 1 on both sides.
    dy_padded = jnp.pad(dy, ((0, 0), (K - 1, K - 1), (0, 0)))
    d_padded = _taps(dy_padded, w[::-1], T + K - 1)
    # d w[i] = Σ_{b,t} dy[b,t] ⊙ padded[b,t + i]: per tap, a fused product summed over (b, t) by a
    # vector-matrix product; one einsum over the K stacked windows makes XLA:CPU transpose the stack.
    return d_padded, jnp.stack([scaling.column_sums((padded[:, i:i + T] * dy).reshape(-1, dy.shape[-1]))
                                for i in range(K)])


_causal_conv.defvjp(_causal_conv_forward, _causal_conv_backward)


def apply(x, weight, bias, cache=None):
    """Causal depthwise conv over [B,T,C] (any T ≥ 1), continuing from `cache`; returns (y, new_cache)."""
    B, T, C, K = _check(x, weight, bias, cache)
    if cache is None:
        cache = empty_cache(B, C, K, x.dtype)
    padded = jnp.concatenate([cache.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    y = _causal_conv(padded.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype), padded[:, T:]


def step(x, weight, bias, cache):
    """One decode token x [B,C] -> (y [B,C], new_cache)."""
    if x.ndim != 2:
        raise ValueError(f"step takes one token without a time axis: x must be [batch, channels]; got {x.shape}")
    y, cache = apply(x[:, None], weight, bias, cache)
    return y[:, 0], cache
