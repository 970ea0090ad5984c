"""Hedgehog with a window and per-head output gains is LoLCATs' sliding-window hybrid.

LoLCATs (Zhang et al. 2024, its sliding-window attention) computes, for query t and head h,

    y_t = (f_h Σ_{j in window} e^{s_tj − m_t} v_j + Σ_{j before it} φ(q_t)·φ(k_j) v_j)
          / (f_h Σ_{j in window} e^{s_tj − m_t}   + Σ_{j before it} φ(q_t)·φ(k_j)),

s_tj = q_t·k_j / √D, m_t the window's largest score, the window the current token and the 63 before
it, f_h = sigmoid(a learned factor). linjax's Hedgehog with combine "sum" and output_gain weighs the
linear numerator and normaliser by g_h instead; dividing LoLCATs' numerator and denominator by f_h
shows the two agree when g_h = 1 / f_h (configs/claims/lolcats-at.toml relies on it). The reference
below is that equation, written out in float64 with every pair (t, j) explicit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import linjax
from linjax.config import tiny_config
from linjax.model import CausalLM

WINDOW, T = 8, 29


def lolcats_hybrid(q, k, v, phi_q, phi_k, window_factor, window):
    """LoLCATs' equation for one sequence: q, phi_q [T, H, ·]; k, v, phi_k [T, H, ·] (kv heads repeated)."""
    steps, heads, dim = q.shape
    y = np.zeros((steps, heads, v.shape[-1]))
    for t in range(steps):
        inside = np.arange(max(0, t - window + 1), t + 1)
        before = np.arange(0, max(0, t - window + 1))
        for h in range(heads):
            scores = k[inside, h] @ q[t, h] / np.sqrt(dim)
            soft = window_factor[h] * np.exp(scores - scores.max())
            linear = phi_k[before, h] @ phi_q[t, h]
            y[t, h] = (soft @ v[inside, h] + linear @ v[before, h]) / (soft.sum() + linear.sum())
    return y


def test_hedgehog_with_a_window_and_gains_is_lolcats_hybrid_with_window_factors_one_over_the_gain():
    config = linjax.LinearizeConfig(mechanism="hedgehog", window=WINDOW, sinks=0, combine="sum",
                                    output_gain=True, kernel="chunked")
    model = linjax.linearize(CausalLM(tiny_config("llama"), rngs=nnx.Rngs(0)), config, seed=1)
    mixer = model.layers[0].attn
    keys = jax.random.split(jax.random.key(2), 3)
    # Maps away from the identity and gains away from 1, so a wrong weighting or a swapped map shows.
    for feature_map, key in ((mixer.query_map, keys[0]), (mixer.key_map, keys[1])):
        feature_map.weight[...] = feature_map.weight[...] + 0.3 * jax.random.normal(key, feature_map.weight.shape)
    mixer.output_gain[...] = jnp.asarray([0.4, 1.0, 3.0, 10.0])  # 10: LoLCATs' start, f = sigmoid(-2.197) = 0.1

    x = jax.random.normal(keys[2], (1, T, model.config.hidden_size))
    positions = jnp.arange(T)[None]
    got = np.asarray(mixer(x, positions))

    q, k, v = mixer.proj.qkv(x, positions)
    phi_q, phi_k = mixer.features(q, k)
    repeat = q.shape[2] // k.shape[2]  # GQA: query head h reads kv head h // repeat
    k, v, phi_k = (np.repeat(np.asarray(a[0], np.float64), repeat, axis=1) for a in (k, v, phi_k))
    y = lolcats_hybrid(np.asarray(q[0], np.float64), k, v, np.asarray(phi_q[0], np.float64), phi_k,
                       1.0 / np.asarray(mixer.output_gain[...], np.float64), WINDOW)
    expected = np.asarray(mixer.proj.out(jnp.asarray(y[None], jnp.float32)))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)
    # The gains matter: with LoLCATs' factors left at 1 the outputs differ.
    unweighted = lolcats_hybrid(np.asarray(q[0], np.float64), k, v, np.asarray(phi_q[0], np.float64), phi_k,
                                np.ones(q.shape[2]), WINDOW)
    assert not np.allclose(np.asarray(mixer.proj.out(jnp.asarray(unweighted[None], jnp.float32))), got,
                           rtol=2e-4, atol=2e-5)
