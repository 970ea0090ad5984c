"""Normalised linear attention: chunked and step against the reference, the [S, z] state layout,
the unnormalised mode for the window mixer, and FLA's naive linear attention as an oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import linear_attn
from tests.helpers import relative_rms
from tests.kernels.fla_oracle import fla_naive
from tests.kernels.test_gla import (
    REDUCED_GRID,
    REDUCED_IDS,
    compare_bf16,
    compare_chunked,
    compare_split,
    compare_step,
    random_inputs,
)


@pytest.mark.parametrize("T, Hkv, D, init", REDUCED_GRID, ids=REDUCED_IDS)
def test_chunked_matches_reference(T, Hkv, D, init):
    """Compared unnormalised (numerator, state, normaliser): the normalised o is ill-conditioned in q and k
    (at T = 1 it equals v exactly, so its q/k gradients are pure rounding noise); the division itself is
    checked by the step, split, bf16 and FLA tests."""
    args, state = random_inputs("linear_attn", T * 3 + Hkv * 11 + D, T, Hkv, D, init=init)
    compare_chunked("linear_attn", args, state, seed=T + 3 * D, options=(("normalize", False),))


@pytest.mark.parametrize("T, Hkv", [(15, 2), (70, 1)])
def test_step_matches_reference(T, Hkv):
    args, state = random_inputs("linear_attn", 60 + T, T, Hkv, 16)
    compare_step("linear_attn", args, state)


@pytest.mark.parametrize("split", [100])
def test_split_sequence_equals_one_pass(split):
    args, state = random_inputs("linear_attn", 70 + split, 200, 2, 16)
    compare_split("linear_attn", args, state, split)


def test_bf16_inputs():
    args, state = random_inputs("linear_attn", 78, 130, 2, 64)
    compare_bf16("linear_attn", args, state)


def test_state_layout_and_unnormalised_mode():
    """state[..., :Dv] = Σ k vᵀ, state[..., Dv] = Σ k; normalize=False gives o = numerator / normaliser."""
    (q, k, v), _ = random_inputs("linear_attn", 5, 40, 4, 16)
    (o, normaliser), state = linear_attn.chunked(q, k, v)
    (numerator, normaliser_raw), state_raw = linear_attn.chunked(q, k, v, normalize=False)
    assert numerator.dtype == jnp.float32
    assert relative_rms(state[..., :-1], jnp.einsum("btkd,btke->bkde", k, v)) <= 1e-5
    assert relative_rms(state[..., -1], k.sum(axis=1)) <= 1e-5
    z = jnp.cumsum(k, axis=1)
    assert relative_rms(normaliser, 16 ** -0.5 * jnp.einsum("bthd,bthd->bth", q, z)) <= 1e-5
    assert relative_rms(numerator / normaliser_raw[..., None], o) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_matches_fla_naive_linear_attn(dtype):
    naive = fla_naive("linear_attn")  # skips, or fails in CI, without torch and fla-core
    import torch
    (q, k, v), _ = random_inputs("linear_attn", 41, 70, 4, 16)
    (o, _), state = linear_attn.reference(q, k, v)
    t = lambda x: torch.tensor(np.asarray(x), dtype=getattr(torch, dtype))
    o_fla, (S_fla, z_fla) = naive.naive_recurrent_linear_attn(t(q), t(k), t(v), normalize=True,
                                                              output_final_state=True)
    assert relative_rms(o, o_fla.numpy()) <= 1e-5
    assert relative_rms(state[..., :-1], S_fla.numpy()) <= 1e-5
    assert relative_rms(state[..., -1], z_fla.numpy()[:, 0]) <= 1e-5
