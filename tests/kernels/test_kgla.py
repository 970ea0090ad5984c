"""kGLA kernels: chunked and step against the reference (which applies α ⊙ max(1 − βk², floor) per step
without logs), and the reference against FLA's naive GLA run on the combined log-gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gla, kgla
from tests.helpers import relative_rms
from tests.kernels.fla_oracle import fla_naive
from tests.kernels.test_gla import (
    REDUCED_GRID,
    REDUCED_IDS,
    B,
    H,
    compare_bf16,
    compare_chunked,
    compare_split,
    compare_step,
    random_inputs,
)


@pytest.mark.parametrize("T, Hkv, D, init", REDUCED_GRID, ids=REDUCED_IDS)
def test_chunked_matches_reference(T, Hkv, D, init):
    args, state = random_inputs("kgla", T * 17 + Hkv * 5 + D, T, Hkv, D, init=init)
    compare_chunked("kgla", args, state, seed=T + 2 * D)


@pytest.mark.parametrize("T, Hkv", [(15, 1), (70, 2)])
def test_step_matches_reference(T, Hkv):
    args, state = random_inputs("kgla", 40 + T, T, Hkv, 16)
    compare_step("kgla", args, state)


@pytest.mark.parametrize("split", [1, 150])
def test_split_sequence_equals_one_pass(split):
    args, state = random_inputs("kgla", 50 + split, 200, 2, 16)
    compare_split("kgla", args, state, split)


def test_bf16_inputs():
    args, state = random_inputs("kgla", 77, 130, 2, 64)
    compare_bf16("kgla", args, state)


@pytest.mark.parametrize("beta_value", [1e-4, 0.999])
@pytest.mark.parametrize("gate", ["mild", "hard"])
def test_extreme_beta_gates_and_parallel_keys(beta_value, gate):
    """β at 1e-4 / 0.999, log α per step in [−1000, −20] or mild, keys nearly parallel (and some one-hot,
    where 1 − βk² = 0.001 is close to the floor)."""
    T, D = 200, 16
    rng = np.random.default_rng(3)
    log_alpha = (-rng.uniform(20.0, 1000.0, (B, T, H, D)) if gate == "hard"
                 else -np.logaddexp(0.0, -3.0 - rng.standard_normal((B, T, H, D))))
    beta = np.full((B, T, H), beta_value)
    (q, k, v, log_alpha, beta), state = random_inputs("kgla", 8, T, 1, D, log_alpha=log_alpha, beta=beta)
    k = rng.standard_normal((1, 1, 1, D)) + 1e-3 * np.asarray(k)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    k[:, ::7] = np.eye(D)[rng.integers(0, D, (B, (T + 6) // 7, 1))]
    compare_chunked("kgla", (q, jnp.asarray(k, jnp.float32), v, log_alpha, beta), state,
                    out_tol=1e-4, grad_tol=1e-4)


def test_erase_factor_is_floored():
    """β k² ≥ 1 would make the decay ≤ 0 (log −∞): it is floored at `floor`, finite in value and gradient."""
    (q, k, v, g, _), state = random_inputs("kgla", 4, 15, 2, 16)  # a REDUCED_GRID shape: compiled already
    k = 2.0 * jax.nn.one_hot(jnp.zeros((B, 15, 2), int), 16)  # k² = 4 on channel 0
    beta = jnp.ones((B, 15, H))
    gate = kgla.key_log_gate(g, beta, gla.expand_kv_heads(k, H))
    assert np.allclose(gate[..., 0] - g[..., 0], np.log(kgla.KEY_GATE_FLOOR), atol=0.02)  # 1 − (1 − floor) in fp32
    compare_chunked("kgla", (q, k, v, g, beta), state)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_matches_fla_naive_gla_on_combined_gate(dtype):
    """FLA has no kGLA; its naive GLA with gk = log α + log(1 − βk²) is the same recurrence.
    (FLA's KDA is the full delta rule (I − β k kᵀ), not this diagonal form.)"""
    naive = fla_naive("gla")  # skips, or fails in CI, without torch and fla-core
    import torch
    (q, k, v, g, beta), state = random_inputs("kgla", 31, 70, 2, 16)
    o, final = kgla.reference(q, k, v, g, beta, initial_state=state)
    # FLA's naive GLA has no GQA: repeat kv heads with numpy (not linjax's expand_kv_heads).
    k_h, v_h = (np.repeat(np.asarray(x), H // x.shape[2], axis=2) for x in (k, v))
    combined = np.asarray(g, np.float64) + np.log1p(-np.asarray(beta, np.float64)[..., None]
                                                   * np.asarray(k_h, np.float64) ** 2)
    t = lambda x: torch.tensor(np.asarray(x), dtype=getattr(torch, dtype))
    o_fla, final_fla = naive.naive_recurrent_gla(t(q), t(k_h), t(v_h), t(combined), initial_state=t(state),
                                                 output_final_state=True)
    assert relative_rms(o, o_fla.numpy()) <= 1e-5
    assert relative_rms(final, final_fla.numpy()) <= 1e-5


def test_bad_beta_shape_raises():
    (q, k, v, g, beta), _ = random_inputs("kgla", 0, 8, 2, 16)
    with pytest.raises(ValueError, match=r"beta \(\[B, T, H\]\)"):
        kgla.chunked(q, k, v, g, beta[..., :2])
