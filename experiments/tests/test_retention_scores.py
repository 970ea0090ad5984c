"""experiments/retention_scores.py: the candidate scores and how they separate a needle from the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.tests.helpers import experiment_script
from linjax.kernels import gdn


@pytest.fixture(scope="module")
def scores():
    return experiment_script("retention_scores.py")


def test_separation_ranks_the_needle_against_the_others(scores):
    score = np.zeros(200)
    others = np.arange(100, 200)
    score[others] = np.linspace(0.0, 1.0, 100)
    score[[3, 4]] = [2.0, 0.5]  # one needle token above every other token, one in the middle
    auc, top = scores.separation(score, [3, 4], others)
    assert auc == pytest.approx((1.0 + 0.5) / 2)  # 0.5 is above 50 of the 100 others
    assert top == 1.0  # 2.0 first, 0.5 52nd: both among the 64 highest
    score[4] = -1.0  # now below every other: out of the 64 highest
    auc, top = scores.separation(score, [3, 4], others)
    assert auc == pytest.approx(0.5) and top == 0.5


def test_window_attention_mass_counts_each_query_once(scores):
    T, H, Hkv, D = 96, 4, 2, 8
    q, k = (jax.random.normal(key, (T, heads, D)) for key, heads in zip(jax.random.split(jax.random.key(0)), (H, Hkv)))
    received = np.asarray(scores.window_attention_mass(q, k))
    assert received.shape == (T, Hkv)
    # every query's probabilities sum to 1: per kv head the received mass sums to T
    np.testing.assert_allclose(received.sum(axis=0), T, rtol=1e-5)
    # the last token is seen by its own query only; a token past the window by nothing later than WINDOW
    assert np.all(received[-1] <= 1.0 + 1e-6)
    visible_queries = np.minimum(T - np.arange(scores.SINKS, T), scores.WINDOW)
    assert np.all(received[scores.SINKS:] <= visible_queries[:, None] + 1e-5)


def test_recall_as_leaving_is_the_error_against_the_earlier_tokens_state(scores):
    T, H, Hkv, D = 12, 4, 2, 8
    keys = jax.random.split(jax.random.key(1), 4)
    k = jax.random.normal(keys[0], (T, Hkv, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[1], (T, Hkv, D))
    log_alpha = -jax.nn.softplus(jax.random.normal(keys[2], (T, H, D)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (T, H)))
    errors = np.asarray(scores.recall_as_leaving(k, v, log_alpha, beta))
    assert errors.shape == (T, Hkv)
    np.testing.assert_allclose(errors[0], 1.0, rtol=1e-6)  # the empty state recalls nothing
    # token 5 against the state of tokens 0-4, built by the kernel's own recurrence
    _, state = gdn.reference(jnp.zeros((1, 5, H, D)), k[None, :5], v[None, :5], log_alpha[None, :5], beta[None, :5])
    S = state * jnp.exp(log_alpha[5])[None, :, :, None]
    recalled = jnp.einsum("hk,hkv->hv", jnp.repeat(k[5], H // Hkv, axis=0), S[0])
    vv = jnp.repeat(v[5], H // Hkv, axis=0)
    expected = (jnp.linalg.norm(vv - recalled, axis=-1) / jnp.linalg.norm(vv, axis=-1)).reshape(Hkv, -1).mean(-1)
    np.testing.assert_allclose(errors[5], expected, rtol=1e-4)
