"""The XLA:CPU "ynn" fusion miscompile of jaxlib 0.10 (reported on 2026-11-22), as a regression test.

What was seen: a jitted chunked kernel at head dim 64 whose initial state is a constant built
inside `jit` (zeros) returned values around 1e30, with no error. linjax used to turn the whole
ynn fusion off on import (`--xla_cpu_experimental_ynn_fusion_type=`), which made SmolLM2's
forward slower (see the README's performance section). The workaround now is the narrow one:
the kernels' default zero state passes an optimization barrier (`gla.initial_state_or_zeros`),
and XLA's fast paths stay on everywhere. These tests run with XLA's default flags, as users
do: each kernel jitted with the default state (the workaround) and with a constant zero state
passed in from inside `jit` (the trigger, no workaround), against the token-by-token reference.
On the machines this project runs on now (AMD EPYC, jaxlib 0.10.0 and 0.10.2) the trigger no
longer miscompiles, so the second case passes too; on a CPU where it does, it fails and says so.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gdn, gla, kgla, linear_attn
from tests.helpers import relative_rms

B, T, H, D = 1, 96, 2, 64


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_alpha = jnp.asarray(-np.abs(rng.standard_normal((B, T, H, D))) * 0.2, jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, H)), jnp.float32)
    return q, k, v, log_alpha, beta


KERNELS = {
    "gla": (gla, lambda q, k, v, la, b: (q, k, v, la)),
    "gdn": (gdn, lambda q, k, v, la, b: (q, k, v, la, b)),
    "gdn scalar gate": (gdn, lambda q, k, v, la, b: (q, k, v, la[..., 0], b)),
    "kgla": (kgla, lambda q, k, v, la, b: (q, k, v, la, b)),
    # Positive features (as Hedgehog's), so the normaliser stays away from zero.
    "linear attention": (linear_attn, lambda q, k, v, la, b: (jax.nn.softmax(q), jax.nn.softmax(k), v)),
}


def test_xla_fast_paths_are_on():
    """linjax no longer disables the ynn fusion behind the user's back."""
    import linjax  # noqa: F401  (importing it used to set the flag)

    assert "ynn_fusion_type" not in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("state", ["default (barrier)", "constant zeros inside jit"])
def test_jitted_chunked_kernel_at_head_dim_64_matches_the_reference(name, state):
    module, pick = KERNELS[name]
    args = pick(*inputs())
    value_dim = D + 1 if module is linear_attn else D
    zeros = (lambda: {}) if state.startswith("default") else (
        lambda: {"initial_state": jnp.zeros((B, H, D, value_dim), jnp.float32)})
    expected = module.reference(*args, initial_state=jnp.zeros((B, H, D, value_dim), jnp.float32))
    actual = jax.jit(lambda *a: module.chunked(*a, **zeros()))(*args)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.isfinite(np.asarray(got)).all(), f"{name} with {state}: non-finite output (the miscompile)"
        assert relative_rms(np.asarray(got), np.asarray(want)) <= 1e-5, f"{name} with {state}"
