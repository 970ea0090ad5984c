"""Short causal depthwise convolution: prefill, split prefill and token-by-token decode equal a dense
causal convolution (torch's Conv1d with left padding when torch is present, numpy loops otherwise)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import conv
from tests.helpers import relative_rms, require_module


def _inputs(seed, B=2, T=37, C=24, K=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
    return x, jnp.asarray(0.3 * rng.standard_normal((K, C)), jnp.float32), jnp.asarray(rng.standard_normal(C),
                                                                                        jnp.float32)


def _dense(x, weight, bias):
    """y_t = bias + Σ_i weight[i] x_{t−K+1+i} with zeros before the start, float64 loops."""
    x, weight, bias = (np.asarray(a, np.float64) for a in (x, weight, bias))
    K, T = weight.shape[0], x.shape[1]
    padded = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2])), x], axis=1)
    return bias + sum(weight[i] * padded[:, i:i + T] for i in range(K))


@pytest.mark.parametrize("T, K", [(1, 8), (5, 8), (37, 8), (37, 4), (9, 1)])
def test_prefill_equals_dense(T, K):
    x, weight, bias = _inputs(T + K, T=T, K=K)
    y, cache = conv.apply(x, weight, bias)
    assert relative_rms(y, _dense(x, weight, bias)) <= 1e-6
    expected_cache = np.concatenate([np.zeros((2, K - 1, 24)), np.asarray(x)], axis=1)[:, T:]
    np.testing.assert_array_equal(np.asarray(cache), expected_cache)


def test_matches_torch_conv1d_layout():
    torch = require_module("torch")
    x, weight, bias = _inputs(1)
    torch_weight = torch.tensor(np.asarray(weight).T[:, None, :])  # [C, 1, K] as nn.Conv1d(groups=C)
    expected = torch.nn.functional.conv1d(torch.tensor(np.asarray(x)).transpose(1, 2), torch_weight,
                                          torch.tensor(np.asarray(bias)), padding=7, groups=24)[..., :37]
    y, _ = conv.apply(x, weight, bias)
    assert relative_rms(y, expected.transpose(1, 2).numpy()) <= 1e-6


@pytest.mark.parametrize("K, with_cache", [(8, False), (8, True), (4, True), (1, False)])
def test_gradients_match_the_dense_convolution(K, with_cache):
    """The hand-written backward (kernels/conv.py) against autodiff of the dense causal convolution
    over [cache, x], for x, weight, bias and the cache."""
    x, weight, bias = _inputs(K, K=K)
    cache = jnp.asarray(np.random.default_rng(9).standard_normal((2, K - 1, 24)), jnp.float32) if with_cache else None
    projection = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), jnp.float32)

    def dense(x, weight, bias, cache):
        history = jnp.zeros((2, K - 1, 24)) if cache is None else cache
        padded = jnp.concatenate([history, x], axis=1)
        rows = jnp.arange(x.shape[1])[:, None] + jnp.arange(K)[None, :]  # [T, K]: the window of t
        return bias + jnp.einsum("btkc,kc->btc", padded[:, rows], weight)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a)) * projection)

    argnums = (0, 1, 2, 3) if with_cache else (0, 1, 2)
    ours = jax.grad(loss(lambda *a: conv.apply(*a)[0]), argnums)(x, weight, bias, cache)
    theirs = jax.grad(loss(dense), argnums)(x, weight, bias, cache)
    for a, b in zip(ours, theirs):
        assert relative_rms(a, b) <= 1e-6


@pytest.mark.parametrize("split", [1, 3, 20])
def test_split_prefill_then_step_equals_dense(split):
    x, weight, bias = _inputs(split)
    first, cache = conv.apply(x[:, :split], weight, bias)
    second, cache = conv.apply(x[:, split:30], weight, bias, cache)
    step = jax.jit(conv.step)
    decoded = []
    for t in range(30, 37):
        y, cache = step(x[:, t], weight, bias, cache)
        decoded.append(y[:, None])
    y = jnp.concatenate([first, second, *decoded], axis=1)
    assert relative_rms(y, _dense(x, weight, bias)) <= 1e-6


def test_bf16_keeps_dtype_and_accuracy():
    x, weight, bias = _inputs(2, dtype=jnp.bfloat16)
    y, cache = conv.apply(x, weight, bias)
    assert y.dtype == jnp.bfloat16 and cache.dtype == jnp.bfloat16
    assert relative_rms(y, _dense(x.astype(jnp.float32), weight, bias)) <= 5e-3


def test_bad_shapes_raise_readable_errors():
    x, weight, bias = _inputs(3)
    with pytest.raises(ValueError, match=r"\[kernel_size, channels\]"):
        conv.apply(x, weight.T, bias)
    with pytest.raises(ValueError, match="cache must be"):
        conv.apply(x, weight, bias, jnp.zeros((2, 3, 24)))
    with pytest.raises(ValueError, match="without a time axis"):
        conv.step(x, weight, bias, conv.empty_cache(2, 24))
