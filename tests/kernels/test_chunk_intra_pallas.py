"""The delta rule's in-chunk Pallas kernel (chunk_intra_pallas.py), interpreted on this CPU.

Output by output against the batched XLA form it replaces (gdn.in_chunk_xla) at fp32 tolerances:
per-channel and scalar gates, hard resets (log α = −1000), chunks of 16, 32 and 64 (one, two and
four sub-chunks), Dk and Dv not powers of two. Then `gdn.pallas` with it against `gdn.reference`:
outputs and gradients with T not a multiple of 64, GQA and resets; `intra="xla"` still reachable.
Every call is jitted: the interpreted kernel compiles in a few seconds under the tests' XLA flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import chunk_intra_pallas, gdn
from tests.kernels.test_pallas import assert_close, check_vjp, make_inputs, pallas_call_names

KERNEL = "linjax_gdn_in_chunk_fwd"
OUTPUTS = ("A^qk", "W", "U~", "Q*Gamma", "K*to_end", "chunk decay")


def chunk_inputs(seed, N, C, Dk, Dv, *, scalar_gate=False, resets=False):
    """[N, 1, 2, C, ...] fp32 blocks as `_chunks_then_states` passes them: unit keys, gates spread
    over (−20, 0] (with −1000 on every 8th token when `resets`), β in (0, 1)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    lead = (N, 1, 2, C)
    q = jax.random.normal(ks[0], (*lead, Dk))
    k = jax.random.normal(ks[1], (*lead, Dk))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (*lead, Dv))
    log_gate = jax.nn.log_sigmoid(4 * jax.random.normal(ks[3], (*lead, 1 if scalar_gate else Dk)) + 2)
    if resets:
        log_gate = log_gate.at[..., 3::8, :].set(-1000.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], lead))
    return q, k, v, log_gate, beta


def kernel(*args, dtype=jnp.float32):
    return chunk_intra_pallas.in_chunk(*args, dtype=dtype, interpret=True, recompute=gdn.in_chunk_xla)


# (N, C, Dk, Dv, scalar gate, resets)
CASES = [(2, 64, 24, 40, False, False), (2, 64, 16, 16, True, True), (1, 32, 16, 24, True, False),
         (1, 16, 16, 16, False, True), (1, 64, 16, 16, False, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-C{}-Dk{}-Dv{}-{}-{}".format(
    *c[:4], "scalar" if c[4] else "chan", "resets" if c[5] else "smooth"))
def test_kernel_matches_the_xla_in_chunk_work(case):
    N, C, Dk, Dv, scalar_gate, resets = case
    args = chunk_inputs(1, N, C, Dk, Dv, scalar_gate=scalar_gate, resets=resets)
    got = jax.jit(kernel)(*args)
    q, k, v, log_gate, beta = args
    want = jax.jit(gdn.in_chunk_xla)(q, k, v, jnp.broadcast_to(log_gate, q.shape), beta)
    for name, g, w in zip(OUTPUTS, got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        assert np.isfinite(np.asarray(g)).all(), name
        assert_close(g, w, 1e-5, name)


def test_bf16_dots_and_outputs():
    """With bf16 dot operands (a bf16 model), W, Ũ and K⊙e^{G_C − G} come out in bf16 (the state
    pass's operand dtype), the rest in fp32, all within bf16 rounding of the fp32 XLA form."""
    args = chunk_inputs(5, 2, 64, 32, 32, resets=True)
    got = jax.jit(lambda *a: kernel(*a, dtype=jnp.bfloat16))(*args)
    want = jax.jit(gdn.in_chunk_xla)(*args)
    assert [g.dtype for g in got] == [jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16,
                                      jnp.float32]
    for name, g, w in zip(OUTPUTS, got, want):
        assert_close(g.astype(jnp.float32), w, 1e-2, name)


def test_kernel_gradients_are_the_xla_forms():
    """The custom_vjp's backward is jax.vjp of the XLA form: the same cotangents give the same
    gradients (the scalar gate's summed over the channels it was broadcast to)."""
    args = chunk_inputs(2, 1, 32, 16, 16, scalar_gate=True, resets=True)
    q, k, v, log_gate, beta = args
    xla = lambda q, k, v, g, b: gdn.in_chunk_xla(q, k, v, jnp.broadcast_to(g, q.shape), b)
    out = jax.eval_shape(xla, *args)
    keys = jax.random.split(jax.random.PRNGKey(3), len(out))
    cotangent = tuple(jax.random.normal(key, o.shape) for key, o in zip(keys, out))
    got = jax.jit(lambda a, ct: jax.vjp(kernel, *a)[1](ct))(args, cotangent)
    want = jax.jit(lambda a, ct: jax.vjp(xla, *a)[1](ct))(args, cotangent)
    assert [g.shape for g in got] == [a.shape for a in args]
    assert_close(got, want, 1e-6, "gradient")


def test_a_chunk_that_is_not_whole_sub_chunks_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel(*chunk_inputs(4, 1, 8, 16, 16))


# ------------------------------------------------------------------ through gdn.pallas


def pallas_fn(intra="pallas"):
    return lambda *a: gdn.pallas(*a[:5], initial_state=a[5], intra=intra)


@pytest.mark.parametrize("scalar_gate", [False, True], ids=["chan", "scalar"])
def test_gdn_pallas_with_the_kernel_matches_the_reference(scalar_gate):
    """T 130 (two chunks of 64 and a padded one), GQA 4:2, an initial state, resets every 8th token:
    outputs and the gradients of every input."""
    q, k, v, log_alpha, beta, h0 = make_inputs(40, 130, 2, 16, True, "float32", unit_keys=True, gate_spread=8.0)
    log_alpha = log_alpha.at[:, 5::8].set(-1000.0)
    if scalar_gate:
        log_alpha = log_alpha[..., 0]
    args = (q, k, v, log_alpha, beta, h0)
    assert KERNEL in "".join(pallas_call_names(pallas_fn(), *args))
    assert_close(jax.jit(pallas_fn())(*args), jax.jit(pallas_fn("xla"))(*args), 1e-5, "against intra=xla")
    assert_close(jax.jit(pallas_fn())(*args), jax.jit(gdn.reference)(*args[:5], initial_state=h0), 1e-5)
    check_vjp(jax.jit(pallas_fn()), lambda *a: gdn.reference(*a[:5], initial_state=a[5]), args, 41)


def test_the_xla_in_chunk_form_stays_reachable():
    q, k, v, log_alpha, beta, h0 = make_inputs(42, 15, 2, 16, True, "float32", unit_keys=True)
    args = (q, k, v, log_alpha, beta, h0)
    assert not any(KERNEL in n for n in pallas_call_names(pallas_fn("xla"), *args))
    with pytest.raises(ValueError, match="intra must be one of"):
        gdn.pallas(q, k, v, log_alpha, beta, intra="triton")
