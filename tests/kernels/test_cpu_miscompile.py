"""The XLA:CPU "ynn" fusion miscompile of jaxlib 0.10, as a regression test.

The trigger: a jitted chunked kernel at head dim 64 whose initial state is a constant built
inside `jit` (zeros) can return values around 1e30, with no error. The workaround is narrow:
the kernels' default zero state passes an optimization barrier (`gla.initial_state_or_zeros`),
so XLA's fast paths (the ynn fusions among them) stay on everywhere. A miscompile depends on the compiler's settings, so
these checks run in one subprocess with the XLA flags users have, not the suite's
optimization level 0 (tests/conftest.py; the ynn fusions are emitted there too, 27 in a small
GDN program, but the passes around them differ): each kernel jitted with the default state
(the workaround) and with a constant zero state passed in from inside `jit` (the trigger, no
workaround), against the token-by-token reference.
Where the trigger does not miscompile (AMD EPYC with jaxlib 0.10.0 and 0.10.2) the second case
passes too; on a CPU where it does, it fails and says so.
"""

import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gdn, gla, kgla, linear_attn
from tests.helpers import environment_with_user_xla_flags, python_environment, relative_rms

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


STATES = ["default (barrier)", "constant zeros inside jit"]


def check_every_kernel() -> dict:
    """{"kernel | state": (all finite, relative RMS against the reference)} and XLA_FLAGS after `import linjax`."""
    import linjax  # noqa: F401  (importing it used to turn the ynn fusion off)

    results = {"xla_flags_after_import": os.environ.get("XLA_FLAGS", "")}
    for name, (module, pick) in KERNELS.items():
        args = pick(*inputs())
        value_dim = D + 1 if module is linear_attn else D
        expected = module.reference(*args, initial_state=jnp.zeros((B, H, D, value_dim), jnp.float32))
        for state in STATES:
            zeros = (lambda: {}) if state.startswith("default") else (
                lambda: {"initial_state": jnp.zeros((B, H, D, value_dim), jnp.float32)})
            actual = jax.jit(lambda *a: module.chunked(*a, **zeros()))(*args)
            pairs = list(zip(jax.tree.leaves(actual), jax.tree.leaves(expected)))
            results[f"{name} | {state}"] = (all(bool(np.isfinite(np.asarray(got)).all()) for got, _ in pairs),
                                            max(relative_rms(np.asarray(got), np.asarray(want)) for got, want in pairs))
    return results


@pytest.fixture(scope="module")
def with_user_flags():
    """`check_every_kernel` in a subprocess compiled with the user's XLA flags."""
    done = subprocess.run([sys.executable, "-c", "import json; from tests.kernels.test_cpu_miscompile import "
                           "check_every_kernel; print(json.dumps(check_every_kernel()))"],
                          env=python_environment(environment_with_user_xla_flags()), cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_xla_fast_paths_are_on(with_user_flags):
    """linjax no longer disables the ynn fusion behind the user's back."""
    assert "ynn_fusion_type" not in with_user_flags["xla_flags_after_import"]


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("state", STATES)
def test_jitted_chunked_kernel_at_head_dim_64_matches_the_reference(name, state, with_user_flags):
    finite, error = with_user_flags[f"{name} | {state}"]
    assert finite, f"{name} with {state}: non-finite output (the miscompile)"
    assert error <= 1e-5, f"{name} with {state}: relative RMS {error:.2e}"
